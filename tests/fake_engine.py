"""A model-free engine for fast scheduler tests: the real Scheduler and BlockManager, and
a fake runner whose next token depends only on the request's own tokens, so a request's
output is the same whatever it was batched with, chunked into or preempted by."""

from __future__ import annotations

from nanoserve.config import EngineConfig
from nanoserve.engine.scheduler import SchedulerOutput, make_scheduler
from nanoserve.engine.sequence import Request
from nanoserve.sampling_params import SamplingParams

VOCAB = 1000
EOS = 999  # never produced by next_token, so only max_tokens stops a fake request


def next_token(token_ids: list[int]) -> int:
    return (sum(token_ids) * 31 + len(token_ids)) % (VOCAB - 1)


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeRunner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.num_calls = 0

    def execute_model(self, out: SchedulerOutput) -> dict[str, int]:
        self.num_calls += 1
        sampled = {}
        for entry in out.scheduled:
            req, n = entry.request, entry.num_new_tokens
            if n < 1 or req.num_computed_tokens + n > req.num_tokens:
                raise AssertionError(f"bad schedule for {req.request_id}: {n} tokens")
            if len(req.block_table) * self.block_size < req.num_computed_tokens + n:
                raise AssertionError(f"{req.request_id} has no KV slot for its new tokens")
            if entry.samples != (req.num_computed_tokens + n == req.num_tokens):
                raise AssertionError(f"{req.request_id}: samples is {entry.samples}")
            if entry.samples:
                sampled[req.request_id] = next_token(req.token_ids)
        return sampled


class FakeEngine:
    """Scheduler + FakeRunner with the same step() loop as LLM.step()."""

    def __init__(self, num_kv_blocks: int = 64, block_size: int = 4, **config: object) -> None:
        # No model here: max_model_len defaults to the old engine default, not a model's.
        self.config = EngineConfig(**{"max_model_len": 2048, **config})
        self.scheduler = make_scheduler(self.config, num_kv_blocks, block_size)
        self.runner = FakeRunner(block_size)
        self.requests: dict[str, Request] = {}
        self.outputs: list[SchedulerOutput] = []

    def add(self, request_id: str, prompt: list[int], max_tokens: int, priority: int = 0,
            arrival_time: float | None = None) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        req = Request(request_id, prompt, params, frozenset({EOS}), priority=priority)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        return req

    def step(self) -> list[Request]:
        out = self.scheduler.schedule()
        self.outputs.append(out)
        if out.is_empty:
            if not out.preempted and self.scheduler.has_unfinished_requests():
                raise AssertionError("nothing scheduled although requests are pending")
            return []
        return self.scheduler.update_from_output(out, self.runner.execute_model(out))

    def run(self, max_steps: int = 10_000) -> list[Request]:
        finished = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return finished
            finished += self.step()
        raise AssertionError(f"not finished after {max_steps} steps (livelock?)")
