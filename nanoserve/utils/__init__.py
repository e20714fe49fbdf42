"""The checks every setting goes through (EngineConfig, SamplingParams); the CPU probe: cpu.py."""

from __future__ import annotations

import operator


def is_int(value: object) -> bool:
    """bools are ints to Python, not to us (EngineConfig rejects them too)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_field(obj: object, ok: bool, name: str, allowed: str) -> None:
    """Every bad setting is this ValueError: the field, what it must be, what it got."""
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {getattr(obj, name)!r}")


def as_token_id(value: object) -> int | None:
    """`value` as an int if it is integer-like (int, numpy.int64, ...; not bool), else None."""
    try:
        return None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        return None


def divide(total: int, tp_size: int, name: str) -> int:
    """Each tensor-parallel rank's share of `total` (heads, MLP columns, vocabulary rows)."""
    if total % tp_size:
        raise ValueError(f"{name} ({total}) must be divisible by tensor_parallel_size ({tp_size})")
    return total // tp_size
