"""Decode attention of one whole step (30 layers of SmolLM2-135M's heads: 9 query, 3 KV, 64
wide; each layer its own paged cache, so K and V stream from memory as in a real step): the C
kernel (csrc/attention*.c) against the torch twin (layers/torch_attention.py), every row
at --context tokens, blocks shuffled. Interleaved rounds; medians, with the KV bytes read.

    python nanoserve_accel/bench/attention_compare.py             # both dtypes, 1/16/64 rows
    python nanoserve_accel/bench/attention_compare.py --rows 64 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanoserve.layers import torch_attention
from nanoserve.layers.attention import get_backend
from nanoserve.utils import cpu
from nanoserve_accel import kernels, paged_attention

LAYERS, H, HKV, D = 30, 9, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--context", type=int, default=240)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    lib = kernels.compile_kernels()
    print(f"{cpu.describe()}, torch threads {torch.get_num_threads()}, median of "
          f"{args.repeats} interleaved rounds, ms for {LAYERS} layers, context {args.context}")
    print("| dtype | rows | KV MB read | C kernel ms | C GB/s | torch twin ms |")
    print("|---|---|---|---|---|---|")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        fast = paged_attention.with_decode_kernel(
            get_backend("torch"), lib).with_kvcache
        ways = {"c": fast, "twin": torch_attention.flash_attn_with_kvcache}
        for rows in (int(r) for r in args.rows.split(",")):
            torch.manual_seed(0)
            per_row = -(-args.context // args.block_size)
            blocks = rows * per_row
            table = torch.randperm(blocks, dtype=torch.int32).view(rows, per_row)
            lens = torch.full((rows,), args.context, dtype=torch.int32)
            caches = [[torch.randn(blocks, args.block_size, HKV, D).to(dtype) for _ in "kv"]
                      for _ in range(LAYERS)]
            q = torch.randn(rows, 1, H, D).to(dtype)
            times: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(args.repeats + 1):  # interleaved; the first round warms up
                for name, fn in ways.items():
                    t = time.perf_counter()
                    for k_cache, v_cache in caches:
                        fn(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                           causal=True)
                    times[name].append(time.perf_counter() - t)
            ms = {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}
            mb = LAYERS * 2 * rows * args.context * HKV * D * q.element_size() / 1e6
            print(f"| {str(dtype)[6:]} | {rows} | {mb:.0f} | {ms['c']:.2f} | "
                  f"{mb / ms['c']:.1f} | {ms['twin']:.2f} |", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
