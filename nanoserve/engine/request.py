"""§6: the state of one request, as the scheduler sees it. No "prefill phase", no "decode phase"
(§6, vLLM V1): a request only advances `num_computed_tokens` toward `num_tokens`; prefill is many
tokens uncomputed, decode exactly one (the last sampled).

Invariants:
    0 <= num_computed_tokens <= num_tokens
    len(block_table) * block_size >= num_computed_tokens (every computed token has a slot)"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from nanoserve.layers.sampler import Logprob
from nanoserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue, never scheduled yet
    RUNNING = "running"  # in the running deque, owns KV blocks
    PREEMPTED = "preempted"  # §6.3: back in waiting, blocks freed, will recompute
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"  # the sampler could not sample this request's row (Request.error says why)


@dataclass(eq=False)  # identity equality: two requests are never "equal"
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # PRIORITY policy: smaller value is served first (vLLM's convention)
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    token_ids: list[int] = field(init=False)  # prompt, then outputs: one list, O(1) appends
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks cached so far
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # prefix-cache hit at the first admission
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # its own, on the sampler's device, if seeded
    first_token_time: float | None = None  # metrics timestamps: time.monotonic()
    finish_time: float | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per output token, if asked

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
