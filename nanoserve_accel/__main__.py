"""`python -m nanoserve_accel --plan [--family]`: the dispatch plan (plan.py) of this machine, or
of each CPU family (the table in README.md)."""

from __future__ import annotations

import argparse

from nanoserve.utils import cpu
from nanoserve_accel import kernels, plan


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m nanoserve_accel", description=__doc__)
    p.add_argument("--plan", action="store_true", help="print the dispatch plan")
    p.add_argument("--family", action="store_true", help="each CPU family's, not this machine's")
    args = p.parse_args()
    if not args.plan:
        p.error("nothing to do: give --plan")
    if args.family:
        print(plan.table(plan.FAMILIES))
        return
    print(cpu.describe())
    print(plan.table({"this machine": plan.Machine.probe(kernels.compile_kernels())}))


if __name__ == "__main__":
    main()
