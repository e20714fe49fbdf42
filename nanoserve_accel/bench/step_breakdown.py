"""Where a decode step's time goes on the optimized CPU path: the same step timed with the C
decode attention, the C GEMM, or both replaced by no-ops (interleaved, median of the steps).

    python nanoserve_accel/bench/step_breakdown.py              # float32, 1/16/64 rows
    python nanoserve_accel/bench/step_breakdown.py --dtype bfloat16 --rows 16

"attention" = full step - step without attention (the decode kernel and the C cache write);
"GEMMs" = full step - step without GEMMs; "the rest" = the step with neither (norms, rotary,
residual adds, sampling, Python). The no-op steps compute garbage; only their time is used.
Only the C GEMMs of PanelsLinear and DotFp32Linear are replaced: where the fast path takes oneDNN
(bf16 on native-bf16 CPUs, fp32 from 64 rows on AVX-512) or the dpbf16 GEMM, its GEMMs stay in
"the rest"; use gemm_compare.py for those. Nor are those of a decode layer run as one C call
(csrc/layer.c: every row decoding, up to the plan's rows), whose kernels stay in "the rest".
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
from step_times import decode_batch, make_runner  # noqa: E402

from nanoserve.entrypoints.bundled import default_model_dir
from nanoserve.layers.attention import get_backend
from nanoserve_accel import kernels, paged_attention
from nanoserve_accel.linear import DotFp32Linear, PanelsLinear


def no_op_library(directory: str) -> ctypes.CDLL:
    """The kernels' names, each doing nothing."""
    source, target = Path(directory) / "noop.c", Path(directory) / "noop.so"
    names = {**kernels.ARGTYPES, **kernels.OPTIONAL_ARGTYPES}
    source.write_text("".join(f"int {name}(void) {{ return -1; }}\n"  # -1: "no error"
                                 for name in names))
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(target)], check=True)
    lib = ctypes.CDLL(str(target))
    for name, argtypes in names.items():
        getattr(lib, name).argtypes = argtypes
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None, help="HF directory (default: the bundled SmolLM2)")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (the engine's "
                    "default: 128 on a CPU)")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    lib = kernels.compile_kernels()
    if lib is None:
        raise SystemExit("no C kernels here (no compiler): nothing to break down")
    runner = make_runner(args.model or default_model_dir(), args.dtype, max(rows_list), 240,
                         args.block_size)
    twin = get_backend("torch")
    linears = [m for m in runner.model.modules() if isinstance(m, (PanelsLinear, DotFp32Linear))]
    with tempfile.TemporaryDirectory() as tmp:
        noop = no_op_library(tmp)
        variants = {"full": (lib, lib), "no attention": (noop, lib), "no GEMMs": (lib, noop),
                    "neither": (noop, noop)}
        print(f"{args.dtype}, threads {torch.get_num_threads()}, 240 tokens of context")
        for rows in rows_list:
            out = decode_batch(runner, rows, 240)
            times: dict[str, list[float]] = {name: [] for name in variants}
            for step in range(args.steps + 2):  # two warm-up steps
                for name, (attention_lib, gemm_lib) in variants.items():
                    backend = paged_attention.with_decode_kernel(twin, attention_lib)
                    for layer in runner.attn_layers:
                        layer.backend = backend
                    for linear in linears:
                        linear.gemm = (gemm_lib.linear_panels if isinstance(linear, PanelsLinear)
                                       else gemm_lib.linear_dot_fp32)
                    t = time.perf_counter()
                    runner.execute_model(out)
                    if step >= 2:
                        times[name].append(time.perf_counter() - t)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            print(f"{rows:3d} rows: step {ms['full']:.1f} ms = attention "
                  f"{ms['full'] - ms['no attention']:.1f} + GEMMs {ms['full'] - ms['no GEMMs']:.1f}"
                  f" + the rest ~{ms['neither']:.1f}")


if __name__ == "__main__":
    main()
