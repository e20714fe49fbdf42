"""Two or more builds of the fast path's C kernels, A/B on one loaded model, step by step.

This VM's memory rate drifts 40-85 GB/s within minutes, and two runners side by side differ by a
few percent by where their weights lie: neither alternating runs nor two runners in one process
show a 3% change. Here one runner decodes the same rows every step, and each step takes its
layers (`decode_layers`) and LM head GEMM from one of the libraries in turn: A, the checkout's
(`nanoserve_accel/csrc`, as the engine builds it), then each DIR given, built the same way; the
order rotates every round so that each build follows the 256 MB read (which ends the round)
equally often. Printed: each build's median step, its ratio to the read of the same rounds (the
step's bytes at that rate), and the median of its step over A's, round by round.

    cp -r nanoserve_accel/csrc /tmp/b && $EDITOR /tmp/b/dpbf16.c
    python scripts/bench/kernel_ab.py bfloat16 /tmp/b [--model DIR --rows 4 --steps 150]
    python scripts/bench/kernel_ab.py bfloat16 /tmp/b --repeat 3  # each build 3 steps in a row
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_times, beside this script
import step_times  # noqa: E402

from nanoserve.entrypoints.bundled import default_model_dir  # noqa: E402
from nanoserve.utils import cpu  # noqa: E402


def build(csrc: Path) -> ctypes.CDLL:
    """csrc's kernels, built as the engine builds its own (into the cache, keyed by source)."""
    from nanoserve_accel import kernels

    if (lib := kernels.compile_kernels(csrc=csrc.resolve())) is None:
        raise SystemExit(f"the kernels in {csrc} did not build (the log says why)")
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("dtype", choices=["float32", "bfloat16"])
    ap.add_argument("csrc", nargs="+", type=Path, help="kernel source directories (B, C, ...)")
    ap.add_argument("--model", default=None, help="HF directory (default: the bundled SmolLM2)")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--context", type=int, default=240)
    ap.add_argument("--steps", type=int, default=150, help="rounds: one step of each build")
    ap.add_argument("--repeat", type=int, default=1,
                    help="steps of a build in a row, the first untimed (2 or more: what a step "
                         "leaves in the caches for the next counts, as in serving)")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    try:
        import nanoserve_accel  # noqa: F401
    except ImportError:
        raise SystemExit("kernel_ab.py needs the fast-path plugin (nanoserve_accel)") from None
    runner = step_times.make_runner(args.model or default_model_dir(), args.dtype, args.rows,
                                    args.context, None, True)
    model, head = runner.model.model, runner.model.lm_head
    if not hasattr(model, "fused") or not hasattr(head, "gemm"):
        raise SystemExit("this model's step does not run in the C kernels here")
    libs = {"A": model.lib, **{str(d): build(d) for d in args.csrc}}
    out = step_times.decode_batch(runner, args.rows, args.context)
    read = step_times.read_buffer()
    names = list(libs)
    times: dict[str, list[float]] = {name: [] for name in (*names, "read")}
    for i in range(args.steps + 4):  # four warm-up rounds
        for name in names[i % len(names):] + names[:i % len(names)]:
            model.lib, head.gemm = libs[name], getattr(libs[name], head.function)
            for j in range(args.repeat):
                t = time.perf_counter()
                runner.execute_model(out)
                if i >= 4 and (j or args.repeat == 1):
                    times[name].append(time.perf_counter() - t)
        t = time.perf_counter()
        read.sum()
        if i >= 4:
            times["read"].append(time.perf_counter() - t)
    model.lib, head.gemm = libs["A"], getattr(libs["A"], head.function)
    median = {name: statistics.median(t) for name, t in times.items()}
    step_bytes = runner.weight_bytes + args.rows * args.context * (
        runner.kv_bytes_per_block() // runner.block_size)
    read_s = step_bytes / step_times.READ_BYTES * median["read"]
    print(cpu.describe())
    print(f"{args.dtype}, {args.rows} row(s), context {args.context}, {args.steps} rounds; the "
          f"read at {step_times.READ_BYTES / median['read'] / 1e9:.1f} GB/s")
    for name in names:
        pairs = statistics.median(b / a for a, b in zip(times["A"], times[name]))
        print(f"{name}: {median[name] * 1e3:.3f} ms, {median[name] / read_s:.3f} of the read, "
              f"{pairs:.3f} of A")


if __name__ == "__main__":
    main()
