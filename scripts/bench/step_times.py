"""Decode step time by batch size, eager vs optimized, against the machine's matmul roofline.

Every row decodes one token at ~240 tokens of context (a full `execute_model` step: inputs,
forward, logits, sampling). Variants are timed interleaved, step by step, so that noise from
other processes hits all variants alike; each timed step follows an untimed one of the same
variant, as serving runs steps back to back (what a step leaves in the caches, the next finds:
the KV, the activations, the Python between the C calls; another variant's 270 MB in between
evicts it). The median is reported, and for the optimized path also the best step. The
roofline is the GEMM rate measured here (its best run): a decode step needs ~2 x params FLOPs
per row, so at 64 rows the best possible step is 64 x 2 x params / (GEMM FLOP/s). "% of
roofline" compares it with the median step, and with the best step (best against best: on a VM
whose speed drifts, both are its fast moments). The
last column times that fastest GEMM again between the steps and compares medians: the step
against the machine's rate in the same moments. "opt / read bound": the median step over the
time to read the weights and the rows' KV once at the memory's best read rate (issue 37's target
for one row: at most 1.15; the KV matters at a long --context); "opt / read between": the same
read, timed between the steps as the GEMM is, so the median step over the median read in the
same moments (this VM's memory rate drifts 40-77 GB/s within minutes, and a best read from
before the steps may belong to another moment).

The llama.cpp columns: the same rows, dtype and context on llama.cpp (the same weights as GGUF,
benchmarks/llamacpp_worker.py's step mode: one llama_decode of an R-token batch plus the argmax,
wall time, as many threads as torch uses here), in its own process, one of its steps timed
between each of nanoserve's (interleaved as the variants are; both engines' weights are in memory
at once). Set it up once with `bash scripts/bench/setup_llamacpp.sh`; without it the columns
show "-" and one line says so.

    python scripts/bench/step_times.py                       # fp32 and bf16, 1/16/64 rows
    python scripts/bench/step_times.py --dtypes float32 --rows 16 --steps 30
    python scripts/bench/step_times.py --cpu-time --threads 1  # on a shared, busy machine
    python scripts/bench/step_times.py --model DIR              # e.g. scripts/bench/make_model.py's
    python scripts/bench/step_times.py --rows 1 --rounds 3 --no-eager  # llama.cpp and nanoserve
    python scripts/bench/step_times.py --context 4096 --rows 1,16  # long context: KV in the bound
    python scripts/bench/step_times.py --model DIR --tensor-parallel-size 2 --no-llamacpp
        # the optimized path on 2 ranks, each with its share of the cores (no eager column);
        # run it alternately with --tensor-parallel-size 1 to compare
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ (the llama.cpp peer)
from benchmarks import llamacpp_system
from nanoserve.config import EngineConfig, resolve_config
from nanoserve.engine import scheduler as sched
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.request import Request, RequestStatus
from nanoserve.entrypoints.bundled import default_model_dir
from nanoserve.models.loader import load_config
from nanoserve.sampling_params import SamplingParams
from nanoserve.utils import cpu

try:  # the fast-path plugin (its GEMMs join the roofline), if installed
    from nanoserve_accel.hugepages import collapse
    from nanoserve_accel.kernels import compile_kernels
    from nanoserve_accel.linear import PanelsLinear
    from nanoserve_accel.plan import onednn_runs
except ImportError:  # without it: the plain path only, and torch's GEMM for the roofline
    collapse = compile_kernels = onednn_runs = None


def decode_batch(runner: ModelRunner, rows: int, context: int):
    """A SchedulerOutput in which `rows` requests each decode their token at `context`. Their
    blocks interleave as serving leaves them (blocks are taken on demand, so requests that grow
    together take turns): block j of request i is block j * rows + i."""
    bs = runner.block_size
    blocks = -(-(context + 1) // bs)
    reqs = []
    for i in range(rows):
        req = Request(f"r{i}", [(13 * i + j) % 5000 + 10 for j in range(context + 1)],
                      SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True))
        req.block_table = [j * rows + i for j in range(blocks)]
        req.num_computed_tokens, req.status = context, RequestStatus.RUNNING
        reqs.append(req)
    rows = [sched.ScheduledRequest(r, 1, True, is_decode=True) for r in reqs]
    return sched.SchedulerOutput(scheduled=rows, token_budget=len(rows))


def make_runner(model_dir: str, dtype: str, rows: int, context: int,
                block_size: int | None = None, fast_paths: bool = True,
                tensor_parallel_size: int = 1) -> ModelRunner:
    """A CPU runner with KV blocks for `rows` requests of `context` + 1 tokens (block_size None:
    the engine's default)."""
    config = resolve_config(EngineConfig(dtype=dtype, device="cpu", block_size=block_size,
                                         enable_fast_paths=fast_paths,
                                         tensor_parallel_size=tensor_parallel_size),
                            load_config(model_dir))
    blocks = rows * -(-(context + 1) // config.block_size)
    return ModelRunner(replace(config, num_kv_blocks=blocks), model_dir)


def gemm_gflops(dtype: torch.dtype, clock, repeats: int = 40):
    """The CPU's best matmul rate on the model's own shapes (576 -> 1536 -> 576, 256 rows):
    torch's GEMM on plain or oneDNN-packed weights, or nanoserve's C GEMM on its packed
    panels, whichever is fastest. Best of `repeats`: other processes only ever slow a GEMM
    down, so the fastest run is the machine's rate. Also returns that fastest way, and its
    FLOPs, to time it again between the steps."""
    x = torch.randn(256, 576, dtype=dtype)
    w1, w2 = torch.randn(1536, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    ways = {"plain": lambda: F.linear(F.linear(x, w1), w2)}
    # (oneDNN's bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)
    if onednn_runs is not None and onednn_runs(dtype):
        p1, p2 = (torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in (w1, w2))

        def packed():
            h = torch.ops.mkldnn._linear_pointwise(x, p1, None, "none", [], "")
            return torch.ops.mkldnn._linear_pointwise(h, p2, None, "none", [], "")
        ways["packed"] = packed
    if compile_kernels is not None and (lib := compile_kernels()):
        def packed_c(w: torch.Tensor) -> PanelsLinear:  # the weights first: packed from them
            linear = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype)
            linear.requires_grad_(False)
            linear.weight.copy_(w)
            return PanelsLinear(linear, lib)
        c1, c2 = packed_c(w1), packed_c(w2)  # at 256 rows fp32 on AVX-512: oneDNN's handover
        ways["nanoserve"] = lambda: c2(c1(x))
    best, fastest, flops = float("inf"), None, 2 * 2 * 256 * 576 * 1536
    for way in ways.values():
        way()
        for _ in range(repeats):
            t = clock()
            way()
            if clock() - t < best:
                best, fastest = clock() - t, way
    return flops / best / 1e9, fastest, flops


READ_BYTES = 256 << 20  # far past the caches
SETTLE_S = 0.02  # sleep on either side of a llama.cpp step (main() says why)


@functools.cache
def read_buffer() -> torch.Tensor:
    """What the read bound reads: made on first use, not when a test imports this script; on 2 MB
    pages, as the plugin puts the weights (hugepages.py): on 4 KB pages the same read took
    1.15-1.42x as long on the Zen 4 VM, a bound the step could beat."""
    buffer = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    if collapse is not None:
        collapse([(buffer.data_ptr(), buffer.nbytes)])
    return buffer


def weight_stream_ms(weight_bytes: int, repeats: int = 10) -> tuple[float, float]:
    """(ms to read the weights once, read GB/s): the memory's rate from the best of `repeats`
    reads (a sum, on every thread) of read_buffer(): the one-row step's bound, as the step reads
    each weight once. (A copy moves twice the bytes, and a write costs more than a read: its
    rate understates the bound.)"""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        read_buffer().sum()
        best = min(best, time.perf_counter() - t)
    rate = READ_BYTES / best
    return weight_bytes / rate * 1e3, rate / 1e9


def llama_peer(dtype: str, args) -> llamacpp_system.StepPeer | None:
    """llama.cpp on the same weights, stepping on demand; None (and one line saying why) where
    it is not set up, left out or fails."""
    if args.no_llamacpp:
        return None
    why_not = llamacpp_system.unavailable(args.model, dtype)
    if why_not:
        print(f"llama.cpp {dtype}: skipped: {why_not}")
        return None
    try:
        peer = llamacpp_system.StepPeer(llamacpp_system.gguf_path(args.model, dtype),
                                        args.context, torch.get_num_threads())
    except RuntimeError as e:
        print(f"llama.cpp {dtype}: failed: {' / '.join(str(e).splitlines()[-3:])}")
        return None
    info = peer.info
    print(f"llama.cpp {dtype}: llama-cpp-python {info['llama_cpp_python']}, {info['threads']} "
          f"threads, wall time, KV cache {info['kv_type']}, flash attention {info['flash_attn']}, "
          f"{info['system_info']}")
    return peer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--context", type=int, default=240)
    ap.add_argument("--steps", type=int, default=15, help="timed steps per variant and size")
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (the engine's "
                    "default: 128 on a CPU)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time this thread's CPU time, not wall time (use with --threads 1)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat every dtype's table this many times: runs that alternate")
    ap.add_argument("--no-eager", action="store_true", help="leave out the eager column")
    ap.add_argument("--no-llamacpp", action="store_true", help="leave out the llama.cpp columns")
    ap.add_argument("--model", default=None, help="HF directory (default: the bundled SmolLM2)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="> 1: time the optimized path on this many ranks, no eager column")
    args = ap.parse_args()
    args.model = args.model or default_model_dir()
    tp = args.tensor_parallel_size
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    rows_list = [int(r) for r in args.rows.split(",")]
    print(cpu.describe())
    threads = torch.get_num_threads() if tp == 1 else max(1, len(os.sched_getaffinity(0)) // tp)
    print(f"tensor_parallel_size {tp}, {threads} thread(s) a rank, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, context {args.context}, "
          f"{'CPU' if args.cpu_time else 'wall'} time, median of {args.steps} interleaved steps")
    header = ("| dtype | rows | eager ms | optimized ms | opt/eager | optimized tok/s | "
              "% of roofline | best optimized ms | % of roofline, best | % of the GEMM between |"
              " llama.cpp ms | best llama.cpp ms | opt/llama.cpp | opt / read bound |"
              " opt / read between |")
    for dtype in args.dtypes.split(",") * args.rounds:
        peer = llama_peer(dtype, args)
        print(header, "|---" * header.count("|", 1) + "|", sep="\n")
        variants = ((("optimized", True),) if tp > 1 or args.no_eager
                    else (("eager", False), ("optimized", True)))
        runners = {name: make_runner(args.model, dtype, max(rows_list), args.context,
                                     args.block_size, fast, tp) for name, fast in variants}
        first = runners["optimized"]
        # As loaded (a fast path re-lays the weights out, not all as parameters); x a rank's shard.
        weight_bytes = first.weight_bytes * tp
        params = weight_bytes // first.dtype.itemsize
        stream_ms, read_rate = weight_stream_ms(weight_bytes)
        # What a step reads besides the weights: each row's KV, `context` tokens of it.
        kv_token_bytes = first.kv_bytes_per_block() * tp // first.block_size
        gflops, gemm, gemm_flops = gemm_gflops(first.dtype, clock)
        # Under TP this process is rank 0, on its share of the cores: the machine's GEMM rate,
        # the roofline's, is that of all ranks at once.
        gflops, gemm_flops = gflops * tp, gemm_flops * tp
        for rows in rows_list:
            outs = {name: decode_batch(r, rows, args.context) for name, r in runners.items()}
            names = ("llama.cpp",) * (peer is not None) + (*runners, "gemm", "read")
            times: dict[str, list[float]] = {name: [] for name in names}
            if peer:
                peer.rows(rows)
            for step in range(args.steps + 2):  # two warm-up steps
                for name in names:
                    if name == "llama.cpp":
                        # Both engines' OpenMP threads spin for a few ms after a parallel
                        # region (~8 ms of CPU time measured here): neither steps beside them.
                        time.sleep(SETTLE_S)
                        peer.step()  # untimed: the timed step follows one of its own
                        seconds = peer.step()
                        time.sleep(SETTLE_S)
                        if step >= 2:
                            times[name].append(seconds)
                        continue
                    if name in runners:  # as serving runs them: a step after a step
                        runners[name].execute_model(outs[name])
                    t = clock()
                    if name == "gemm":
                        gemm()
                    elif name == "read":
                        read_buffer().sum()
                    else:
                        runners[name].execute_model(outs[name])
                    if step >= 2:
                        times[name].append(clock() - t)
            opt = statistics.median(times["optimized"]) * 1e3
            eager = statistics.median(times["eager"]) * 1e3 if "eager" in times else None
            best = min(times["optimized"]) * 1e3
            roofline_ms = rows * 2 * params / (gflops * 1e9) * 1e3
            # The same GEMM, timed between the steps: the machine's rate in the same moments.
            gemm_s = statistics.median(times["gemm"])
            same_moments_ms = rows * 2 * params / gemm_flops * gemm_s * 1e3
            step_bytes = weight_bytes + rows * args.context * kv_token_bytes
            read_ms = step_bytes / weight_bytes * stream_ms
            read_between_ms = (step_bytes / READ_BYTES
                               * statistics.median(times["read"]) * 1e3)
            theirs = times.get("llama.cpp")
            peer_cols = ("- | - | -" if not theirs else f"{statistics.median(theirs) * 1e3:.1f} | "
                         f"{min(theirs) * 1e3:.1f} | {opt / statistics.median(theirs) / 1e3:.2f}")
            eager_ms, ratio = ("-", "-") if eager is None else (f"{eager:.1f}",
                                                                f"{opt / eager:.2f}")
            print(f"| {dtype} | {rows} | {eager_ms} | {opt:.1f} | {ratio} | "
                  f"{rows / opt * 1e3:.0f} | {100 * roofline_ms / opt:.0f}% | {best:.1f} | "
                  f"{100 * roofline_ms / best:.0f}% | {100 * same_moments_ms / opt:.0f}% | "
                  f"{peer_cols} | {opt / read_ms:.2f} | {opt / read_between_ms:.2f} |")
        for runner in runners.values():
            runner.shutdown()
        if peer:
            peer.close()
        print(f"(roofline {dtype}: GEMM {gflops:.0f} GFLOP/s, {params / 1e6:.0f} M params: "
              f"{gflops * 1e9 / (2 * params):.0f} tok/s; weight-streaming bound: "
              f"{weight_bytes / 1e6:.0f} MB of weights at {read_rate:.1f} GB/s (best read) = "
              f"{stream_ms:.1f} ms per step)")


if __name__ == "__main__":
    main()
