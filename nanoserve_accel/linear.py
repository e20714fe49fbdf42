"""§1 on a CPU, fast: one weight read serving every row of the step, with the weight laid out for
the kernel that reads it. Each `nn.Linear` becomes the module of the GEMM the plan gives it
(plan.py, never chosen per call):
  - `OneDNNLinear`: torch's oneDNN GEMM on a weight reordered once into its blocked layout
    (what torch's inductor does for CPU linears); it runs bf16 on AMX or AVX512-BF16 units.
  - `PanelsLinear`: csrc/linear.c's GEMM on 16-column panels, streamed front to back; bf16 is
    widened to fp32 once per panel (CPUs without native bf16).
  - `DotFp32Linear`, `Dpbf16Linear`: dot products on the plain weight (any N, any K) in fp32
    (csrc/dot_fp32.c, AVX-512) or bf16 pairs (csrc/dpbf16.c, AVX512-BF16), where they stream the
    weights near memory speed and oneDNN does not.
  - `AmxLinear`: csrc/amx.c's tile GEMM on a weight packed into the tiles' order (AMX).
A C GEMM takes up to `max_rows` rows (the plan's); more go to oneDNN. Memory: the plain weight,
the kernel's layout where it has its own, and oneDNN's reordered copy where it hands over."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from nanoserve.layers.linear import ParallelLMHead, RowParallelLinear
from nanoserve_accel import kernels, plan


class OneDNNLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        # The plain weight stays the parameter (tied embeddings, parameter counts).
        self.weight, self.bias = linear.weight, linear.bias
        self.reordered = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.reordered, self.bias, "none", [], "")


class CLinear(nn.Module):
    """A C GEMM of the library, `function`(x, w, bias, y, N, M, K[, bf16]), on `layout` (the
    weight as the kernel reads it), up to `max_rows` rows (None: any); oneDNN beyond."""

    kernel: str  # plan.GEMM_KINDS' name
    function: str

    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL, max_rows: int | None = None) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.max_rows = max_rows
        self.onednn = None if max_rows is None else OneDNNLinear(linear)
        self.n, self.k = linear.weight.shape
        self.dtype = linear.weight.dtype
        self.layout = self.lay_out(linear.weight.detach())
        # Read once here, not per call: a parameter's lookup through nn.Module is slow next to
        # a small GEMM, and a step makes a few hundred calls.
        self.gemm, self.w_ptr = getattr(lib, self.function), self.layout.data_ptr()
        self.bias_ptr = None if self.bias is None else self.bias.data_ptr()
        self.flag = (self.dtype == torch.bfloat16,) if self.kernel == "panels" else ()

    def lay_out(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.contiguous()  # the plain weight (the parameter itself, unless strided)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn is not None and x.numel() > self.max_rows * self.k:
            return self.onednn.forward(x)  # not through nn.Module's __call__: ~150 calls a step
        return kernels.c_gemm(x, self, self.dtype, self.w_ptr, *self.flag)


class PanelsLinear(CLinear):
    kernel, function = "panels", "linear_panels"

    def lay_out(self, weight: torch.Tensor) -> torch.Tensor:
        n, k = weight.shape  # [N, K] -> [N / 16, K, 16]
        return weight.view(n // 16, 16, k).transpose(1, 2).contiguous()


class DotFp32Linear(CLinear):
    kernel, function = "dot_fp32", "linear_dot_fp32"


class Dpbf16Linear(CLinear):
    kernel, function = "dpbf16", "linear_dpbf16"


class AmxLinear(CLinear):
    kernel, function = "amx", "linear_amx"

    def lay_out(self, weight: torch.Tensor) -> torch.Tensor:
        n, k = weight.shape
        if weight.dtype != torch.bfloat16 or n % 16 or k % 32:
            raise ValueError(f"the AMX GEMM takes bf16 weights with N % 16 == 0 and K % 32 == 0, "
                             f"not {weight.dtype} [{n}, {k}]")
        return pack_tiles(weight)


def amx_fits(linear: nn.Linear) -> bool:
    """The AMX kernel's tiles: 16 output columns by 32 k, so N % 16 == 0 and K % 32 == 0."""
    return (linear.weight.dtype == torch.bfloat16 and linear.out_features % 16 == 0
            and linear.in_features % 32 == 0)


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16][K / 32][16 k-pairs][16 columns][2]: for each 16 columns, one 1 KB tile
    per 32 k in the VNNI order the tile unit multiplies, the column group's tiles front to back."""
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


MODULES = {"panels": PanelsLinear, "dot_fp32": DotFp32Linear, "dpbf16": Dpbf16Linear,
           "amx": AmxLinear}


class GatheredLMHead(nn.Module):
    """A vocab-parallel lm_head (tensor parallel) on the plan's GEMM: this rank's logits, then
    gathered on rank 0 as ParallelLMHead does."""

    def __init__(self, head: ParallelLMHead, local: nn.Module) -> None:
        super().__init__()
        self.head, self.local = head, local

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.head.gather(self.local(hidden))


class AllReducedLinear(nn.Module):
    """A row-parallel linear of several ranks (tensor parallel) on the plan's GEMM: this rank's
    partial product, its bias on rank 0 only (as RowParallelLinear), then the sum over ranks.
    Without it the two linears that end each half of a layer kept torch's GEMM under tensor
    parallelism: on an AVX2 CPU in bf16 (widened to fp32 per call) that made a 64-row TP=2 step
    of a Qwen3-0.6B shape 2.8 s against 0.78 s on one rank (step_times.py)."""

    def __init__(self, local: nn.Module) -> None:
        super().__init__()
        self.local = local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        dist.all_reduce(y)
        return y


def replace_linears(model: nn.Module, lib: ctypes.CDLL | None,
                    machine: plan.Machine | None = None) -> None:
    """Replace every CPU nn.Linear of `model` by the module of the GEMM plan.gemm gives it; a
    row-parallel one of several ranks keeps its all-reduce around it (AllReducedLinear)."""
    machine = machine or plan.Machine.probe(lib)
    for module in list(model.modules()):
        for name, child in module.named_children():
            head = isinstance(child, ParallelLMHead)
            if not isinstance(child, nn.Linear) and not head or child.weight.device.type != "cpu":
                continue
            parallel = isinstance(child, RowParallelLinear) and child.tp_size > 1
            n, k = child.weight.shape
            g = plan.gemm(machine, child.weight.dtype, n, k)
            if g.kernel not in MODULES and g.kernel != "onednn":
                continue
            if parallel and child.tp_rank > 0:
                child.bias = None  # the bias is added once, by rank 0 (as RowParallelLinear)
            linear = SimpleNamespace(weight=child.weight, bias=None) if head else child
            if g.kernel in MODULES:
                new = MODULES[g.kernel](linear, lib, g.max_rows)
            else:
                new = OneDNNLinear(linear)
            if head:
                new = GatheredLMHead(child, new)
            setattr(module, name, AllReducedLinear(new) if parallel else new)
