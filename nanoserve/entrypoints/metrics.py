"""The server's /metrics: vLLM's metric names, prefixed `nanoserve:`, updated by the engine thread
after every step (§7's latencies: TTFT, TPOT, end to end); and vLLM's stat log line, every 10 s
while the engine works: the step loop's throughput and its queues (§6, §7) as they move."""

from __future__ import annotations

import asyncio
import sys
import time

import prometheus_client as prom

from nanoserve import LLM
from nanoserve.entrypoints.outputs import RequestOutput


class Metrics:
    def __init__(self, llm: LLM) -> None:
        self.registry, p, self.llm = prom.CollectorRegistry(), "nanoserve:", llm
        gauge, counter = (lambda n, d: prom.Gauge(p + n, d, registry=self.registry),
                          lambda n, d: prom.Counter(p + n, d, registry=self.registry))
        self.running = gauge("num_requests_running", "Requests in the running queue")
        self.waiting = gauge("num_requests_waiting", "Requests waiting (or preempted)")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = all)")
        self.preemptions = counter("num_preemptions", "Preemptions (by recompute)")
        self.queries = counter("prefix_cache_queries", "Prompt tokens looked up in the cache")
        self.hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.success = prom.Counter(p + "request_success", "Finished requests",
                                    ["finished_reason"], registry=self.registry)
        buckets = [.001, .005, .01, .02, .04, .06, .08, .1, .25, .5, .75, 1, 2.5, 5, 10, 20, 40]
        self.ttft = prom.Histogram(p + "time_to_first_token_seconds", "TTFT, queueing included",
                                   buckets=buckets, registry=self.registry)
        self.tpot = prom.Histogram(p + "request_time_per_output_token_seconds",
                                   "TPOT: mean time per output token after the first",
                                   buckets=buckets, registry=self.registry)
        self.e2e = prom.Histogram(p + "e2e_request_latency_seconds", "Arrival to finish",
                                  buckets=buckets, registry=self.registry)
        self.seen = (0, 0, 0)  # preemptions, queries, hits: counted up to here
        # For the log line, read on the event loop: plain values, each replaced whole.
        self.stats = llm.stats()
        self.num_prompt_tokens = self.num_generation_tokens = 0  # computed, sampled: all steps

    def update(self, outputs: list[RequestOutput]) -> None:
        stats, bm = self.llm.stats(), self.llm.scheduler.block_manager
        scheduled = self.llm.last_scheduler_output.scheduled
        self.num_prompt_tokens += sum(s.num_new_tokens for s in scheduled if not s.is_decode)
        self.num_generation_tokens += sum(s.samples for s in scheduled)
        self.stats = stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        now = (stats.num_preemptions, bm.prefix_cache_queries, bm.prefix_cache_hits)
        for counter, new, old in zip((self.preemptions, self.queries, self.hits), now, self.seen):
            counter.inc(new - old)
        self.seen = now
        for out in outputs:
            for completion in out.outputs:  # (n > 1: each child's own last output)
                self.generation_tokens.inc(len(completion.token_ids))
                if completion.finish_reason is not None:
                    self.success.labels(completion.finish_reason).inc()
            if out.finished:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                for hist, value in ((self.ttft, out.metrics.ttft), (self.tpot, out.metrics.tpot),
                                    (self.e2e, out.metrics.e2e)):
                    if value is not None:
                        hist.observe(value)


class LoggingStatLogger:
    """vLLM's: every `interval` seconds (NANOSERVE_LOG_STATS_INTERVAL, vLLM's 10 by default) one
    line on stderr: prompt tokens computed and tokens generated a second since the last line, the
    running and waiting requests, the KV blocks in use, the prefix cache's hits since the last
    line. An idle engine prints nothing after the line that shows it idle."""

    def __init__(self, metrics: Metrics, interval: float) -> None:
        self.metrics, self.interval = metrics, interval
        self.last = self.snapshot(time.monotonic())
        self.was_idle = True

    def snapshot(self, now: float) -> tuple[float, int, int, int, int]:
        m = self.metrics  # (the engine thread's numbers; the LLM itself is that thread's alone)
        return (now, m.num_prompt_tokens, m.num_generation_tokens, m.seen[1], m.seen[2])

    def line(self, now: float) -> str | None:
        """The line for the time since the last one (None: idle then and now)."""
        new = self.snapshot(now)
        (seconds, prompt, generation, queries, hits), self.last = (
            [b - a for a, b in zip(self.last, new)], new)
        stats = self.metrics.stats
        idle = not (prompt or generation or stats.num_running or stats.num_waiting)
        if idle and self.was_idle:
            return None
        self.was_idle = idle
        return (f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, Avg generation "
                f"throughput: {generation / seconds:.1f} tokens/s, Running: {stats.num_running} "
                f"reqs, Waiting: {stats.num_waiting} reqs, KV cache usage: "
                f"{stats.kv_cache_usage:.1%}, Prefix cache hit rate: {hits / max(queries, 1):.1%}")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if (line := self.line(time.monotonic())) is not None:
                print(f"nanoserve: {line}", file=sys.stderr, flush=True)
