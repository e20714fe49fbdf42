"""Where a decode step's time goes on the CPU fast path, part by part, each GEMM beside the time
to read its weights (issue 37's bound for one row: the step within 1.15x of reading what it reads).

The kernels are built with -DSTEP_PARTS (a build of their own in the cache), so that csrc/layer.c
times each part of every layer: the four GEMMs, the decode attention, and the element-wise steps
with the cache write ("other C"). Around it this times the LM head's GEMM and the whole step
(`execute_model`); "the rest" is the step less those: the embedding and final norm, the sampler,
the step's Python. Each timed step follows an untimed one, as step_times.py runs them, and is
followed by step_times.py's read of 256 MB: the memory's rate in the same moments, by which each
part's "x read" is its time over reading its weights. The marks cost ~25 ns each, 7 a layer.

    python nanoserve_accel/bench/step_breakdown.py                 # the bundled model, 1 row
    python nanoserve_accel/bench/step_breakdown.py --dtype float32 --rows 1,4 --steps 60
    python nanoserve_accel/bench/step_breakdown.py --model DIR     # e.g. make_model.py's 1B

A VM's memory rate can drift between two levels within minutes (the Zen 4 VM of docs/benchmarks.md:
~35 and ~60 GB/s), so the steps are reported in two groups, split at --split GB/s (default: halfway
between the slowest and fastest read seen, where they are over 1.3x apart).
"""

from __future__ import annotations

import os

# Before nanoserve_accel.kernels is imported (its flags are read then): the marks built in.
os.environ["NANOSERVE_KERNEL_CFLAGS"] = " ".join(
    [os.environ.get("NANOSERVE_KERNEL_CFLAGS", ""), "-DSTEP_PARTS"]).strip()

import argparse  # noqa: E402
import ctypes  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
from step_times import READ_BYTES, decode_batch, make_runner, read_buffer  # noqa: E402

from nanoserve.engine.model_runner import ModelRunner  # noqa: E402
from nanoserve.entrypoints.bundled import default_model_dir  # noqa: E402
from nanoserve.utils import cpu  # noqa: E402
from nanoserve_accel.layer import FusedDecoderModel  # noqa: E402

PARTS = ("other C", "qkv_proj", "attention", "o_proj", "gate_up_proj", "down_proj")  # layer.c's
GEMMS = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}
COLUMNS = ("step", *GEMMS, "lm_head", "attention", "other C", "the rest")


def gemm_weight_bytes(runner: ModelRunner) -> dict[str, int]:
    """The bytes each GEMM kind reads a step, all layers together, and the LM head's."""
    layers, size = runner.model.model.fused, runner.dtype.itemsize
    found = {name: sum(getattr(layer.args, field).n * getattr(layer.args, field).k * size
                       for layer in layers) for name, field in GEMMS.items()}
    head = runner.model.lm_head
    return found | {"lm_head": head.n * head.k * size}


def time_steps(runner: ModelRunner, rows: int, context: int, steps: int) -> list[dict]:
    """`steps` timed steps of `rows` decode rows (after two more), each as ms per column and
    the ms the read between took."""
    model = runner.model.model
    lib = model.lib
    lib.step_parts.argtypes = [ctypes.c_void_p]
    parts = (ctypes.c_int64 * len(PARTS))()
    head_s = [0.0]
    # The LM head's C GEMM, which the fast path's decode step calls without compute_logits
    # (step.py); the module's forward where it has none.
    head = runner.model.lm_head
    owner, name = (head, "gemm") if hasattr(head, "gemm") else (runner.model, "compute_logits")
    call = getattr(owner, name)

    def timed(*args):
        t = time.perf_counter()
        result = call(*args)
        head_s[0] = time.perf_counter() - t
        return result

    setattr(owner, name, timed)  # this instance only, for this script
    out, found = decode_batch(runner, rows, context), []
    for step in range(steps + 2):
        runner.execute_model(out)
        lib.step_parts(parts)  # from 0
        t = time.perf_counter()
        runner.execute_model(out)
        step_s = time.perf_counter() - t
        lib.step_parts(parts)
        t = time.perf_counter()
        read_buffer().sum()
        read_s = time.perf_counter() - t
        if step < 2:
            continue
        ms = {name: parts[i] / 1e6 for i, name in enumerate(PARTS)}
        ms |= {"step": step_s * 1e3, "lm_head": head_s[0] * 1e3, "read": read_s * 1e3}
        ms["the rest"] = ms["step"] - sum(ms[name] for name in (*PARTS, "lm_head"))
        found.append(ms)
    setattr(owner, name, call)
    return found


def read_rate(step: dict) -> float:
    """GB/s of the read after `step`."""
    return READ_BYTES / step["read"] / 1e6


def report(steps: list[dict], rows: int, step_bytes: int, gemm_bytes: dict[str, int]) -> str:
    """One table row of the steps' medians; each GEMM's ms with its time over reading its
    weights, the step's over reading its weights and KV (each step over its own read)."""
    def x_read(name: str, nbytes: int) -> float:
        return statistics.median(s[name] / (nbytes / READ_BYTES * s["read"]) for s in steps)

    rate = statistics.median(read_rate(s) for s in steps)
    step = statistics.median(s["step"] for s in steps)
    cells = [f"{step:.2f} ({x_read('step', step_bytes):.2f})"]
    for name in (*GEMMS, "lm_head"):
        cells.append(f"{statistics.median(s[name] for s in steps):.2f} "
                     f"({x_read(name, gemm_bytes[name]):.2f})")
    cells += [f"{statistics.median(s[name] for s in steps):.2f}"
              for name in ("attention", "other C", "the rest")]
    return f"| {rows} | {rate:.0f} | {len(steps)} | " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 where the CPU has native "
                    "bf16, else float32")
    ap.add_argument("--model", default=None, help="HF directory (default: the bundled SmolLM2)")
    ap.add_argument("--rows", default="1")
    ap.add_argument("--context", type=int, default=240)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--split", type=float, default=None,
                    help="GB/s between the two groups (0: one group)")
    args = ap.parse_args()
    dtype = args.dtype or ("bfloat16" if cpu.has_native_bf16() else "float32")
    rows_list = [int(r) for r in args.rows.split(",")]
    runner = make_runner(args.model or default_model_dir(), dtype, max(rows_list), args.context)
    if not isinstance(runner.model.model, FusedDecoderModel):
        raise SystemExit("this model's decode layers are not one C call here: nothing to time")
    gemm_bytes = gemm_weight_bytes(runner)
    kv_token_bytes = runner.kv_bytes_per_block() // runner.block_size
    print(cpu.describe())
    print(f"{dtype}, {torch.get_num_threads()} threads, {args.context} tokens of context; ms "
          "(x the time to read its weights, or the step's weights and KV, at the read's rate "
          "after each step)")
    print("| rows | read GB/s | steps | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    for rows in rows_list:
        steps = time_steps(runner, rows, args.context, args.steps)
        if not any(s["qkv_proj"] for s in steps):
            print(f"| {rows} | the decode layers did not run as one C call at this row count |")
            continue
        rates = [read_rate(s) for s in steps]
        split = args.split if args.split is not None else (
            (min(rates) + max(rates)) / 2 if max(rates) > 1.3 * min(rates) else 0)  # 0: one group
        step_bytes = runner.weight_bytes + rows * args.context * kv_token_bytes
        for group in ([s for s, r in zip(steps, rates) if r < split],
                      [s for s, r in zip(steps, rates) if r >= split]):
            if group:
                print(report(group, rows, step_bytes, gemm_bytes))


if __name__ == "__main__":
    main()
