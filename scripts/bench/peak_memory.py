"""Peak resident memory of loading a model and generating a few tokens, against issue 37's bound:
1.15 x (weights + KV pool) + 0.7 GB. Weights and KV are the engine's own counts
(model_runner.weight_bytes, kv_cache_bytes); the peak is the process's VmHWM, so it covers the
load, the fast path's weight conversion and the steps. One model and dtype per process (the peak
cannot be reset):

    python scripts/bench/peak_memory.py --dtype bfloat16                  # the bundled model
    python scripts/bench/peak_memory.py --model /tmp/models/llama-3.2-1b --dtype float32
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from nanoserve import LLM, SamplingParams
from nanoserve.utils import cpu

GB = 1e9


def vm(field: str) -> int:
    """A /proc/self/status size (VmHWM: peak resident, VmRSS: now), in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1)) * 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF directory (default: the bundled model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--no-fast-paths", action="store_true")
    args = p.parse_args()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory_gib=args.kv_gib,
              enable_fast_paths=not args.no_fast_paths)
    prompts = ["Hello!", "What is the capital of France?", "Write a haiku about autumn.",
               "Count to ten: one, two,"]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    runner = llm.model_runner
    weights, kv, peak = runner.weight_bytes, runner.kv_cache_bytes, vm("VmHWM")
    bound = 1.15 * (weights + kv) + 0.7 * GB
    print(cpu.describe())
    print(f"model {args.model or 'bundled'} dtype {args.dtype} fast paths {runner.fast_paths}")
    print(f"weights {weights / GB:.3f} GB  KV {kv / GB:.3f} GB  peak RSS {peak / GB:.3f} GB  "
          f"(now {vm('VmRSS') / GB:.3f})  bound {bound / GB:.3f} GB  "
          f"{'PASS' if peak <= bound else 'FAIL'}")


if __name__ == "__main__":
    main()
