"""§4: the loop — receive requests, schedule, one forward step, process outputs, repeat.

`LLMEngine.step()` is one turn of that loop and the only place the three parts meet:
    scheduler.schedule() -> model_runner.execute_model() -> scheduler.update_from_output()
Requests come in as token ids and leave as tokens; the text around them (prompts, detokenized
outputs and stop strings, n completions, `generate()`) is the entry points', as in vLLM: the
`LLM` class (entrypoints/llm.py) and the server run this same loop."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from nanoserve.config import EngineConfig, resolve_config
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.request import FinishReason, Request
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.engine.static_scheduler import StaticScheduler
from nanoserve.engine.trace import Tracer, trace_line
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
        self.trace = self.config.trace or os.environ.get("NANOSERVE_TRACE", "") not in ("", "0")
        self.tracer: Tracer | None = None  # JSON lines of every step (trace.py)
        if self.config.trace_file is not None:
            self.trace_to(self.config.trace_file)
        self.num_steps = 0
        self.last_scheduler_output: SchedulerOutput | None = None

    def check_prompt(self, token_ids: list[int]) -> None:
        """A ValueError unless these ids can run here: in the vocabulary, within max_model_len,
        and with one generated token within the whole KV cache."""
        vocab, bm = self.vocab_size, self.scheduler.block_manager
        if not token_ids:
            raise ValueError("prompt must have at least 1 token, got 0")
        if bad := [t for t in token_ids if not 0 <= t < vocab]:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len "
                             f"({self.config.max_model_len})")
        if (needed := bm.blocks_needed(len(token_ids) + 1)) > bm.num_blocks:
            raise ValueError(f"prompt has {len(token_ids)} tokens: with one generated token it "
                             f"needs {needed} KV blocks, but the whole KV cache has "
                             f"{bm.num_blocks} (num_kv_blocks) of {bm.block_size} tokens")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def trace_to(self, path: str, source: str = "engine") -> None:
        """Append every following step to `path` as JSON lines, a new run (trace.py)."""
        self.tracer = Tracer(path, self.config, self.scheduler.block_manager, source)

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
        if self.tracer is not None:
            self.tracer.record(out, finished, self.scheduler, (time.perf_counter() - start) * 1e3)
        if self.trace:
            print(trace_line(self.num_steps, out, finished, self.scheduler), file=sys.stderr)
        return finished

    def abort_request(self, request_id: str) -> Request | None:
        """End a waiting, running or preempted request now; None if there is none."""
        return self.scheduler.finish_request(request_id, FinishReason.ABORT)

    def shutdown(self) -> None:
        """Stop the engine's other processes (tensor parallel); garbage collection and exit
        stop them too."""
        self.model_runner.shutdown()

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.scheduler.block_manager
        return EngineStats(len(s.running), len(s.waiting), bm.usage, bm.num_free_blocks,
                           s.num_preemptions, bm.prefix_cache_hit_rate, self.num_steps)
