"""§1 on CPUs with AMX: bf16 linears at decode batch sizes on csrc/amx.c's tile GEMM, which streams
a weight packed once into the tiles' layout and serves every row of the step from one read of it.
oneDNN's bf16 path (AMX too) streamed the same weights well below memory speed at these sizes and
costs more per call; it keeps the large batches (prefill chunks). linear.py `linear_kind` picks
this module where the CPU probe shows amx_bf16, the library was built with the kernel and Linux
lets the process use the tiles (kernels.has_amx), for the shapes the kernel takes (`amx_fits`)."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from nanoserve_accel import kernels

# Up to this many rows (csrc/amx.c's pass: each weight tile read once, serving every row) the AMX
# GEMM measured faster than oneDNN, clearly to 32 rows, a little at 48-64; each further pass reads
# the weights again, and oneDNN's blocking measured faster from the next size up
# (scripts/bench/gemm_compare.py). It also measured faster than the dpbf16 GEMM at every row count
# that one takes, so on AMX CPUs it replaces that one too.
AMX_MAX_ROWS = 64


def amx_fits(linear: nn.Linear) -> bool:
    """The kernel's tiles: 16 output columns by 32 k, so N % 16 == 0 and K % 32 == 0."""
    return (linear.weight.dtype == torch.bfloat16 and linear.out_features % 16 == 0
            and linear.in_features % 32 == 0)


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16][K / 32][16 k-pairs][16 columns][2]: for each 16 columns, one 1 KB tile
    per 32 k in the VNNI order the tile unit multiplies, the column group's tiles front to back."""
    n, k = weight.shape
    return weight.detach().view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


class AmxLinear(nn.Module):
    """bf16 up to AMX_MAX_ROWS rows: csrc/amx.c on the packed weight; beyond, oneDNN
    (`onednn`, an OneDNNLinear, or None: the AMX GEMM at every size). Memory: the plain weight,
    the packed copy and oneDNN's reordered one."""

    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL, onednn: nn.Module | None) -> None:
        super().__init__()
        if not amx_fits(linear):
            raise ValueError(f"the AMX GEMM takes bf16 weights with N % 16 == 0 and K % 32 == 0, "
                             f"not {linear.weight.dtype} [{linear.out_features}, "
                             f"{linear.in_features}]")
        self.weight, self.bias, self.onednn = linear.weight, linear.bias, onednn
        self.packed = pack_tiles(linear.weight)
        self.n, self.k = linear.out_features, linear.in_features
        # Read once here, not per call (a step makes a few hundred): the kernel reads bf16 bias.
        bias = None if self.bias is None else self.bias.detach().to(torch.bfloat16)
        self.bias_bf16 = None if bias is None else bias.contiguous()
        self.gemm, self.packed_ptr = lib.linear_amx, self.packed.data_ptr()
        self.bias_ptr = None if self.bias_bf16 is None else self.bias_bf16.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn is not None and x.numel() > AMX_MAX_ROWS * self.k:
            return self.onednn.forward(x)  # not through nn.Module's __call__: ~150 calls a step
        return kernels.c_gemm(x, self, torch.bfloat16, self.packed_ptr)
