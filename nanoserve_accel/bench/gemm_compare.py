"""All of a decode step's linear layers (30 layers of SmolLM2-135M's shapes + lm_head, each with
its own weights, so they stream from memory as in a real step), at M rows, in fp32 and bf16:
nanoserve's C GEMM (csrc/linear.c, packed panels), its AVX512-BF16 GEMM for bf16 (csrc/dpbf16.c,
on the plain weights) and its AMX GEMM (csrc/amx.c, on tile-packed weights), its AVX-512 GEMM for
fp32 (csrc/dot_fp32.c, on the plain weights and on oneDNN's blocked ones), each at every row count
here (no handover), torch's oneDNN GEMM on pre-packed weights, and plain `F.linear`; and which one
the plan (plan.py) gives this CPU. Interleaved rounds; medians.

    python nanoserve_accel/bench/gemm_compare.py               # both dtypes, 1/16/64/256 rows
    python nanoserve_accel/bench/gemm_compare.py --rows 1,4 --dtypes bfloat16
    python nanoserve_accel/bench/gemm_compare.py --shapes llama-3.2-1b --dtypes float32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.utils import cpu
from nanoserve_accel import plan
from nanoserve_accel.kernels import compile_kernels, has_amx, has_dot_fp32, has_dpbf16
from nanoserve_accel.linear import (
    AmxLinear,
    DotFp32Linear,
    Dpbf16Linear,
    OneDNNLinear,
    PanelsLinear,
)

# (N, K) of one layer's linears, the layer count, and the lm_head (None: left out)
SHAPES = {"smollm2-135m": ([(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576),
                            (1536, 576), (576, 1536)], 30, (49152, 576)),
          "llama-3.2-1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 16, None)}
NAMES = {"panels": "C GEMM", "onednn": "oneDNN packed", "dpbf16": "dpbf16 GEMM",
         "amx": "AMX GEMM", "dot_fp32": "dot fp32 GEMM", "torch": "F.linear",
         "dot_fp32_blocked": "fp32 blocked GEMM"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2-135m",
                    help="the model whose linears (its merged q/k/v and gate/up for the 1B)")
    args = ap.parse_args()
    lib = compile_kernels()
    print(f"{cpu.describe()}, torch threads {torch.get_num_threads()}, median of "
          f"{args.repeats} interleaved rounds, ms for all of one step's linears")
    amx = has_amx(lib)  # every LAYER shape fits its tiles
    machine = plan.Machine.probe(lib)
    print("| dtype | rows | C GEMM ms | dpbf16 GEMM ms | AMX GEMM ms | dot fp32 GEMM ms | "
          "fp32 blocked GEMM ms | oneDNN packed ms | F.linear ms | default path takes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    layer, layers, head = SHAPES[args.shapes]
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        torch.manual_seed(0)
        linears = [nn.Linear(k, n, bias=False).requires_grad_(False).to(dtype)
                   for n, k in layer * layers + ([head] if head else [])]
        ways = {"plain": [lambda x, w=lin.weight: F.linear(x, w) for lin in linears]}
        if dtype in machine.onednn:
            ways["onednn"] = [OneDNNLinear(lin) for lin in linears]
        if lib is not None:
            ways["panels"] = [PanelsLinear(lin, lib) for lin in linears]  # no handover
        if dtype == torch.bfloat16 and has_dpbf16(lib):
            ways["dpbf16"] = [Dpbf16Linear(lin, lib) for lin in linears]
        if dtype == torch.bfloat16 and amx:
            ways["amx"] = [AmxLinear(lin, lib) for lin in linears]
        if dtype == torch.float32 and has_dot_fp32(lib):
            ways["dot_fp32"] = [DotFp32Linear(lin, lib) for lin in linears]
            # on oneDNN's blocked weight, at every row count (a limit past any here)
            ways["dot_fp32_blocked"] = [DotFp32Linear(lin, lib, 1 << 20) for lin in linears]
        for rows in (int(r) for r in args.rows.split(",")):
            x = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in layer}}
            times: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(args.repeats + 1):  # interleaved; the first round warms up
                for name, mods in ways.items():
                    t = time.perf_counter()
                    for lin, m in zip(linears, mods):
                        m(x[lin.in_features])
                    times[name].append(time.perf_counter() - t)
            ms = {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}
            c, dp, am, dot, blk, one = (f"{ms[w]:.1f}" if w in ms else "-" for w in
                                        ("panels", "dpbf16", "amx", "dot_fp32",
                                         "dot_fp32_blocked", "onednn"))
            g = plan.gemm(machine, dtype, *layer[0])
            kind = g.beyond if g.max_rows is not None and rows > g.max_rows else g.kernel
            if kind == "dot_fp32" and g.max_rows is not None and "dot_fp32_blocked" in ways:
                kind = ways["dot_fp32_blocked"][0].kernel  # where oneDNN's layout is the one
            took = NAMES[kind]
            print(f"| {str(dtype)[6:]} | {rows} | {c} | {dp} | {am} | {dot} | {blk} | {one} | "
                  f"{ms['plain']:.1f} | {took} |", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
