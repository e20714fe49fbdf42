"""§4 ("process outputs") and §7: what `LLM` hands back for a request: its completions' text and
tokens, and its latencies (request_output builds it from the request and its detokenizer)."""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.engine.request import Request
from nanoserve.entrypoints.detokenizer import Detokenizer
from nanoserve.layers.sampler import Logprob


@dataclass
class RequestMetrics:
    """Seconds. TTFT: arrival to first token (queueing included, §7). TPOT: mean time per
    output token after the first. E2E: arrival to finish."""

    arrival_time: float
    ttft: float | None
    tpot: float | None
    e2e: float | None
    num_preemptions: int
    num_cached_tokens: int

    @classmethod
    def from_request(cls, req: Request) -> RequestMetrics:
        first, finish, n = req.first_token_time, req.finish_time, req.num_output_tokens
        ttft = None if first is None else first - req.arrival_time
        e2e = None if finish is None else finish - req.arrival_time
        tpot = None if first is None or finish is None or n < 2 else (finish - first) / (n - 1)
        return cls(req.arrival_time, ttft, tpot, e2e, req.num_preemptions, req.num_cached_tokens)


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's); `n` > 1 gives several, `index` tells which."""

    index: int
    text: str  # DELTA outputs (SamplingParams.output_kind): the new text and tokens only
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or "error"; None: still running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    error: str | None = None  # why, when finish_reason is "error"
    logprobs: list[dict[int, Logprob]] | None = None  # per token: its own and the top N

    def finished(self) -> bool:  # vLLM's
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of this output's sampled tokens' logprobs (None without logprobs)."""
        return None if self.logprobs is None else sum(
            next(iter(entry.values())).logprob for entry in self.logprobs)  # sampled: first


@dataclass
class RequestOutput:
    """vLLM's: a prompt and its completions. `text`, `token_ids`, ... are the first completion's
    (with n=1, the only one)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True  # False: a DELTA output of a running request
    prompt_logprobs = None  # vLLM's field: the prompt's logprobs are not computed here

    text = property(lambda self: self.outputs[0].text)
    token_ids = property(lambda self: self.outputs[0].token_ids)
    finish_reason = property(lambda self: self.outputs[0].finish_reason)
    stop_reason = property(lambda self: self.outputs[0].stop_reason)
    error = property(lambda self: self.outputs[0].error)
    logprobs = property(lambda self: self.outputs[0].logprobs)
    cumulative_logprob = property(lambda self: self.outputs[0].cumulative_logprob)
    num_cached_tokens = property(lambda self: self.metrics.num_cached_tokens)  # vLLM's name


def request_output(req: Request, d: Detokenizer) -> RequestOutput:
    """A request's output now: its text and tokens since the last (DELTA) or all of them, from
    its detokenizer; its logprobs' tokens decoded, where asked for."""
    first = d.num_sent_tokens if d.delta else 0  # the first output token this one returns
    text, token_ids, stop_reason = d.output(req)
    logprobs = None
    if req.sampling_params.logprobs is not None:
        logprobs = d.decode_logprobs(req.logprobs[first:first + len(token_ids)])
    completion = CompletionOutput(0, text, token_ids, req.finish_reason and
                                  req.finish_reason.value, stop_reason, req.error, logprobs)
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                         RequestMetrics.from_request(req), finished=req.is_finished)
