"""Write a benchmark model: random weights in a real model's shape with the bundled tokenizer,
no hub (benchmarks/shapes.py).

    python scripts/bench/make_model.py llama-3.2-1b --out ~/models/llama-3.2-1b-random
    python bench.py --model ~/models/llama-3.2-1b-random --workload vllm-longtail
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.shapes import SHAPES, make_random_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args()
    print(make_random_model(args.shape, args.out, getattr(torch, args.dtype)))


if __name__ == "__main__":
    main()
