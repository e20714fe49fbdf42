"""§4's element-wise steps on a CPU, fp32 or bf16: RMSNorm, RoPE, SiLU-and-multiply and greedy
argmax, each one call into cpu_fused.c where torch runs 2-7 small ops, each its own pass over memory
and thread start (fp32 decode step: 0.93x at 1 row, 0.91x at 16). The ModelRunner swaps them in
(no eager). bf16 rounds where torch's ops round, so both paths compute the same."""

from __future__ import annotations

import ctypes

import torch
from torch import nn


def is_bf16(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16  # else float32: the runner swaps these in for those two


class FusedRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.weight, self.eps, self.lib = norm.weight, norm.eps, lib

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        self.lib.rms_norm(x.data_ptr(), self.weight.data_ptr(), out.data_ptr(),
                          x.numel() // x.shape[-1], x.shape[-1], self.eps, is_bf16(x))
        return out


class FusedOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """In place: x is this step's fresh q or k, [num_tokens, heads, head_dim]."""
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        self.lib.rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), *x.shape, is_bf16(x))
        return x

    def silu_and_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        self.lib.silu_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(),
                          is_bf16(gate))
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32 -> [rows] int64, ties and NaN as torch.argmax."""
        logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self.lib.argmax_rows(logits.data_ptr(), out.data_ptr(), *logits.shape)
        return out
