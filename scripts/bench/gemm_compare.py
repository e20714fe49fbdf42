"""All of a decode step's linear layers (30 layers of SmolLM2-135M's shapes + lm_head, each
with its own weights, so they stream from memory as in a real step), at M rows: nanoserve's C
GEMM (layers/cpu_linear.c, packed panels) against torch's oneDNN GEMM on pre-packed weights.

    python scripts/bench/gemm_compare.py                 # float32, 1/16/64 rows
    python scripts/bench/gemm_compare.py --rows 256,512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from nanoserve.accel.kernels import compile_kernels
from nanoserve.accel.linear import PackedLinear

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    lib = compile_kernels()
    if lib is None:
        raise SystemExit("no C kernels here (no compiler)")
    torch.manual_seed(0)
    linears = [nn.Linear(k, n, bias=False).requires_grad_(False)
               for n, k in LAYER * 30 + [(49152, 576)]]
    ours = [PackedLinear(linear, lib) for linear in linears]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(linear.weight, 16) for linear in linears]
    weight_bytes = sum(linear.weight.numel() * 4 for linear in linears)
    flops_per_row = 2 * weight_bytes / 4
    print("| rows | GEMM | ms | GFLOP/s | weights GB/s |\n|---|---|---|---|---|")
    def c_gemm(x: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        return [m(x[m.weight.shape[1]]) for m in ours]

    def onednn_gemm(x: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        return [torch.ops.mkldnn._linear_pointwise(x[lin.weight.shape[1]], w, None, "none", [], "")
                for lin, w in zip(linears, onednn)]

    ways = {"nanoserve C": c_gemm, "oneDNN packed": onednn_gemm}
    for rows in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(rows, k) for k in (576, 1536)}
        for a, b in zip(*(way(x) for way in ways.values())):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.repeats + 1):  # interleaved; the first round warms up
            for name, way in ways.items():
                t = time.perf_counter()
                way(x)
                times[name].append(time.perf_counter() - t)
        for name in ways:
            s = statistics.median(times[name][1:])
            print(f"| {rows} | {name} | {s * 1e3:.1f} | {rows * flops_per_row / s / 1e9:.0f} | "
                  f"{weight_bytes / s / 1e9:.1f} |")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
