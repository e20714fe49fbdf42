"""§1 on a CPU: one weight read serving many tokens, with the weights laid out for the read. With
`enforce_eager=False` each `nn.Linear` becomes a `PackedLinear`, its weight repacked once into
16-column panels that cpu_linear.c's GEMM streams front to back: at 16 rows on an AVX2 CPU ~8 GB/s
of weights where oneDNN read ~5; faster from 1 to 64 rows, on par at 256-512. bf16 is packed only
without AMX or AVX512-BF16: with them, oneDNN is faster."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from nanoserve.utils import cpu


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL) -> None:
        super().__init__()
        # The plain weight stays the module's parameter (tied embeddings, parameter counts);
        # forward reads only the packed copy: [N, K] -> [N / 16, K, 16].
        self.weight, self.bias = linear.weight, linear.bias
        n, k = linear.weight.shape
        self.packed = linear.weight.detach().view(n // 16, 16, k).transpose(1, 2).contiguous()
        # What every call passes, read once here: a parameter's lookup through nn.Module costs
        # ~2 us, and a step makes ~120 calls with ~10 lookups each.
        self.n, self.k, self.dtype, self.gemm = n, k, linear.weight.dtype, lib.linear
        self.packed_ptr = self.packed.data_ptr()
        self.bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linears(x, self)[0]


def packed_linears(x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    """x through each of `linears`: one GEMM call for all when they are PackedLinears of one
    dtype and input size (the decoder's `project` hook: q, k, v; gate, up), else one call each."""
    first, count = linears[0], len(linears)
    if not all(isinstance(m, PackedLinear) and m.dtype == first.dtype and m.k == first.k
               for m in linears):
        return [linear(x) for linear in linears]
    rows = x  # the model's activations are already [tokens, k], contiguous, this dtype
    if x.dim() != 2 or x.dtype != first.dtype or not x.is_contiguous():
        rows = x.reshape(-1, first.k).to(first.dtype).contiguous()
    ys = [torch.empty(rows.shape[0], m.n, dtype=first.dtype) for m in linears]
    pointers = ctypes.c_void_p * count
    first.gemm(rows.data_ptr(), pointers(*[m.packed_ptr for m in linears]),
               pointers(*[m.bias_ptr for m in linears]), pointers(*[y.data_ptr() for y in ys]),
               (ctypes.c_int * count)(*[m.n for m in linears]), count, rows.shape[0], first.k,
               first.dtype == torch.bfloat16)
    return ys if rows is x else [y.view(*x.shape[:-1], y.shape[1]) for y in ys]


def pack_linears(model: nn.Module, lib: ctypes.CDLL) -> None:
    dtypes = {torch.float32} if cpu.has_native_bf16() else {torch.float32, torch.bfloat16}
    for module in list(model.modules()):
        for name, child in module.named_children():
            if (isinstance(child, nn.Linear) and child.weight.dtype in dtypes
                    and child.out_features % 16 == 0 and child.weight.device.type == "cpu"):
                setattr(module, name, PackedLinear(child, lib))
        if hasattr(module, "project"):  # the decoder's q/k/v and gate/up: one call each group
            module.project = packed_linears
