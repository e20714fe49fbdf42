"""The element-wise kernels (layers/cpu_fused.c) against decoder.py's and the sampler's torch,
on shapes below and above the size at which they split over threads, in float32 and in bf16
(where they round as torch's ops do), and the runner's swap."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest
import torch
from tiny_model import tiny_model_dir

from nanoserve.config import EngineConfig, resolve_config
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.layers import cpu_kernels
from nanoserve.layers.cpu_fused import FusedOps, FusedRMSNorm
from nanoserve.models import decoder
from nanoserve.models.loader import load_config

LIB = cpu_kernels.compile_kernels()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler here")
OPS = FusedOps(LIB) if LIB else None
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 within 1e-5 (sums in another order); bf16 exactly, as both round the same floats,
    but for rare values one bf16 step apart (a float32 sum's last bit moved across a rounding)
    and ~1e-36 for 0 (silu of -200: e^-87, not e^-200)."""
    assert got.dtype == expected.dtype
    if got.dtype == torch.bfloat16:
        assert ((got != expected) & (expected.abs() > 1e-30)).float().mean() < 1e-3
        torch.testing.assert_close(got, expected, atol=1e-30, rtol=2**-7)
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@DTYPES
@pytest.mark.parametrize("rows, dim", [(1, 8), (3, 20), (64, 576)])
def test_rms_norm(rows, dim, dtype):
    torch.manual_seed(dim)
    norm = decoder.RMSNorm(dim, eps=1e-5)
    norm.weight.data.uniform_(0.5, 2.0)
    norm, x = norm.to(dtype), (torch.randn(rows, dim) * 3).to(dtype)
    with torch.inference_mode():
        assert_same(FusedRMSNorm(norm, LIB)(x), norm(x))


@DTYPES
@pytest.mark.parametrize("n, heads, head_dim", [(1, 2, 8), (5, 3, 6), (64, 9, 64)])
def test_rotary_in_place(n, heads, head_dim, dtype):
    torch.manual_seed(n)
    rope = decoder.RotaryEmbedding(head_dim, max_positions=512, base=10000.0)
    cos, sin = rope(torch.randint(0, 512, (n,)), dtype)
    x = torch.randn(n, heads, head_dim).to(dtype)
    expected = decoder.apply_rotary(x, cos, sin)
    got = OPS.rotary(x, cos, sin)
    assert got.data_ptr() == x.data_ptr()  # in place
    assert_same(got, expected)


@DTYPES
@pytest.mark.parametrize("shape", [(1, 7), (3, 100), (64, 1536)])
def test_silu_and_mul(shape, dtype):
    torch.manual_seed(shape[1])
    gate, up = torch.randn(shape) * 10, torch.randn(shape)
    gate[0, 0], gate[-1, -1] = -200.0, 200.0  # e^200 would overflow; e^-200 must not
    gate, up = gate.to(dtype), up.to(dtype)
    assert_same(OPS.silu_and_mul(gate, up), decoder.silu_and_mul(gate, up))


@pytest.mark.parametrize("cols", [1, 7, 8, 9, 100, 49153])
def test_argmax_matches_torch_on_ties_infinities_and_nan(cols):
    torch.manual_seed(cols)
    logits = torch.randn(9, cols)
    logits[1] = 1.0  # all tied: the first
    logits[2] = float("-inf")
    logits[3, -1] = float("inf")
    logits[4, cols // 2] = float("nan")  # NaN wins, as torch.argmax has it
    logits[5, cols // 3:] = 5.0  # a tie in the middle
    if cols > 2:
        logits[6, 1:3] = float("nan")  # the first NaN
    assert OPS.argmax(logits).tolist() == logits.argmax(dim=-1).tolist()


def test_runner_swaps_them_in_only_for_fp32_and_bf16_when_optimized(monkeypatch):
    model_dir = tiny_model_dir()

    def runner(dtype, eager):
        config = EngineConfig(dtype=dtype, device="cpu", num_kv_blocks=8, enforce_eager=eager)
        return ModelRunner(resolve_config(config, load_config(model_dir)), model_dir)

    def swapped(r):
        layer = r.model.model.layers[0]
        return [isinstance(r.model.model.norm, FusedRMSNorm),
                layer.mlp.act_and_mul != decoder.silu_and_mul,
                layer.self_attn.rotary != decoder.apply_rotary,
                isinstance(getattr(r.sampler.argmax, "__self__", None), FusedOps)]

    calls = []
    monkeypatch.setattr(cpu_kernels, "keep_freed_memory", lambda: calls.append(1))
    assert swapped(runner("float32", eager=False)) == [True] * 4
    assert swapped(runner("float32", eager=True)) == [False] * 4
    assert calls == [1, 1]  # every CPU runner keeps freed buffers in the heap
    assert swapped(runner("bfloat16", eager=False)) == [True] * 4
    assert swapped(runner("float16", eager=False)) == [False] * 4


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"), reason="not glibc")
def test_keep_freed_memory_stops_the_page_faults_of_reallocated_buffers():
    """In a fresh process: a 16 MB buffer (the logits at ~80 rows), freed and allocated again,
    is page-faulted in again by glibc's default, and not after keep_freed_memory()."""
    script = """
import resource, torch
from nanoserve.layers import cpu_kernels

def faults():
    torch.empty(16 << 20, dtype=torch.uint8).fill_(1)  # allocated, touched, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(16 << 20, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print(faults())
cpu_kernels.keep_freed_memory()
print(min(faults() for _ in range(3)))  # glibc still gives memory back now and then
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    default, kept = map(int, run.stdout.split())
    assert default > 1000 and kept < 100  # 16 MB: 4,096 pages of 4 KB
