"""Offline decode beside a busy neighbour: the median step of `rows` greedy requests decoding
(LLM.step, so the engine's CPU team follows the cores others leave, entrypoints/cpu_share.py),
quiet and with a process spinning on one core, with that team and with a fixed one.

    flock /tmp/nanoserve-bench.lock .venv/bin/python scripts/bench/neighbour.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.entrypoints import cpu_share
from nanoserve.utils import cpu


def median_step_ms(llm: LLM, rows: int, steps: int) -> tuple[float, int]:
    """The median decode step (ms) of `rows` requests, and the team size at the end."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(rows):
        llm.add_request([(7 * i + j) % 1000 + 10 for j in range(128)], params)
    for _ in range(4):  # the prefill and a few decodes, and a first look at the cores
        llm.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.step()
        times.append((time.perf_counter() - start) * 1e3)
    while llm.has_unfinished_requests():
        llm.step()
    team = llm.core_share.threads if llm.core_share is not None else -1
    return statistics.median(times), team


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--model", default=None, help="HF directory (default: the bundled SmolLM2)")
    ap.add_argument("--core", type=int, default=1, help="the core the neighbour spins on")
    args = ap.parse_args()
    print(cpu.describe())
    threads = torch.get_num_threads()
    print("| rows | neighbour | team | median step ms |")
    print("|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        for neighbour, team in ((False, "follows"), (True, "fixed"), (True, "follows")):
            spinner = subprocess.Popen(["taskset", "-c", str(args.core), sys.executable, "-c",
                                        "while True: pass"]) if neighbour else None
            probe = cpu_share.CoreShare.probe
            if team == "fixed":
                cpu_share.CoreShare.probe = classmethod(lambda cls: None)
            try:
                llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False,
                          skip_tokenizer_init=True, kv_cache_memory_gib=0.5)
                ms, size = median_step_ms(llm, rows, args.steps)
                llm.shutdown()  # the team and the cores it started with, for the next run
            finally:
                cpu_share.CoreShare.probe = probe
                torch.set_num_threads(threads)  # the team a run may have shrunk
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
            shown = f"{team} ({size})" if size > 0 else team
            print(f"| {rows} | {'core ' + str(args.core) if neighbour else '-'} | {shown} | "
                  f"{ms:.1f} |", flush=True)


if __name__ == "__main__":
    main()
