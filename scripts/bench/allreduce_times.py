"""What tensor parallelism adds to a decode step: the time of its collectives, alone.

A TP decode step makes 2 all-reduces a layer (after o_proj and down_proj) and one for the
embedding, each of [rows, hidden], and gathers the sampling rows' logits [rows, vocab / N] on
rank 0 (layers/linear.py). This times those collectives over gloo between N processes on this
machine, one thread each (as step_times.py --tensor-parallel-size N runs them), and prints them
per step beside the model's shape, so a TP step's extra cost can be split into communication
and the rest.

    python scripts/bench/allreduce_times.py --model DIR --rows 1,16,64 --dtype float32
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    config = AutoConfig.from_pretrained(args.model)
    dtype, layers = getattr(torch, args.dtype), config.num_hidden_layers
    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        hidden = torch.randn(rows, config.hidden_size, dtype=dtype)
        logits = torch.randn(rows, config.vocab_size // world, dtype=dtype)
        parts = [torch.empty_like(logits) for _ in range(world)] if rank == 0 else None
        times = {"all_reduce": [], "gather": []}
        for i in range(args.repeats + 3):  # three warm-up rounds
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(hidden)
            t_reduce = time.perf_counter() - t
            t = time.perf_counter()
            dist.gather(logits, parts, dst=0)
            if i >= 3:
                times["all_reduce"].append(t_reduce)
                times["gather"].append(time.perf_counter() - t)
        reduce_ms = statistics.median(times["all_reduce"]) * 1e3
        gather_ms = statistics.median(times["gather"]) * 1e3
        results[rows] = (reduce_ms, gather_ms, (2 * layers + 1) * reduce_ms + gather_ms)
    if rank == 0:
        queue.put((layers, config.hidden_size, config.vocab_size, results))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.world, port, args, queue))
             for r in range(args.world)]
    for p in procs:
        p.start()
    layers, hidden, vocab, results = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    print(f"gloo, {args.world} ranks of 1 thread, {args.dtype}, {layers} layers, hidden {hidden}, "
          f"vocab {vocab}: {2 * layers + 1} all-reduces and 1 gather a step "
          f"(pid {os.getpid()}, median of {args.repeats})")
    print("| rows | all-reduce ms | logits gather ms | collectives per step ms |")
    print("|---|---|---|---|")
    for rows, (reduce_ms, gather_ms, step_ms) in results.items():
        print(f"| {rows} | {reduce_ms:.3f} | {gather_ms:.3f} | {step_ms:.1f} |")


if __name__ == "__main__":
    main()
