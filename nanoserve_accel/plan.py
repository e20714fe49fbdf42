"""The fast path's dispatch plan, in one place: given the machine and a dtype, which kernel each op
of a step gets, and up to how many rows (one convention: a kernel takes 1..max_rows rows, more go
to `beyond`). linear.py builds every linear's module from it, layer.py composes the one-call layer
within those modules' limits, __init__.py picks attention from it, and
`python -m nanoserve_accel --plan` prints it; README.md's table here is that printout for each CPU
family (tests/test_plan.py holds them equal).

The machine is probed once (`Machine.probe`): the CPU's flags (nanoserve.utils.cpu, which the
tests fake), the kernels the library was compiled with (-march=native: the real machine's, whatever
the fake says), and the dtypes torch's oneDNN runs here (bf16 needs AVX512-BW/VL/DQ)."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from nanoserve.utils import cpu
from nanoserve_accel import kernels

# The row limits, each where the C GEMM measured faster than the next kernel up
# (bench/gemm_compare.py; whole steps: scripts/bench/step_times.py; docs/benchmarks.md, GEMM):
DOT_FP32_MAX_ROWS = 95  # fp32 dot products: memory-bound to ~9 rows, level with the packed GEMM
# from 16; a decode step of one C call per layer measured faster than oneDNN's modules to 96 rows.
FP32_BLOCKED_MAX_ROWS = 47  # the same on oneDNN's weight (N % 64 == 0): faster than dot_fp32 at
# every row count, level with oneDNN at 24-48 rows of a 1B shape, oneDNN ahead from 64.
PANELS_MAX_ROWS = 63  # fp32 packed panels, where AVX-512 oneDNN measured faster from 64 rows
DPBF16_MAX_ROWS = 7  # AVX512-BF16 dot products: clearly faster at 1-4 rows, level at 6-7
AMX_MAX_ROWS = 64  # AMX tiles: one pass over the weights serves up to 64 rows; oneDNN beyond
# (one thread, SmolLM2-135M's linears at 136 rows: 0.57-0.93 of the tiles' time in passes)
# csrc/layer.c's enum gemm; "..._blocked": the kernel on oneDNN's reordered weight (linear.py)
GEMM_KINDS = {"panels": 0, "dot_fp32": 1, "dpbf16": 2, "amx": 3, "dpbf16_blocked": 4,
              "dot_fp32_blocked": 5}


@dataclass(frozen=True)
class Machine:
    flags: frozenset[str]
    kernels: frozenset[str]  # "c" (a library at all), "dot_fp32", "dpbf16", "amx",
    # "paged_prefill" (bf16), "paged_prefill_fp32"
    onednn: frozenset[torch.dtype]  # the dtypes oneDNN's GEMM runs here

    @classmethod
    def probe(cls, lib: ctypes.CDLL | None) -> Machine:
        built = {"c": lib is not None, "dot_fp32": kernels.has_dot_fp32(lib),
                 "dpbf16": kernels.has_dpbf16(lib), "amx": kernels.has_amx(lib),
                 "paged_prefill": kernels.has_paged_prefill(lib),
                 "paged_prefill_fp32": kernels.has_paged_prefill_fp32(lib)}
        return cls(cpu.cpu_flags(), frozenset(k for k, ok in built.items() if ok),
                   frozenset(d for d in (torch.float32, torch.bfloat16) if onednn_runs(d)))


@functools.cache  # the probe and every AmxLinear ask: a trial reorder once per dtype
def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether torch's oneDNN reorders (and so runs) a `dtype` GEMM on this machine: asked by
    trying it, once."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
        return False
    return True


@dataclass(frozen=True)
class Gemm:
    kernel: str  # "panels", "dot_fp32", "dpbf16", "amx" (C), "onednn", or "torch" (nn.Linear)
    max_rows: int | None = None  # the kernel takes up to this many rows (None: any number)
    beyond: str | None = None  # who takes more: "onednn", or "amx passes" (64 rows each)

    def describe(self) -> str:
        return self.kernel + ("" if self.max_rows is None else
                              f" up to {self.max_rows} rows, {self.beyond} beyond")


def gemm(m: Machine, dtype: torch.dtype, n: int, k: int, tied: bool = False) -> Gemm:
    """The GEMM of a [n, k] linear in `dtype` on machine `m`; `tied`: its weight is also the
    embedding's table (an lm_head), which a handover would copy into oneDNN's layout."""
    onednn = dtype in m.onednn

    def handing_over(kernel: str, max_rows: int) -> Gemm:
        return Gemm(kernel, max_rows, "onednn") if onednn else Gemm(kernel)

    native_bf16 = {"amx_bf16", "avx512_bf16"} & m.flags
    if dtype == torch.float32 and "dot_fp32" in m.kernels and "avx512f" in m.flags:
        if tied:  # the table itself, at every row count: a blocked copy was 1.05 GB at
            return Gemm("dot_fp32")  # Llama-3.2-1B's shape, for ~1% of a one-row step
        return handing_over("dot_fp32", DOT_FP32_MAX_ROWS if n % 64 else FP32_BLOCKED_MAX_ROWS)
    if dtype == torch.bfloat16 and native_bf16:
        if "amx" in m.kernels and "amx_bf16" in m.flags and n % 32 == 0 and k % 32 == 0:
            # On oneDNN's weight, which oneDNN reads beyond; else the tiles' passes (linear.py).
            return Gemm("amx", AMX_MAX_ROWS, "onednn" if onednn else "amx passes")
        if "dpbf16" in m.kernels and "avx512_bf16" in m.flags:  # tied too: the bf16 copy is
            return handing_over("dpbf16", DPBF16_MAX_ROWS)  # half, dpbf16 on the table ~30% slower
        if onednn:
            return Gemm("onednn")
    if dtype in (torch.float32, torch.bfloat16) and "c" in m.kernels and n % 16 == 0:
        if dtype == torch.float32 and "avx512f" in m.flags:  # bf16 here: widened to fp32
            return handing_over("panels", PANELS_MAX_ROWS)
        return Gemm("panels")
    return Gemm("onednn" if onednn and dtype != torch.float16 else "torch")


def prefill_attention(m: Machine, dtype: torch.dtype) -> str:
    """csrc/attention_prefill.c for bf16 on AVX512-BF16 (on AMX tiles where there are) and for
    fp32 on AVX-512F, else the torch twin."""
    if dtype == torch.float32:
        fp32 = "paged_prefill_fp32" in m.kernels and "avx512f" in m.flags
        return "C" if fp32 else "torch twin"
    if dtype != torch.bfloat16 or "paged_prefill" not in m.kernels \
            or "avx512_bf16" not in m.flags:
        return "torch twin"
    return "C, AMX tiles" if "amx" in m.kernels and "amx_bf16" in m.flags else "C"


def plan_rows(m: Machine) -> list[tuple[str, str, str]]:
    """(op, float32, bfloat16): the plan for a model whose shapes every kernel takes."""
    rows = [("linear (GEMM)", *(gemm(m, d, 576, 576).describe() for d in DTYPES))]
    c = "C" if "c" in m.kernels else "torch"
    rows += [("RMSNorm, RoPE, SiLU-and-mul", c, c),
             ("decode attention", *(("C, 16 lanes" if "avx512f" in m.flags else "C")
                                    if "c" in m.kernels else "torch twin" for _ in DTYPES)),
             ("prefill attention", *(prefill_attention(m, d) for d in DTYPES))]
    layer = []
    for d in DTYPES:
        g = gemm(m, d, 576, 576)
        layer.append("modules" if g.kernel not in GEMM_KINDS else
                     "one C call" + (f" up to {g.max_rows} rows" if g.max_rows else ""))
    return rows + [("a decode step's layer", *layer)]


DTYPES = (torch.float32, torch.bfloat16)
# What each CPU family's machine is (flags of its kind, a library built there, its oneDNN): the
# README's table, whatever machine prints it.
FAMILIES = {
    "AMX (Intel Sapphire Rapids and later)": Machine(
        frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}),
        frozenset({"c", "dot_fp32", "dpbf16", "amx", "paged_prefill", "paged_prefill_fp32"}),
        frozenset(DTYPES)),
    "AVX512-BF16, no AMX (AMD Zen 4, Zen 5)": Machine(
        frozenset({"avx2", "avx512f", "avx512_bf16"}),
        frozenset({"c", "dot_fp32", "dpbf16", "paged_prefill", "paged_prefill_fp32"}),
        frozenset(DTYPES)),
    "AVX2 only": Machine(frozenset({"avx2"}), frozenset({"c"}), frozenset({torch.float32})),
}


def table(machines: dict[str, Machine]) -> str:
    lines = ["| CPU | op | float32 | bfloat16 |", "|---|---|---|---|"]
    for name, m in machines.items():
        lines += [f"| {name} | {op} | {fp32} | {bf16} |" for op, fp32, bf16 in plan_rows(m)]
    return "\n".join(lines)
