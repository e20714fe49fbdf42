"""§4: the loop — receive requests, schedule, one forward step, process outputs, repeat.

`LLMEngine.step()` is one turn of that loop and the only place the three parts meet:
    scheduler.schedule() -> model_runner.execute_model() -> scheduler.update_from_output()
Requests come in as token ids and leave as tokens; the text around them (prompts, detokenized
outputs and stop strings, n completions, `generate()`) is the entry points', as in vLLM: the
`LLM` class (entrypoints/llm.py) and the server run this same loop."""

from __future__ import annotations

import time
from dataclasses import dataclass

from nanoserve.config import EngineConfig, resolve_config
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.request import FinishReason, Request
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.static_scheduler import StaticScheduler
from nanoserve.engine.trace import Tracer
from nanoserve.models.loader import load_config


@dataclass
class EngineStats:
    """§7's numbers of the engine now (vLLM's metrics)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use
    num_free_blocks: int
    num_preemptions: int
    prefix_cache_hit_rate: float  # hit tokens / queried tokens, first admissions only (vLLM)
    num_steps: int


class LLMEngine:
    def __init__(self, model_dir: str, config: EngineConfig) -> None:
        self.model_dir, self.hf_config = model_dir, load_config(model_dir)
        self.vocab_size = self.hf_config.vocab_size
        self.config = resolve_config(config, self.hf_config)  # before any weight loads
        self.model_runner = ModelRunner(self.config, model_dir)
        scheduler_cls = StaticScheduler if self.config.batching == "static" else Scheduler
        self.scheduler = scheduler_cls(self.config, self.model_runner.num_kv_blocks,
                                       self.config.block_size)
        self.tracer = Tracer.from_config(self.config, self.scheduler.block_manager)  # or None
        self.num_steps = 0
        self.last_scheduler_output: SchedulerOutput | None = None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def trace_to(self, path: str, source: str = "engine") -> None:
        """Append every following step to `path` as JSON lines, a new run (trace.py)."""
        print_lines = self.tracer is not None and self.tracer.print_lines
        self.tracer = Tracer(path, self.config, self.scheduler.block_manager, source, print_lines)

    def step(self) -> list[Request]:
        """One turn of the loop (§4); returns the requests that finished in it. Every scheduled
        request that sampled has its new token (and logprobs) appended."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        finished: list[Request] = []
        if not out.is_empty:
            sampled = self.model_runner.execute_model(out)
            for entry in out.scheduled:  # before update_from_output, which may end the request
                if (logprobs := sampled.logprobs.get(entry.request.request_id)) is not None:
                    entry.request.logprobs.append(logprobs)
            finished = self.scheduler.update_from_output(out, sampled.token_ids)
        elif not out.preempted and self.scheduler.has_unfinished_requests():
            # (A step that only preempted is progress: a request evicted itself.)
            raise RuntimeError("the scheduler could schedule nothing although requests are "
                               "pending; this is a bug (it would otherwise hang)")
        self.num_steps += 1
        self.last_scheduler_output = out
        if self.tracer is not None:  # JSON lines, printed lines or both (trace.py)
            self.tracer.record(out, finished, self.scheduler, (time.perf_counter() - start) * 1e3)
        return finished

    def abort_request(self, request_id: str) -> Request | None:
        """End a waiting, running or preempted request now; None if there is none."""
        return self.scheduler.finish_request(request_id, FinishReason.ABORT)

    def shutdown(self) -> None:
        """Stop the other processes (tensor parallel); garbage collection and exit do too."""
        self.model_runner.shutdown()

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.scheduler.block_manager
        return EngineStats(len(s.running), len(s.waiting), bm.usage, bm.num_free_blocks,
                           s.num_preemptions, bm.prefix_cache_hit_rate, self.num_steps)
