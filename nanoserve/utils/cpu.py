"""What this CPU can do, asked in one place: `dtype="auto"` (config.py) and the fast paths'
kernel choice read it, and tests fake it (tests/conftest.py `--cpu`), so one suite gives the same
verdicts on every machine. Call it through the module (`cpu.has_native_bf16()`) so a fake holds."""

from __future__ import annotations

import functools
import os

# The flags every benchmark prints beside its figures: they decide which path is fastest.
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The kernel's CPU flags (Linux /proc/cpuinfo); empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((x for x in f if x.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def has_native_bf16() -> bool:
    """bf16 matmuls at bf16 speed (AMX or AVX512-BF16, vLLM's CPU check); without them torch
    widens bf16 to fp32 and runs slower than fp32."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def describe() -> str:
    """One line for benchmark headers: the flags that matter here, and the core count."""
    flags = cpu_flags()
    shown = " ".join(f if f in flags else f"no-{f}" for f in REPORTED_FLAGS)
    return f"cpu: {shown}, {os.cpu_count()} cores, native bf16: {has_native_bf16()}"
