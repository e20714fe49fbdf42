"""The element-wise kernels (accel/csrc/fused.c, accel/fused.py) against the decoder's torch ops,
on shapes below and above the size at which they split over threads, in float32 and in bf16
(where they round as torch's ops round), and a whole fused model against the plain one."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from nanoserve.models import decoder
from nanoserve_accel import kernels
from nanoserve_accel.fused import (
    FusedAttention,
    FusedRMSNorm,
    FusedSiluAndMul,
    fuse_elementwise,
)
from tests.common.helpers import bind_kv_cache, run_step

LIB = kernels.compile_kernels()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler here")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 within 1e-5 (sums in another order); bf16 exactly but for rare values a bf16 step or
    two apart (a float32 sum's last bit moved across a rounding), and ~1e-36 for 0 (silu of -200:
    e^-87, not e^-200)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.bfloat16:
        assert ((got != expected) & (expected.abs() > 1e-30)).float().mean() < 1e-3
        # A bf16 step is at most 2^-7 of the larger of the two values. Two steps: RMSNorm rounds
        # twice (x / rms, then times the weight, up to 2), so a sum whose last bit moved can
        # move the first rounding by one step and the output by two (found with the kernels
        # built for `make test-sanitize`, whose sums run in another order).
        got32, expected32 = got.float(), expected.float()
        two_steps = torch.maximum(got32.abs(), expected32.abs()) * 2**-6
        assert ((got32 - expected32).abs() <= two_steps + 1e-30).all()
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)




@DTYPES
@pytest.mark.parametrize(("rows", "dim"), [(1, 8), (3, 20), (64, 576)])
def test_rms_norm(rows, dim, dtype):
    torch.manual_seed(dim)
    norm = decoder.RMSNorm(dim, eps=1e-5)
    norm.weight.data.uniform_(0.5, 2.0)
    norm, x = norm.to(dtype), (torch.randn(rows, dim) * 3).to(dtype)
    with torch.inference_mode():
        assert_same(FusedRMSNorm(norm, LIB)(x), norm(x))
        strided = x.T.contiguous().T  # not contiguous: torch's ops
        assert_same(FusedRMSNorm(norm, LIB)(strided), norm(strided))


def attention_module(heads: int, kv_heads: int, head_dim: int, dtype) -> decoder.DecoderAttention:
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=512)
    rope = decoder.RotaryEmbedding(head_dim, max_positions=512, base=10000.0)
    return decoder.DecoderAttention(config, rope).to(dtype)


@DTYPES
@pytest.mark.parametrize(("n", "heads", "kv_heads", "head_dim"),
                         [(1, 2, 1, 8), (5, 3, 3, 6), (64, 9, 3, 64)])
def test_qkv_split_with_rope(n, heads, kv_heads, head_dim, dtype):
    """The fused attention hands attention exactly the q, k, v the decoder's split and RoPE
    give (captured at the attention call), contiguous."""
    torch.manual_seed(n)
    plain = attention_module(heads, kv_heads, head_dim, dtype)
    cos, sin = plain.rotary_emb.cos_sin(torch.randint(0, 512, (n,)), dtype)
    x = torch.randn(n, heads * head_dim).to(dtype)
    seen = []
    plain.attn.forward = lambda q, k, v, meta: seen.append((q, k, v)) or torch.zeros_like(q)
    with torch.inference_mode():
        plain(x, cos, sin, None)
        FusedAttention(plain, LIB)(x, cos, sin, None)
    (expected, got) = seen
    for g, e in zip(got, expected):
        assert g.is_contiguous()
        assert_same(g, e)


@DTYPES
@pytest.mark.parametrize("shape", [(1, 14), (3, 200), (64, 3072)])
def test_silu_and_mul(shape, dtype):
    torch.manual_seed(shape[1])
    gate_up = torch.randn(shape) * 10
    gate_up[0, 0], gate_up[-1, shape[1] // 2 - 1] = -200.0, 200.0  # e^200 would overflow
    with torch.inference_mode():
        assert_same(FusedSiluAndMul(LIB)(gate_up.to(dtype)),
                    decoder.SiluAndMul()(gate_up.to(dtype)))


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@DTYPES
@pytest.mark.parametrize("config", [LlamaConfig(**SMALL), Qwen3Config(head_dim=8, **SMALL)],
                         ids=lambda c: c.model_type)
def test_fused_model_computes_what_the_plain_one_does(config, dtype):
    """Qwen3's q/k norms come before RoPE: its attention keeps the torch split."""
    torch.manual_seed(0)
    plain = decoder.DecoderForCausalLM(config).eval().to(dtype)
    fast = copy.deepcopy(plain)
    fuse_elementwise(fast, LIB)
    kinds = {type(m) for m in fast.modules()}
    assert {FusedRMSNorm, FusedAttention, FusedSiluAndMul} <= kinds
    assert decoder.RMSNorm not in kinds and decoder.SiluAndMul not in kinds
    logits = []
    for model in (plain, fast):
        bind_kv_cache(model, num_blocks=8, block_size=4, dtype=dtype)
        # a decode at 6 cached tokens, then a 5-token prefill chunk after 2 cached ones
        logits.append(run_step(model, [9, 3, 5, 7, 9, 11], [([0, 1], 6, 1), ([2, 3], 2, 5)], 4))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(logits[1], logits[0], atol=tol, rtol=tol)
