"""§4's element-wise steps on a CPU in one C call each (csrc/fused.c): RMSNorm, the split of the
merged q|k|v rows into heads with RoPE, and SiLU-and-multiply, where torch runs 3-10 small ops,
each with its own pass over memory, output and (bf16) widening and rounding (bf16 prefill chunks:
0.24 of 1.81 s in them, docs/benchmarks.md). Each replaces the decoder's module of the same name
(`input_layernorm`, `self_attn`, `act_fn`, ...), built from it and holding the same parameters;
the C rounds where torch's ops round, so both compute the same values."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.attention import AttentionMetadata
from nanoserve.models.decoder import DecoderAttention, RMSNorm, SiluAndMul

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read


class FusedRMSNorm(RMSNorm):
    def __init__(self, norm: RMSNorm, lib: ctypes.CDLL) -> None:
        nn.Module.__init__(self)
        self.weight, self.eps, self.lib = norm.weight, norm.eps, lib

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in KERNEL_DTYPES or x.dtype != self.weight.dtype or not x.is_contiguous():
            return super().forward(x)
        out = torch.empty_like(x)
        self.lib.rms_norm(x.data_ptr(), self.weight.data_ptr(), out.data_ptr(),
                          x.numel() // x.shape[-1], x.shape[-1], self.eps,
                          x.dtype == torch.bfloat16)
        return out


class FusedSiluAndMul(SiluAndMul):
    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.lib = lib

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype not in KERNEL_DTYPES or gate_up.dim() != 2 or not gate_up.is_contiguous():
            return super().forward(gate_up)
        n, width = gate_up.shape
        out = gate_up.new_empty(n, width // 2)
        self.lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), n, width // 2,
                          gate_up.dtype == torch.bfloat16)
        return out


class FusedAttention(nn.Module):
    """DecoderAttention.forward with the q|k|v split and RoPE in one C call (`plain` is the
    decoder's module: its linears and attention; Qwen3's head norms keep its own forward)."""

    def __init__(self, plain: DecoderAttention, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.plain, self.lib = plain, lib

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        p = self.plain
        qkv = p.qkv_proj(x)
        n, d = len(cos), p.head_dim  # the step's tokens (x may have zero rows after them)
        if (p.qk_norm or qkv.dtype not in KERNEL_DTYPES or d % 2 or not qkv.is_contiguous()
                or cos.dtype != qkv.dtype or not (cos.is_contiguous() and sin.is_contiguous())):
            return padded(p(x[:n], cos, sin, meta), len(x))
        q = qkv.new_empty(n, p.num_heads, d)
        k, v = (qkv.new_empty(n, p.num_kv_heads, d) for _ in "kv")
        self.lib.qkv_rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                          k.data_ptr(), v.data_ptr(), n, p.num_heads, p.num_kv_heads, d,
                          qkv.dtype == torch.bfloat16)
        return p.o_proj(padded(p.attn(q, k, v, meta).view(n, p.num_heads * d), len(x)))


def padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [n, d] as the first n of `rows` rows, the others zeros (x itself if n == rows)."""
    return x if len(x) == rows else F.pad(x, (0, 0, 0, rows - len(x)))


def fuse_elementwise(model: nn.Module, lib: ctypes.CDLL) -> None:
    """Replace each RMSNorm, SiluAndMul and DecoderAttention of `model` by its fused twin."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is RMSNorm:
                setattr(module, name, FusedRMSNorm(child, lib))
            elif type(child) is SiluAndMul:
                setattr(module, name, FusedSiluAndMul(lib))
            elif type(child) is DecoderAttention:
                setattr(module, name, FusedAttention(child, lib))
