"""§1 on a CPU: one weight read serving many tokens, with the weights laid out for the read. With
`enforce_eager=False` each `nn.Linear` becomes a `PackedLinear`, its weight repacked once into
16-column panels that cpu_linear.c's GEMM streams front to back: at 16 rows on an AVX2 CPU ~8 GB/s
of weights where oneDNN read ~5; faster from 1 to 64 rows, on par at 256-512. bf16 is packed only
without AMX or AVX512-BF16: with them, oneDNN is faster."""

from __future__ import annotations

import ctypes

import torch
from torch import nn


def cpu_has_bf16_matmul() -> bool:
    """Native bf16 (AMX or AVX512-BF16, vLLM's CPU check); else emulated, slower than fp32."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL) -> None:
        super().__init__()
        # The plain weight stays the module's parameter (tied embeddings, parameter counts);
        # forward reads only the packed copy: [N, K] -> [N / 16, K, 16].
        self.weight, self.bias = linear.weight, linear.bias
        n, k = linear.weight.shape
        self.packed = linear.weight.detach().view(n // 16, 16, k).transpose(1, 2).contiguous()
        self.gemm = lib.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.weight.shape
        rows = x  # the model's activations are already [tokens, k], contiguous, this dtype
        if x.dim() != 2 or x.dtype != self.weight.dtype or not x.is_contiguous():
            rows = x.reshape(-1, k).to(self.weight.dtype).contiguous()
        y = torch.empty(rows.shape[0], n, dtype=rows.dtype)
        self.gemm(rows.data_ptr(), self.packed.data_ptr(),
                  None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                  rows.shape[0], n, k, rows.dtype == torch.bfloat16)
        return y if rows is x else y.view(*x.shape[:-1], n)


def pack_linears(model: nn.Module, lib: ctypes.CDLL) -> None:
    dtypes = {torch.float32} if cpu_has_bf16_matmul() else {torch.float32, torch.bfloat16}
    for module in list(model.modules()):
        for name, child in module.named_children():
            if (isinstance(child, nn.Linear) and child.weight.dtype in dtypes
                    and child.out_features % 16 == 0 and child.weight.device.type == "cpu"):
                setattr(module, name, PackedLinear(child, lib))
