"""§1 on a CPU, fast: one weight read serving every row of the step, with the weights laid out
for the read. Each `nn.Linear` becomes one of two modules, chosen by `linear_kind` from what the
CPU has (nanoserve/utils/cpu.py), never per call:
  - `OneDNNLinear`: torch's oneDNN GEMM on a weight reordered once into its blocked layout
    (what torch's inductor does for CPU linears); it runs bf16 on AMX or AVX512-BF16 units.
  - `PackedLinear`: csrc/linear.c's GEMM on 16-column panels, streamed front to back. It stays
    where it measured faster than oneDNN: fp32 at decode batch sizes, and bf16 on CPUs without
    native bf16, which it widens to fp32 once per panel (docs/benchmarks.md, "GEMM"). On CPUs
    with AVX-512, oneDNN measured faster from `ONEDNN_FROM_ROWS` rows on (large decode batches,
    prefill chunks): there a PackedLinear keeps oneDNN's layout too and hands those calls over."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from nanoserve.utils import cpu

ONEDNN_FROM_ROWS = 64


def linear_kind(dtype: torch.dtype, c_gemm_fits: bool) -> str:
    """The one dispatch rule: oneDNN for bf16 on native-bf16 CPUs (and whenever the C kernels
    did not build), the C GEMM otherwise; float16 keeps nn.Linear."""
    if dtype not in (torch.float32, torch.bfloat16):
        return "plain"  # float16 on a CPU: torch's own nn.Linear
    if not c_gemm_fits:  # no C kernels here, or a shape they do not take
        return "onednn"
    return "onednn" if dtype == torch.bfloat16 and cpu.has_native_bf16() else "c"


class OneDNNLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        # The plain weight stays the parameter (tied embeddings, parameter counts).
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def onednn_from_rows(dtype: torch.dtype) -> int | None:
    """From how many rows a PackedLinear hands over to oneDNN (None: never)."""
    wide = "avx512f" in cpu.cpu_flags() and torch.backends.mkldnn.is_available()
    return ONEDNN_FROM_ROWS if dtype == torch.float32 and wide else None


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.from_rows = onednn_from_rows(linear.weight.dtype)
        self.onednn = None if self.from_rows is None else OneDNNLinear(linear)
        n, k = linear.weight.shape  # [N, K] -> [N / 16, K, 16]
        self.packed = linear.weight.detach().view(n // 16, 16, k).transpose(1, 2).contiguous()
        # Read once here, not per call: a parameter's lookup through nn.Module is slow next to
        # a small GEMM, and a step makes a few hundred calls.
        self.n, self.k, self.dtype, self.gemm = n, k, linear.weight.dtype, lib.linear
        self.packed_ptr = self.packed.data_ptr()
        self.bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn is not None and x.numel() >= self.from_rows * self.k:
            return self.onednn(x)
        rows = x  # the model's activations are already [tokens, k], contiguous, this dtype
        if x.dim() != 2 or x.dtype != self.dtype or not x.is_contiguous():
            rows = x.reshape(-1, self.k).to(self.dtype).contiguous()
        y = torch.empty(rows.shape[0], self.n, dtype=self.dtype)
        self.gemm(rows.data_ptr(), self.packed_ptr, self.bias_ptr, y.data_ptr(), self.n,
                  rows.shape[0], self.k, self.dtype == torch.bfloat16)
        return y if rows is x else y.view(*x.shape[:-1], self.n)


def replace_linears(model: nn.Module, lib: ctypes.CDLL | None) -> None:
    """Swap every CPU nn.Linear of `model` for the module `linear_kind` picks (the C GEMM
    needs a multiple of 16 outputs)."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if not isinstance(child, nn.Linear) or child.weight.device.type != "cpu":
                continue
            kind = linear_kind(child.weight.dtype, lib is not None and child.out_features % 16 == 0)
            if kind == "c":
                setattr(module, name, PackedLinear(child, lib))
            elif kind == "onednn" and torch.backends.mkldnn.is_available():
                setattr(module, name, OneDNNLinear(child))
