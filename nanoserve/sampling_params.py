"""Per-request sampling parameters (vLLM's names), validated before any engine state changes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import partial

from nanoserve.utils import as_token_id, check_field, is_int

MAX_N = 128  # completions per prompt (OpenAI's limit)


class RequestOutputKind(enum.Enum):
    """vLLM's: what `step()` returns for a request. FINAL_ONLY: one output when it finishes.
    DELTA: every step, the new tokens and text since the last output (a server streams them)."""

    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How one request samples and when it stops (the engine copies it), vLLM's fields: temperature
    below 1e-5 is greedy (argmax), top_k None (0, -1) off, max_tokens None up to max_model_len,
    `seed` the request's own generator (reproducible for one batch schedule), `stop` strings end it
    in its text (entrypoints/detokenizer.py), `logprobs` N (True: 1) each token's, the top N's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = field(default_factory=list)  # None: []
    seed: int | None = None  # -1: None; no other negative (manual_seed would alias them)
    stop: list[str] = field(default_factory=list)  # a str is a list of one
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # False: <|im_end|> and the like stay in the text
    n: int = 1
    logprobs: int | None = None  # None: none; 0: the sampled token's only; N: and the top N
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        need = partial(check_field, self)
        if self.top_k in (-1, 0) and is_int(self.top_k):  # vLLM's "off": 0, or -1
            self.top_k = None  # here, not in __post_init__: params may be changed after init
        self.seed = None if self.seed == -1 and is_int(self.seed) else self.seed  # vLLM's
        need(self.max_tokens is None or is_int(self.max_tokens) and self.max_tokens >= 1,
             "max_tokens", "None or an integer >= 1")
        # NaN fails `0 <= t` (where `t < 0` would let it through to crash the sampler).
        need(isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 2,
             "temperature", "a number in [0, 2]")  # vLLM's and OpenAI's range
        need(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(self.top_k is None or (is_int(self.top_k) and self.top_k >= 1),
             "top_k", "None, 0 or -1 (disabled) or an integer >= 1")
        stop = [] if self.stop_token_ids is None else self.stop_token_ids
        ids = [as_token_id(t) for t in stop] if isinstance(stop, (list, tuple)) else [None]
        need(all(t is not None and t >= 0 for t in ids), "stop_token_ids",
             "a list of integers >= 0")
        self.stop_token_ids = ids
        need(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**64),
             "seed", "None, -1 or an integer in [0, 2**64)")
        self.stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        need(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             "stop", "a non-empty string or a list of them")
        need(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output",
             "a bool")
        need(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "a bool")
        need(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"an integer in [1, {MAX_N}]")
        lp = self.logprobs = 1 if self.logprobs is True else self.logprobs  # vLLM's True
        need(lp is None or (is_int(lp) and lp >= 0), "logprobs",  # at most max_logprobs: the
             "None or an integer >= 0")  # engine's (entrypoints/input_processor.py)
        need(isinstance(self.output_kind, RequestOutputKind), "output_kind", "a RequestOutputKind")

    @property
    def greedy(self) -> bool:
        # vLLM's _SAMPLING_EPS: dividing logits by a smaller temperature overflows float32.
        return self.temperature < 1e-5
