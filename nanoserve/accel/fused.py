"""§4's element-wise steps on a CPU in one C call each (csrc/fused.c): RMSNorm, the merged q|k|v
rows split into heads with RoPE, and SiLU-and-multiply, where torch runs 3-10 small ops, each
with its own pass over memory, output and (bf16) widening and rounding: a bf16 prefill chunk
spent about a third of its time in them (docs/benchmarks.md). Swapped in by class, as
merged.py swaps; the C rounds where torch's ops round, so both compute the same values."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from nanoserve.accel.merged import MergedAttention, MergedMLP
from nanoserve.models.decoder import RMSNorm

DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read


class FusedRMSNorm(RMSNorm):
    lib: ctypes.CDLL

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in DTYPES or x.dtype != self.weight.dtype or not x.is_contiguous():
            return super().forward(x)
        out = torch.empty_like(x)
        self.lib.rms_norm(x.data_ptr(), self.weight.data_ptr(), out.data_ptr(),
                          x.numel() // x.shape[-1], x.shape[-1], self.eps,
                          x.dtype == torch.bfloat16)
        return out


class FusedAttention(MergedAttention):
    lib: ctypes.CDLL

    def heads(self, qkv: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, d = qkv.shape[0], self.head_dim
        if (self.qk_norm or qkv.dtype not in DTYPES or d % 2 or not qkv.is_contiguous()
                or cos.dtype != qkv.dtype or not (cos.is_contiguous() and sin.is_contiguous())):
            return super().heads(qkv, cos, sin)  # Qwen3's head norms come before RoPE
        q = qkv.new_empty(n, self.num_heads, d)
        k, v = (qkv.new_empty(n, self.num_kv_heads, d) for _ in "kv")
        self.lib.qkv_rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                          k.data_ptr(), v.data_ptr(), n, self.num_heads, self.num_kv_heads, d,
                          qkv.dtype == torch.bfloat16)
        return q, k, v


class FusedMLP(MergedMLP):
    lib: ctypes.CDLL

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype not in DTYPES or gate_up.dim() != 2 or not gate_up.is_contiguous():
            return super().act(gate_up)
        n, width = gate_up.shape
        out = gate_up.new_empty(n, width // 2)
        self.lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), n, width // 2,
                          gate_up.dtype == torch.bfloat16)
        return out


FUSED = {RMSNorm: FusedRMSNorm, MergedAttention: FusedAttention, MergedMLP: FusedMLP}


def fuse_elementwise(model: nn.Module, lib: ctypes.CDLL) -> None:
    """Each RMSNorm and merged attention / MLP of `model` (after merge_projections) becomes its
    fused twin, in place, on the CPU."""
    for module in model.modules():
        if (fused := FUSED.get(type(module))) is not None:
            module.__class__, module.lib = fused, lib
