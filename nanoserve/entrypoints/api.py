"""The wire side of nanoserve/serve.py: vLLM's request fields and defaults (entrypoints/openai),
its error shape, its chat-message forms, its server-sent events, and its metric names (as
`nanoserve:`, updated by the engine thread after every step)."""

from __future__ import annotations

import json
import re
from typing import Any

import prometheus_client as prom
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from nanoserve import LLM
from nanoserve.engine.outputs import RequestOutput


class APIError(Exception):
    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             413: "RequestTooLargeError", 500: "InternalServerError"}

    def __init__(self, message: str, param: str | None = None, code: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.TYPES[self.code],
                                       "param": self.param, "code": self.code}}, self.code)


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(BaseModel):  # vLLM's fields and defaults; others are ignored
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    temperature: float | None = None  # None: 1.0
    top_p: float | None = None  # None: 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | bool | None = None
    echo: bool = False
    repetition_penalty: float | None = None  # only "none" (1.0, 0.0) is supported
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class ChatCompletionRequest(CompletionRequest):
    prompt: None = None
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None


class Metrics:
    """vLLM's metric names, prefixed `nanoserve:`; updated by the engine thread after a step."""

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

    def update(self, outputs: list[RequestOutput]) -> None:
        stats, bm = self.llm.stats(), self.llm.scheduler.block_manager
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        now = (stats.num_preemptions, bm.prefix_cache_queries, bm.prefix_cache_hits)
        for counter, new, old in zip((self.preemptions, self.queries, self.hits), now, self.seen):
            counter.inc(new - old)
        self.seen = now
        for out in outputs:
            self.generation_tokens.inc(len(out.token_ids))
            if out.finished:
                self.success.labels(out.finish_reason).inc()
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                for hist, value in ((self.ttft, out.metrics.ttft), (self.tpot, out.metrics.tpot),
                                    (self.e2e, out.metrics.e2e)):
                    if value is not None:
                        hist.observe(value)


def param_of(message: str, fields: set[str], prompt_field: str) -> str | None:
    """The request field an engine ValueError names (its messages start with the field)."""
    word = re.match(r"\w+", message)
    word = word and word.group()
    return prompt_field if word == "prompt" else word if word in fields else None


def chat_message(message: dict) -> dict:
    """{"role", "content"}; content parts ({"type": "text", "text"}) are joined, as in vLLM."""
    role, content = message.get("role"), message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(role, str) or not isinstance(content, str):
        raise APIError("messages must each have a string role and a text content, got "
                       f"{message!r:.200}", "messages")
    return {**message, "role": role, "content": content}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage_of(num_prompt: int, num_completion: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}
