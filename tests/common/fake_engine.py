"""A model-free engine for fast scheduler tests: the real Scheduler and BlockManager, the
real `step_inputs`, and a runner whose next token is a hash of the token ids it reads
back from a fake KV cache through the block table (nanoserve.simulator.KVReadingRunner).
With a correct engine a request's output is `expected_output(prompt)`, whatever it was
batched with, chunked into or preempted by; a wrong slot, a stale or wrongly shared block
or a bad prefix hit changes it."""

from __future__ import annotations

from nanoserve.config import EngineConfig
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.static_scheduler import StaticScheduler
from nanoserve.sampling_params import SamplingParams
from nanoserve.simulator import KVReadingRunner, next_token

VOCAB = 1000
EOS = VOCAB - 1  # never produced by next_token, so only max_tokens stops a fake request


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What a correct engine gives: each token is next_token of all the tokens before it."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, VOCAB))
    return tokens[len(prompt):]


class FakeRunner(KVReadingRunner):
    """The KV-reading runner, plus checks that the step itself is well formed."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size, VOCAB)
        self.num_calls = 0

    def execute_model(self, out: SchedulerOutput) -> dict[str, int]:
        self.num_calls += 1
        sampling = set()
        for entry in out.scheduled:
            req, n = entry.request, entry.num_new_tokens
            if n < 1 or req.num_computed_tokens + n > req.num_tokens:
                raise AssertionError(f"bad schedule for {req.request_id}: {n} tokens")
            if len(req.block_table) * self.block_size < req.num_computed_tokens + n:
                raise AssertionError(f"{req.request_id} has no KV slot for its new tokens")
            if entry.samples != (req.num_computed_tokens + n == req.num_tokens):
                raise AssertionError(f"{req.request_id}: samples is {entry.samples}")
            if entry.samples:
                sampling.add(req.request_id)
        tokens = super().execute_model(out)
        assert tokens.keys() == sampling, (tokens.keys(), sampling)
        return tokens


class FakeEngine:
    """Scheduler + FakeRunner with the same step() loop as LLM.step()."""

    def __init__(self, num_kv_blocks: int = 64, block_size: int = 4, **config: object) -> None:
        """`scheduling_policy="static"`: the static baseline (batching="static") in FCFS order,
        so that tests can range over the three schedules."""
        if config.get("scheduling_policy") == "static":
            config.update(scheduling_policy="fcfs", batching="static")
        # No model here: max_model_len defaults to the old engine default, not a model's.
        self.config = EngineConfig(**{"max_model_len": 2048, "max_num_seqs": 32,
                                      "max_num_batched_tokens": 1024, **config})
        cls = StaticScheduler if self.config.batching == "static" else Scheduler
        self.scheduler = cls(self.config, num_kv_blocks, block_size)
        self.runner = FakeRunner(num_kv_blocks, block_size)
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
