"""§1 on a CPU, fast: one weight read serving every row of the step, with the weights laid out
for the read. Each `nn.Linear` becomes one of three modules, chosen by `linear_kind` from what
the CPU has (nanoserve/utils/cpu.py), never per call:
  - `OneDNNLinear`: torch's oneDNN GEMM on a weight reordered once into its blocked layout
    (what torch's inductor does for CPU linears); it runs bf16 on AMX or AVX512-BF16 units.
  - `PackedLinear`: csrc/linear.c's GEMM on 16-column panels, streamed front to back. It stays
    where it measured faster than oneDNN: fp32 at decode batch sizes, and bf16 on CPUs without
    native bf16, which it widens to fp32 once per panel (docs/benchmarks.md, "GEMM"). On CPUs
    with AVX-512, oneDNN measured faster from `ONEDNN_FROM_ROWS` rows on (large decode batches,
    prefill chunks): there a PackedLinear keeps oneDNN's layout too and hands those calls over.
  - `Dpbf16Linear`: bf16 on CPUs with AVX512-BF16 (and a library built for it): csrc/dpbf16.c's
    dot products on the plain weight for a few rows, where oneDNN streamed the weights well
    below memory speed; oneDNN from `DPBF16_BELOW_ROWS` rows on.
  - `AmxLinear` (amx_linear.py): bf16 on CPUs with AMX, for the shapes its tiles take, in place
    of the dpbf16 GEMM and of oneDNN at decode batch sizes.
  - `DotFp32Linear`: fp32 on CPUs with AVX-512 (and a library built for it): csrc/dot_fp32.c,
    the same dot products in float32, below `DOT_FP32_BELOW_ROWS` rows; oneDNN from there on.
    It takes PackedLinear's place there, and its packed copy of the weights."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from nanoserve.layers.linear import RowParallelLinear
from nanoserve.utils import cpu
from nanoserve_accel import kernels
from nanoserve_accel.amx_linear import AmxLinear, amx_fits

ONEDNN_FROM_ROWS = 64
# Below this the dpbf16 GEMM measured faster than oneDNN (clearly at 1-4 rows, where it streams
# the weights near memory speed, about level at 6-7); at 8 it is bound by dpbf16's issue rate
# and oneDNN's AMX path keeps up (scripts/bench/gemm_compare.py).
DPBF16_BELOW_ROWS = 8
# Below this the fp32 dot-product GEMM measured faster than the packed C GEMM (clearly at 1-9
# rows, memory-bound, about level from 16, where both are bound by the FMAs), so on AVX-512 it
# replaces it; the GEMMs alone are level with oneDNN's from 64 rows, but a decode step on them,
# one C call per layer (layer.py), measured faster than oneDNN's modules up to 96 rows and level
# at 128 (whole steps, scripts/bench/step_times.py), so oneDNN takes over from 96.
DOT_FP32_BELOW_ROWS = 96


def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether torch's oneDNN runs this dtype's GEMMs here: bf16 needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT (what the machine has, whatever the CPU probe is faked as)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def linear_kind(dtype: torch.dtype, c_gemm_fits: bool, dpbf16: bool = False,
                amx: bool = False, dot_fp32: bool = False) -> str:
    """The one dispatch rule: bf16 on native-bf16 CPUs takes the AMX GEMM where the CPU has
    amx_bf16 and the library has the kernel for this shape (`amx`), else the dpbf16 GEMM where the
    CPU has AVX512-BF16 and the library was built with it (`dpbf16`), else oneDNN; fp32 the
    dot_fp32 GEMM where the CPU has AVX-512 and the library was built with it (`dot_fp32`); oneDNN
    whenever the C kernels did not build; the C GEMM otherwise; float16 keeps nn.Linear."""
    if dtype not in (torch.float32, torch.bfloat16):
        return "plain"  # float16 on a CPU: torch's own nn.Linear
    if dtype == torch.float32 and dot_fp32 and "avx512f" in cpu.cpu_flags():
        return "dot_fp32"
    if dtype == torch.bfloat16 and cpu.has_native_bf16():
        if amx and "amx_bf16" in cpu.cpu_flags():
            return "amx"
        if dpbf16 and "avx512_bf16" in cpu.cpu_flags():
            return "dpbf16"
        if onednn_takes(dtype):
            return "onednn"
    if c_gemm_fits:
        return "c"
    return "onednn" if onednn_takes(dtype) else "plain"  # no C kernels, or a shape they refuse


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
    wide = "avx512f" in cpu.cpu_flags() and onednn_takes(dtype)
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
        return kernels.c_gemm(x, self, self.dtype, self.packed_ptr, self.dtype == torch.bfloat16)


class DotLinear(nn.Module):
    """A dot-product C GEMM on the plain weight as it is (any N, any K) below `below_rows` rows;
    from there on oneDNN. Memory: the plain weight and oneDNN's reordered copy, as an
    OneDNNLinear holds; the C GEMM adds no copy of its own."""

    dtype: torch.dtype
    kernel: str  # the library's function
    below_rows: int

    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.onednn = OneDNNLinear(linear) if onednn_takes(linear.weight.dtype) else None
        self.plain = linear.weight.detach().contiguous()  # the parameter itself, unless strided
        self.n, self.k = self.plain.shape
        self.gemm, self.weight_ptr = getattr(lib, self.kernel), self.plain.data_ptr()  # once
        self.bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn is not None and x.numel() >= self.below_rows * self.k:
            return self.onednn.forward(x)  # not through nn.Module's __call__: ~150 calls a step
        return kernels.c_gemm(x, self, self.dtype, self.weight_ptr)


class Dpbf16Linear(DotLinear):
    """bf16 below DPBF16_BELOW_ROWS rows: csrc/dpbf16.c (AVX512-BF16)."""

    dtype, kernel, below_rows = torch.bfloat16, "linear_dpbf16", DPBF16_BELOW_ROWS


class DotFp32Linear(DotLinear):
    """fp32 below DOT_FP32_BELOW_ROWS rows: csrc/dot_fp32.c (AVX-512), in PackedLinear's place
    and without its packed copy."""

    dtype, kernel, below_rows = torch.float32, "linear_dot_fp32", DOT_FP32_BELOW_ROWS


def replace_linears(model: nn.Module, lib: ctypes.CDLL | None) -> None:
    """Swap every CPU nn.Linear of `model` for the module `linear_kind` picks (the C GEMM
    needs a multiple of 16 outputs; the dot-product ones take any; the AMX one, `amx_fits`)."""
    dpbf16, amx = kernels.has_dpbf16(lib), kernels.has_amx(lib)
    dot_fp32 = kernels.has_dot_fp32(lib)
    for module in list(model.modules()):
        for name, child in module.named_children():
            if (not isinstance(child, nn.Linear) or child.weight.device.type != "cpu"
                    or getattr(child, "tp_size", 1) > 1 and hasattr(child, "tp_rank")
                    and isinstance(child, RowParallelLinear)):  # keep its all-reduce
                continue
            fits = lib is not None and child.out_features % 16 == 0
            kind = linear_kind(child.weight.dtype, fits, dpbf16, amx and amx_fits(child),
                               dot_fp32=dot_fp32)
            if kind == "amx":
                onednn = OneDNNLinear(child) if onednn_takes(child.weight.dtype) else None
                setattr(module, name, AmxLinear(child, lib, onednn))
            elif kind == "dot_fp32":
                setattr(module, name, DotFp32Linear(child, lib))
            elif kind == "dpbf16":
                setattr(module, name, Dpbf16Linear(child, lib))
            elif kind == "c":
                setattr(module, name, PackedLinear(child, lib))
            elif kind == "onednn":
                setattr(module, name, OneDNNLinear(child))
