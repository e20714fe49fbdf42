"""§1 on a CPU: one weight read serving many tokens, with the GEMM's own weight layout.

Unless `enforce_eager=True`, every fp32 `nn.Linear` becomes a `PackedLinear`, its weight
reordered once, at load time, into oneDNN's blocked layout, which the GEMM streams as it is
instead of re-tiling the plain [out, in] matrix on every call (measured: ~0.75-0.8x the
time from 2 rows up, ~0.85x at one row with 2 threads). bf16 keeps `F.linear`: with AMX or
AVX512-BF16 it was already faster."""

from __future__ import annotations

import torch
from torch import nn


def cpu_has_bf16_matmul() -> bool:
    """True when the CPU multiplies bf16 natively (AMX or AVX512-BF16), as vLLM's CPU build
    checks; elsewhere bf16 is emulated and several times slower than fp32."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


class PackedLinear(nn.Module):
    """An fp32 `nn.Linear` whose weight also lives pre-packed for oneDNN's GEMM."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        # The plain weight stays the module's parameter (tied embeddings, parameter counts);
        # forward reads only the packed copy.
        self.weight, self.bias = linear.weight, linear.bias
        # The packed copy is laid out for batches of ~16 rows (decode); any row count works.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> None:
    """Replace every fp32 nn.Linear of a CPU model by a PackedLinear (in place)."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32:
                setattr(module, name, PackedLinear(child))
