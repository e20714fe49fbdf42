"""§1 on a CPU, fast: one weight read serving every row of the step, with the weight laid out for
the kernel that reads it. Each `nn.Linear` becomes the module of the GEMM the plan gives it
(plan.py, never chosen per call):
  - `OneDNNLinear`: torch's oneDNN GEMM on a weight reordered once into its blocked layout
    (what torch's inductor does for CPU linears); it runs bf16 on AMX or AVX512-BF16 units.
  - `PanelsLinear`: csrc/linear.c's GEMM on 16-column panels, streamed front to back; bf16 is
    widened to fp32 once per panel (CPUs without native bf16).
  - `DotFp32Linear`, `Dpbf16Linear`: dot products on the plain weight (any N, any K) in fp32
    (csrc/dot_fp32.c, AVX-512) or bf16 pairs (csrc/dpbf16.c, AVX512-BF16), where they stream the
    weights near memory speed and oneDNN does not. One that hands over to oneDNN reads oneDNN's
    reordered weight instead (the files' blocked GEMMs).
  - `AmxLinear`: csrc/amx.c's tile GEMM on oneDNN's reordered weight, whose AMX layout is the
    tiles' order (AMX).
A C GEMM takes up to `max_rows` rows (the plan's); more go to a library GEMM.

Memory: each linear keeps its weight once, in the layout its kernels read, and drops the plain
parameter where that is not it (a tied lm_head's plain table stays: the embedding's). The rows
beyond `max_rows` go to a library GEMM on that same tensor, not to a second copy:
  - dot_fp32, dpbf16: oneDNN on its reordered weight, which the C GEMM then reads too. oneDNN
    on the plain bf16 weight cost half as much again at 16 rows (it re-packs W every call); a
    shape oneDNN lays out otherwise keeps the plain weight, and oneDNN re-packs it;
  - panels: torch's batched GEMM on the panels as [N / 16, K, 16] matrices;
  - amx: oneDNN on its reordered weight, or where oneDNN lays a shape out otherwise, the tile
    GEMM itself on its own packing of that layout, in passes of 64 rows."""

from __future__ import annotations

import ctypes
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from nanoserve.layers.linear import ParallelLMHead, RowParallelLinear
from nanoserve_accel import kernels, plan

ONEDNN_BATCH_HINT = 64  # the rows oneDNN's reorder lays the weight out for


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] in oneDNN's blocked layout (an opaque MKLDNN tensor, its own memory)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_BATCH_HINT)


def onednn_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's GEMM on `weight`, reordered (reorder()) or plain (then packed on the fly)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(nn.Module):
    """oneDNN's GEMM on its reordered weight, the one copy kept (the plain one is dropped)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.bias = getattr(linear, "bias", None)  # a ParallelLMHead has none
        self.n, self.k = linear.weight.shape
        self.reordered = reorder(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_gemm(x, self.reordered, self.bias)


class CLinear(nn.Module):
    """A C GEMM of the library, `function`(x, w, bias, y, N, M, K[, bf16]), on `layout` (the
    weight as the kernel reads it, the module's only copy), up to `max_rows` rows (None: any);
    `library` beyond, reading the same tensor."""

    kernel: str  # plan.GEMM_KINDS' name
    function: str

    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL, max_rows: int | None = None) -> None:
        super().__init__()
        self.bias, self.max_rows = getattr(linear, "bias", None), max_rows  # lm_head: none
        self.n, self.k = linear.weight.shape
        self.dtype = linear.weight.dtype
        self.layout = self.lay_out(linear.weight.detach(), lib)
        # Read once here, not per call: a parameter's lookup through nn.Module is slow next to
        # a small GEMM, and a step makes a few hundred calls.
        self.gemm, self.w_ptr = getattr(lib, self.function), self.layout_ptr()
        self.bias_ptr = None if self.bias is None else self.bias.data_ptr()
        self.flag = (self.dtype == torch.bfloat16,) if self.kernel == "panels" else ()

    def lay_out(self, weight: torch.Tensor, lib: ctypes.CDLL) -> torch.Tensor:
        return weight.contiguous()  # the plain weight (the parameter's memory, unless strided)

    def layout_ptr(self) -> int:
        layout = self.layout  # oneDNN's opaque tensor, or a plain one
        return torch.ops.mkldnn.data_ptr(layout) if layout.is_mkldnn else layout.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_rows is not None and x.numel() > self.max_rows * self.k:
            return self.library(x)
        return kernels.c_gemm(x, self, self.dtype, self.w_ptr, *self.flag)

    def library(self, x: torch.Tensor) -> torch.Tensor:
        """The rows beyond max_rows: oneDNN on the plain weight (the plan hands over only where
        oneDNN runs this dtype)."""
        return onednn_gemm(x, self.layout, self.bias)


class PanelsLinear(CLinear):
    kernel, function = "panels", "linear_panels"

    def lay_out(self, weight: torch.Tensor, lib: ctypes.CDLL) -> torch.Tensor:
        n, k = weight.shape  # [N, K] -> [N / 16, K, 16]
        return weight.view(n // 16, 16, k).transpose(1, 2).contiguous()

    def library(self, x: torch.Tensor) -> torch.Tensor:
        """Each panel is a [K, 16] matrix: one batched GEMM over the N / 16 of them."""
        rows = x.reshape(-1, self.k).to(self.dtype)
        y = torch.matmul(rows, self.layout).transpose(0, 1).reshape(rows.shape[0], self.n)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.n)


class BlockedCLinear(CLinear):
    """A dot-product GEMM on the plain weight; where it hands over to oneDNN (max_rows) and the
    shape allows, its twin on oneDNN's reordered weight instead (`blocked`: kind and function),
    which oneDNN then reads beyond max_rows: one copy, and oneDNN at its packed speed (on the
    plain weight it re-packs W every call)."""

    blocked: tuple[str, str]

    def lay_out(self, weight: torch.Tensor, lib: ctypes.CDLL) -> torch.Tensor:
        if self.max_rows is not None and hasattr(lib, self.blocked[1]):
            reordered = reorder(weight)
            if is_blocked_64(reordered, weight):
                self.kernel, self.function = self.blocked
                return reordered
        return super().lay_out(weight, lib)


class DotFp32Linear(BlockedCLinear):
    """fp32: csrc/dot_fp32.c's linear_dot_fp32, or linear_fp32_blocked on oneDNN's weight."""

    kernel, function = "dot_fp32", "linear_dot_fp32"
    blocked = ("dot_fp32_blocked", "linear_fp32_blocked")


class Dpbf16Linear(BlockedCLinear):
    """bf16 pairs: csrc/dpbf16.c's linear_dpbf16, or linear_dpbf16_blocked on oneDNN's weight."""

    kernel, function = "dpbf16", "linear_dpbf16"
    blocked = ("dpbf16_blocked", "linear_dpbf16_blocked")


def is_blocked_64(blocked: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether oneDNN laid `weight` [N, K] out as our blocked GEMMs read it, 64-column blocks with
    no padding: [N / 64][K][64] in fp32, [N / 64][K / 2][64][2] (VNNI pairs) in bf16. Its choice
    depends on the CPU and the shape, so it is checked on column blocks of the weight itself (the
    first, the last and some between)."""
    n, k = weight.shape
    pack = {torch.float32: 1, torch.bfloat16: 2}.get(weight.dtype)
    if pack is None or n % 64 or k % pack:
        return False
    return same_blocks(blocked, weight, 64, lambda w: w.view(64, k // pack, pack).transpose(0, 1))


def same_blocks(blocked: torch.Tensor, weight: torch.Tensor, cols: int, lay_out) -> bool:
    """Whether oneDNN's `blocked` [N / cols] blocks of no padding are `lay_out`(each `cols` rows
    of `weight`), on the first, the last and some blocks between."""
    n, k = weight.shape
    nbytes = n * k * weight.element_size()
    if torch.ops.mkldnn._nbytes(blocked) != nbytes:
        return False
    memory = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(blocked))
    view = torch.frombuffer(memory, dtype=weight.dtype).view(n // cols, -1)
    picks = sorted({0, n // cols - 1, *range(0, n // cols, max(1, n // cols // 8))})
    return all(torch.equal(view[b], lay_out(weight[b * cols:(b + 1) * cols]).reshape(-1))
               for b in picks)


class AmxLinear(CLinear):
    """csrc/amx.c's tile GEMM on oneDNN's reordered weight, which oneDNN reads beyond max_rows
    (from 64 rows it is the faster); where oneDNN lays a shape out otherwise, or does not run, on
    the same layout packed here, the tile GEMM then taking every row count in passes."""

    kernel, function = "amx", "linear_amx"

    def lay_out(self, weight: torch.Tensor, lib: ctypes.CDLL) -> torch.Tensor:
        n, k = weight.shape
        if weight.dtype != torch.bfloat16 or n % 32 or k % 32:
            raise ValueError(f"the AMX GEMM takes bf16 weights with N % 32 == 0 and K % 32 == 0, "
                             f"not {weight.dtype} [{n}, {k}]")
        if self.max_rows is not None and plan.onednn_runs(torch.bfloat16):
            reordered = reorder(weight)
            if same_blocks(reordered, weight, 32, lambda w: pack_tiles(w.contiguous())):
                return reordered
        return pack_tiles(weight)

    def library(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN on its own weight, or the tile GEMM in passes of 64 rows on ours."""
        if self.layout.is_mkldnn:
            return onednn_gemm(x, self.layout, self.bias)
        return kernels.c_gemm(x, self, self.dtype, self.w_ptr)


def amx_fits(linear: nn.Linear) -> bool:
    """The AMX kernel's chunks: 32 output columns by 32 k, so N % 32 == 0 and K % 32 == 0."""
    return (linear.weight.dtype == torch.bfloat16 and linear.out_features % 32 == 0
            and linear.in_features % 32 == 0)


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 32][K / 32][16 k-pairs][32 columns][2], oneDNN's bf16 layout on an AMX CPU:
    for each 32 columns, one 2 KB chunk per 32 k (two tiles side by side, in the VNNI order the
    tile unit multiplies), the block's chunks front to back."""
    n, k = weight.shape
    return weight.view(n // 32, 32, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


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
    row-parallel one of several ranks keeps its all-reduce around it (AllReducedLinear). One at
    a time, each plain weight freed (unless tied) before the next is laid out: the peak is one
    linear above the model, not a second model."""
    machine = machine or plan.Machine.probe(lib)
    uses = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    tied = {ptr for ptr, count in uses.items() if count > 1}
    targets = [(module, name) for module in model.modules()  # parents, not the linears: a
               for name, child in module.named_children()    # list of those would keep every
               if isinstance(child, (nn.Linear, ParallelLMHead))  # plain weight to the end
               and child.weight.device.type == "cpu"]
    for module, name in targets:
        replace_linear(module, name, lib, machine,
                       getattr(module, name).weight.data_ptr() in tied)


def replace_linear(module: nn.Module, name: str, lib: ctypes.CDLL | None,
                   machine: plan.Machine, tied: bool = False) -> None:
    """module.<name> by its GEMM's module, which keeps the one layout it reads; `tied`: its
    weight is also another module's (the plan decides whether it may be copied)."""
    child = getattr(module, name)
    head = isinstance(child, ParallelLMHead)
    parallel = isinstance(child, RowParallelLinear) and child.tp_size > 1
    n, k = child.weight.shape
    g = plan.gemm(machine, child.weight.dtype, n, k, tied)
    if g.kernel not in MODULES and g.kernel != "onednn":
        return
    if parallel and child.tp_rank > 0:
        child.bias = None  # the bias is added once, by rank 0 (as RowParallelLinear)
    if g.kernel in MODULES:
        new = MODULES[g.kernel](child, lib, g.max_rows)
    else:
        new = OneDNNLinear(child)
    if head:
        child.weight = None  # it only gathers now; its weight lives on in `new`'s layout
        new = GatheredLMHead(child, new)
    setattr(module, name, AllReducedLinear(new) if parallel else new)
