"""Per-request sampling parameters (vLLM's names), validated before any engine state changes."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

# vLLM's: a temperature below it is greedy (dividing logits by it overflows float32).
_SAMPLING_EPS = 1e-5


def is_int(value: object) -> bool:
    """bools are ints to Python, not to us (EngineConfig rejects them too)."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_token_id(value: object) -> int | None:
    """`value` as an int if it is integer-like (int, numpy.int64, ...; not bool), else None."""
    try:
        return None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        return None


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature below 1e-5 (0 included) means greedy (argmax). top_k None (or -1, vLLM's
    spelling) disables top-k. `seed` gives the request its own generator: reproducible for
    the same batch schedule (README: what is guaranteed). The engine keeps its own copy.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and its allowed range."""
        if self.top_k == -1:  # here, not in __post_init__: params may be changed after init
            self.top_k = None
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        # `not t >= 0` (rather than `t < 0`) also rejects NaN, which would crash the sampler.
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be -1 or None (disabled) or an integer >= 1, "
                             f"got {self.top_k!r}")
        stop = self.stop_token_ids
        ids = [as_token_id(t) for t in stop] if isinstance(stop, (list, tuple)) else [None]
        if not all(t is not None and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {stop!r}")
        self.stop_token_ids = ids
        # torch.Generator.manual_seed takes [-2**63, 2**64); negative seeds alias others.
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS
