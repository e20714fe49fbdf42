"""Static vs continuous batching, measured: the numbers behind chapter 2.2 §2, §3 and §7.

§2 claims that static batching wastes most seat-steps when output lengths are skewed; §3
that iteration-level scheduling removes that waste; §7 that latency (TTFT, TPOT, E2E,
p95/p99) depends on load. This runs the *same work* (the same chat-templated prompt ids,
exactly the requested number of output tokens per request, EOS ignored) on several systems
(benchmarks/systems.py) and measures all three, and each engine's start-up. Useful tokens =
the sum of the requested lengths; whatever a system computes beyond that is waste.

    python bench.py                        # longtail workload, the four systems
    python bench.py --workload chapter     # §2's example, with its picture
    python bench.py --quick                # smaller, ~1 min
    python bench.py --workload vllm-longtail --systems continuous,vllm   # vs real vLLM
    python bench.py --workload vllm-longtail --systems continuous,llamacpp  # vs llama.cpp
    python bench.py --workload batching         # §1: decode step time at 1/4/16/64 rows
    python bench.py --workload prefill-stutter  # §7: a long prompt, chunked prefill off/on
    python bench.py --workload nano-vllm --systems continuous   # nano-vllm's bench (GPU: whole)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from benchmarks import report, steps
from benchmarks.llamacpp_system import LlamaCpp
from benchmarks.systems import DTYPES, Continuous, HFContinuous, HFStatic, Static, SystemResult
from benchmarks.vllm_system import VLLM
from benchmarks.workloads import WORKLOADS, make_workload

SYSTEMS = {s.name: s for s in (Continuous, Static, HFStatic, HFContinuous, VLLM, LlamaCpp)}
DEFAULT_SYSTEMS = ("continuous", "static", "hf-static", "hf-cb")


def concrete_dtype(dtype: str) -> str:
    """--dtype auto: nanoserve resolves it itself (bf16 on CPUs with bf16 matmul units);
    the other systems get the dtype it picks here, so that all do the same arithmetic."""
    if dtype != "auto":
        return dtype
    from nanoserve.config import resolve_dtype

    return resolve_dtype("auto", "cuda" if torch.cuda.is_available() else "cpu")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=(*WORKLOADS, *steps.STEP_WORKLOADS),
                   default="longtail",
                   help="vllm-longtail: 64 prompts of ~40..90 tokens, outputs clipped to 256; "
                        "nano-vllm: its bench.py (256 x 100-1024 in/out, temperature 0.6; "
                        "scaled down 8x on a CPU); "
                        "batching (§1) and prefill-stutter (§7): nanoserve's step times")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--model", default=None, help="HF-style directory (default: bundled SmolLM2)")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="float32",
                   help="auto: nanoserve's choice, which the other systems then use too")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="batch seats (default: 8 for chapter, 16 for longtail)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-requests", type=int, default=64, help="longtail only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arrival-rate", type=float, default=None,
                   help="Poisson arrivals (requests/s); default: all at t=0. hf-static "
                        "and vllm ignore it (all of a batch there at t=0)")
    p.add_argument("--quick", action="store_true", help="a smaller workload (~1 min)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice, one per core)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON results (default bench_results/<workload>.json)")
    p.add_argument("--png", type=Path, default=None,
                   help="timeline picture (default bench_results/<workload>.png)")
    p.add_argument("--trace-dir", type=Path, default=None,
                   help="write the nanoserve systems' steps to DIR/<workload>.jsonl (one run "
                        "each); view: python scripts/reader/trace_page.py DIR/<workload>.jsonl")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {tuple(SYSTEMS)}")
    return args


def main(argv: list[str] | None = None) -> list[SystemResult]:
    args = parse_args(argv)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from nanoserve.entrypoints.bundled import default_model_dir
    from nanoserve.utils import cpu

    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model or default_model_dir()
    print(cpu.describe())  # which machine every figure below comes from
    if args.workload in steps.STEP_WORKLOADS:  # one engine, timed step by step
        steps.run(args.workload, model_dir, args.dtype, args.quick, args.out, args.png)
        return []
    wl = make_workload(args.workload, AutoTokenizer.from_pretrained(model_dir),
                       args.num_requests, args.seed, args.quick, args.arrival_rate,
                       args.max_num_seqs)
    dtype = concrete_dtype(args.dtype)
    print(f"workload {wl.name}: {wl.description}; max_num_seqs {wl.max_num_seqs}; "
          f"prompt tokens {wl.prompt_tokens}; dtype {args.dtype}"
          f"{'' if dtype == args.dtype else f' ({dtype})'}; torch threads "
          f"{torch.get_num_threads()}")
    results, loads = [], {}
    trace = args.trace_dir / f"{wl.name}.jsonl" if args.trace_dir else None
    if trace:
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_text("")  # the systems append their runs
    for name in args.systems:
        nanoserve = name in ("continuous", "static")
        system = SYSTEMS[name](model_dir, args.dtype if nanoserve else dtype,
                               args.max_num_batched_tokens)
        if trace and nanoserve:
            system.trace_file = str(trace)
        why_not = system.unavailable()
        if why_not:
            print(f"skipping {name}: {why_not}")
            continue
        print(f"running {name} ...", end=" ", flush=True)
        results.append(system.run(wl))
        # 1-minute load average, ours included: well above 1 + the threads we use means
        # someone else was computing too, and the timings are not trustworthy.
        loads[name] = os.getloadavg()[0]
        print(f"{results[-1].wall_s:.1f} s (load average {loads[name]:.1f})", flush=True)

    best = report.best_utilisation(wl.jobs, wl.max_num_seqs)
    identical = {} if wl.temperature else report.identical_counts(results)  # sampled: differ
    print("", report.throughput_table(results), "", report.latency_table(results), "",
          report.startup_table(results), sep="\n")
    print(f"best possible seat utilisation for this workload: {best:.1%} "
          "(bound: no fewer steps than the longest request, nor than all work / seats)")
    for line in report.ratio_lines(results):
        print(line)
    for name, count in identical.items():
        print(f"greedy tokens identical to continuous ({dtype}): {name} {count}/{len(wl.jobs)} "
              "requests")
    for r in results:
        for note in r.notes:
            print(f"note ({r.system}): {note}")
        if r.timeline:
            print(report.text_timeline(r))

    out = args.out or Path("bench_results") / f"{wl.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None
                                                        else sys.argv[1:])),
        "machine": report.machine_info(), "dtype": dtype, "workload": {
            "name": wl.name, "description": wl.description, "max_num_seqs": wl.max_num_seqs,
            "output_lengths": [j.max_tokens for j in wl.jobs],
            "prompt_lengths": [len(j.prompt_ids) for j in wl.jobs],
            "arrivals": [j.arrival for j in wl.jobs]},
        "load_average_after": loads, "best_utilisation": best,
        "results": [r.summary() for r in results], "ratios": report.ratio_lines(results),
        "identical_to_continuous": identical,
        "timelines": {r.system: r.timeline for r in results if r.timeline}}, indent=1))
    print(f"wrote {out}")
    png = args.png or Path("bench_results") / f"{wl.name}.png"
    if report.draw_png(results, png, f"{wl.name}: {wl.description}"):
        print(f"wrote {png}")
    if trace:
        print(f"wrote {trace} (a page: python scripts/reader/trace_page.py {trace})")
    return results


if __name__ == "__main__":
    main()
