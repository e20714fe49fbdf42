"""§3–§4 served: an OpenAI-compatible HTTP server on the chapter's loop ("receive, schedule,
forward, process, repeat"), with requests that really arrive while others run.

    python -m nanoserve.serve [MODEL] --port 8000      (or: nanoserve serve [MODEL] ...)

One engine thread owns the `LLM` and runs the loop: between two `step()`s it takes the adds and
aborts that the asyncio front end put in its inbox (a thread-safe queue), and when nothing is
left it blocks on that inbox (never spins). Each step's outputs (DELTAs, detokenized on the
engine thread) go back to the event loop with one `call_soon_threadsafe`; there a per-request
`Collector` merges them until its handler reads, so a slow client never stalls the loop. A client
that disconnects, streaming or not, aborts its request: its KV blocks are free at the next step.
Tokenizing prompts runs on one tokenizer thread; the event loop only parses and writes JSON.

Endpoints and fields are vLLM's (entrypoints/openai): /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics (Prometheus, vLLM's metric names as `nanoserve:`). Errors are
{"error": {"message", "type", "param", "code"}}: 400 for a bad value (param names the field),
404 for an unknown model, 401 without the --api-key. Unknown fields are ignored, as in vLLM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import prometheus_client as prom
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from nanoserve import LLM, SamplingParams
from nanoserve.engine.outputs import RequestOutput
from nanoserve.entrypoints.api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Metrics,
    chat_message,
    param_of,
    sse,
    usage_of,
)
from nanoserve.sampling_params import RequestOutputKind
from nanoserve.utils.bundled import MODEL_NAME


class Collector:
    """One request's outputs, merged on the event loop until its handler reads them."""

    def __init__(self) -> None:
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.ready = asyncio.Event()
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.last: RequestOutput | None = None
        self.request_id: str | None = None  # the engine's id: read and written there only

    def put(self, output: RequestOutput) -> None:
        self.texts.append(output.text)
        self.token_ids += output.token_ids
        self.last = output
        self.ready.set()

    async def get(self) -> tuple[str, list[int], RequestOutput]:
        """Everything since the last get(): (text, token ids, the latest output)."""
        await self.ready.wait()
        self.ready.clear()
        text, ids, self.texts, self.token_ids = "".join(self.texts), self.token_ids, [], []
        return text, ids, self.last


class EngineThread:
    """§4's loop on its own thread, which also builds the LLM (`build`): the only thread that
    touches it. The step's OpenMP threads then spin between parallel regions: each thread that
    ever runs one keeps its own OpenMP team, and with more team threads than cores libgomp's
    idle threads sleep at once instead of spinning, so every region waits for their wake-up
    (docs/serving.md)."""

    def __init__(self, build: Callable[[], LLM], num_threads: int | None = None) -> None:
        self.build, self.num_threads = build, num_threads
        self.llm: LLM | None = None
        self.error: BaseException | None = None  # what building the LLM raised
        self.ready = threading.Event()  # set once the LLM exists, or failed to
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, before any request
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.live: dict[str, Collector] = {}  # request_id -> its collector
        self.thread = threading.Thread(target=self.run, name="nanoserve-engine", daemon=True)
        self.thread.start()

    def add(self, collector: Collector, prompt: list[int], params: SamplingParams) -> None:
        self.inbox.put(("add", collector, prompt, params))

    def abort(self, collector: Collector) -> None:
        self.inbox.put(("abort", collector))

    def _to_loop(self, fn: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop closed: nobody is listening
            self.loop.call_soon_threadsafe(fn, *args)

    def _receive(self, block: bool) -> bool:
        """Take every add and abort queued; wait for one first if idle. False: stop."""
        items = [self.inbox.get()] if block else []
        with contextlib.suppress(queue.Empty):
            while True:
                items.append(self.inbox.get_nowait())
        for kind, collector, *rest in items:
            if kind == "stop":
                return False
            if kind == "abort":
                if collector.request_id in self.live:
                    self.llm.abort(collector.request_id)
                continue
            try:
                collector.request_id = self.llm.add_request(*rest)
            except Exception as e:  # ValueError: the engine's checks, a 400 naming the field
                self._to_loop(_resolve, collector.accepted, e)
                continue
            self.live[collector.request_id] = collector
            self._to_loop(_resolve, collector.accepted, None)
        return True

    def run(self) -> None:
        if self.num_threads is not None:  # OpenMP's thread count is per thread: set it here
            torch.set_num_threads(self.num_threads)
        try:
            self.llm = self.build()
            self.metrics = Metrics(self.llm)
        except BaseException as e:  # ValueError: a bad flag; main() exits with it
            self.error = e
            return
        finally:
            self.ready.set()
        while self._receive(block=not self.llm.has_unfinished_requests()):
            self._step()
        for request_id in list(self.live):  # shutdown: what is left is aborted
            self.llm.abort(request_id)
        while self.llm.has_unfinished_requests():
            self._step()

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception:  # a bug or a failed forward: fail the requests, keep serving
            traceback.print_exc()
            outputs = []
            for request_id in list(self.live):
                self.llm.abort(request_id)
        batch = [(self.live.pop(o.request_id) if o.finished else self.live[o.request_id], o)
                 for o in outputs if o.request_id in self.live]
        if batch:
            self._to_loop(_deliver, batch)
        self.metrics.update(outputs)

    def stop(self) -> None:
        self.inbox.put(("stop", None))
        self.thread.join(timeout=60)


def _resolve(future: asyncio.Future, error: Exception | None) -> None:
    if not future.done():
        future.set_result(error)


def _deliver(batch: list[tuple[Collector, RequestOutput]]) -> None:
    for collector, output in batch:
        collector.put(output)


class Server:
    def __init__(self, engine: EngineThread, model_name: str, api_key: str | None = None) -> None:
        self.engine, self.llm = engine, engine.llm  # the front end reads its config, tokenizer
        self.model_name, self.api_key = model_name, api_key
        self.max_model_len = self.llm.config.max_model_len
        self.max_body_bytes = (1 << 20) + 32 * self.max_model_len  # text or token ids
        self.tokenize_pool = ThreadPoolExecutor(1, "nanoserve-tokenize")  # HF: one at a time
        self.app = FastAPI(lifespan=self.lifespan)
        self.app.get("/health")(self.health)
        self.app.get("/metrics")(self.metrics)
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.chat_completions)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        self.engine.loop = asyncio.get_running_loop()
        yield
        self.engine.stop()  # after uvicorn finished (or cancelled) the in-flight requests
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def authorize(self, request: Request) -> None:
        if self.api_key is not None and \
                request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise APIError("missing or wrong API key", None, 401)

    async def health(self) -> Response:
        alive = self.engine.thread.is_alive()
        return Response(status_code=200 if alive else 503)

    async def metrics(self) -> Response:
        return Response(prom.generate_latest(self.engine.metrics.registry),
                        media_type=prom.CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request)
        except APIError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "nanoserve", "root": self.llm.model_dir, "parent": None,
            "max_model_len": self.max_model_len}]})

    async def completions(self, request: Request) -> Response:
        return await self.serve(request, CompletionRequest, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.serve(request, ChatCompletionRequest, chat=True)

    async def serve(self, request: Request, model: type[BaseModel], chat: bool) -> Response:
        """Read and check, hand the request to the engine, answer; a disconnect aborts."""
        try:
            self.authorize(request)
            body = await self.read_body(request)
        except APIError as e:
            return e.response()
        work = asyncio.ensure_future(self._serve(body, model, chat))
        disconnect = asyncio.ensure_future(_disconnected(request))  # the body is read: safe
        await asyncio.wait((work, disconnect), return_when=asyncio.FIRST_COMPLETED)
        disconnect.cancel()
        if not work.done():  # the client left before the answer: _serve's finally aborts
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return Response(status_code=499)
        try:
            return work.result()
        except APIError as e:
            return e.response()

    async def _serve(self, body: dict, model: type[BaseModel], chat: bool) -> Response:
        prompt_field = "messages" if chat else "prompt"
        try:
            req = model.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            param = str(err["loc"][0]) if err["loc"] else None
            raise APIError(f"{param}: {err['msg']}", param) from None
        params, prompt_ids = await self.to_engine_input(req, chat, prompt_field)
        collector, streaming = Collector(), False
        self.engine.add(collector, prompt_ids, params)
        try:
            if (error := await collector.accepted) is not None:
                if not isinstance(error, ValueError):
                    raise APIError(f"the engine failed to add the request: {error!r}", None, 500)
                raise APIError(str(error), param_of(str(error), set(model.model_fields),
                                                    prompt_field))
            kind = "chat.completion" if chat else "text_completion"
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            head = {"id": rid, "object": kind, "created": int(time.time()),
                    "model": self.model_name}
            if req.stream:
                usage = req.stream_options is not None and req.stream_options.include_usage
                streaming = True  # from here the stream's end aborts (also if never started)
                return StreamingResponse(
                    self.stream(collector, head, chat, len(prompt_ids), usage),
                    media_type="text/event-stream",
                    background=BackgroundTask(self.engine.abort, collector))
            texts, num_tokens, last = [], 0, None
            while last is None or not last.finished:
                text, ids, last = await collector.get()
                texts.append(text)
                num_tokens += len(ids)
        finally:
            if not streaming:  # a no-op once finished; else the client is gone
                self.engine.abort(collector)
        choice = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason,
                  "stop_reason": last.stop_reason}
        choice.update({"message": {"role": "assistant", "content": "".join(texts)}} if chat else
                      {"text": "".join(texts), "prompt_logprobs": None})
        return JSONResponse({**head, "choices": [choice],
                             "usage": usage_of(len(prompt_ids), num_tokens)})

    async def read_body(self, request: Request) -> dict:
        """At most max_body_bytes, also without a Content-Length (a chunked upload)."""
        too_big = APIError(f"request body must be at most {self.max_body_bytes} bytes", None, 413)
        size = request.headers.get("content-length", "0")
        if not size.isdigit() or int(size) > self.max_body_bytes:
            raise too_big
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise too_big
        try:
            body = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(f"the body must be a JSON object, got {type(body).__name__}")
        return body

    async def to_engine_input(self, req: CompletionRequest, chat: bool,
                              prompt_field: str) -> tuple[SamplingParams, list[int]]:
        if req.model is not None and req.model != self.model_name:
            raise APIError(f"The model `{req.model}` does not exist.", "model", 404)
        for name, ok in (("logprobs", req.logprobs in (None, False)), ("echo", not req.echo),
                         ("repetition_penalty", req.repetition_penalty in (None, 1.0)),
                         ("presence_penalty", req.presence_penalty in (None, 0.0)),
                         ("frequency_penalty", req.frequency_penalty in (None, 0.0))):
            if not ok:
                raise APIError(f"{name} is not supported by nanoserve, got "
                               f"{getattr(req, name)!r}", name)
        prompt = req.messages if chat else req.prompt
        if not chat and isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(f"prompt must be one prompt (batches are not supported), got "
                               f"{len(prompt)}", "prompt")
            prompt = prompt[0]
        ids = await asyncio.get_running_loop().run_in_executor(
            self.tokenize_pool, self.tokenize, prompt, chat)
        max_tokens = req.max_completion_tokens if chat and req.max_tokens is None else \
            req.max_tokens
        if len(ids) >= self.max_model_len:
            raise APIError(f"{prompt_field} has {len(ids)} tokens: this model's maximum context "
                           f"length is {self.max_model_len} tokens", prompt_field)
        if max_tokens is not None and isinstance(max_tokens, int) and max_tokens >= 1 and \
                len(ids) + max_tokens > self.max_model_len:
            raise APIError(f"max_tokens is {max_tokens}, with the {len(ids)} prompt tokens more "
                           f"than this model's maximum context length ({self.max_model_len})",
                           "max_tokens")
        try:
            params = SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k, seed=req.seed,
                max_tokens=self.max_model_len - len(ids) if max_tokens is None else max_tokens,
                stop=req.stop, stop_token_ids=req.stop_token_ids or [], n=req.n,
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos, output_kind=RequestOutputKind.DELTA)
        except ValueError as e:
            raise APIError(str(e), param_of(str(e), set(type(req).model_fields),
                                            prompt_field)) from None
        return params, ids

    def tokenize(self, prompt: Any, chat: bool) -> list[int]:
        """On the tokenizer thread. Token ids pass through (the engine checks their range)."""
        if chat:
            messages = [chat_message(m) for m in prompt]
            try:
                return self.llm.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            except Exception as e:  # a template error: the messages do not fit it
                raise APIError(f"messages do not fit the chat template: {e}", "messages") from e
        return self.llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

    async def stream(self, collector: Collector, head: dict, chat: bool, num_prompt: int,
                     include_usage: bool):
        """Server-sent events as vLLM sends them; closing it (a disconnect) aborts."""
        num_tokens, kind = 0, head["object"] + ".chunk" if chat else head["object"]
        try:
            if chat:  # vLLM's first chat chunk: the role
                yield sse({**head, "object": kind, "choices": [{
                    "index": 0, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}]})
            while True:
                text, ids, last = await collector.get()
                num_tokens += len(ids)
                if text or ids or last.finished:
                    choice = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason,
                              "stop_reason": last.stop_reason}
                    choice.update({"delta": {"content": text}} if chat else {"text": text})
                    yield sse({**head, "object": kind, "choices": [choice]})
                if last.finished:
                    break
            if include_usage:  # vLLM's bench client reads usage only from a choice-less chunk
                yield sse({**head, "object": kind, "choices": [],
                           "usage": usage_of(num_prompt, num_tokens)})
            yield "data: [DONE]\n\n"
        finally:
            self.engine.abort(collector)


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class UvicornServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT/SIGTERM: uvicorn stops accepting and lets in-flight requests finish (then
        cancels them after --shutdown-timeout); unlike uvicorn's own, no re-raise: exit 0."""
        old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nanoserve serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="HF model directory (default: bundled)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY'")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    p.add_argument("--uvicorn-log-level", default="warning")
    p.add_argument("--reserved-cpus", type=int, default=0,
                   help="CPU cores left to the HTTP front end and clients, not the engine's "
                        "threads (default 0: the engine computes on every core; ignored if "
                        "OMP_NUM_THREADS is set)")
    for flag, kind in (("dtype", str), ("device", str), ("max-num-seqs", int),
                       ("max-num-batched-tokens", int), ("max-model-len", int),
                       ("block-size", int), ("num-kv-blocks", int),
                       ("kv-cache-memory-gib", float), ("long-prefill-token-threshold", int),
                       ("scheduling-policy", str), ("attention-backend", str), ("seed", int),
                       ("trace-file", str)):
        p.add_argument(f"--{flag}", type=kind, default=None)
    for flag in ("enable-prefix-caching", "enable-chunked-prefill"):
        p.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--enforce-eager", action="store_true", default=None)
    return p.parse_args(argv)


def engine_threads(reserved: int) -> int | None:
    """The engine's compute threads while serving: the cores less the reserved ones. vLLM's CPU
    serving keeps a core for its API process; here the front end is a thread that runs while
    the engine thread is inside a C call (the GIL is free there), and leaving a core idle for
    it measured slower (docs/serving.md), so by default nothing is reserved."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    cores = len(os.sched_getaffinity(0))
    if not 0 <= reserved < cores:
        sys.exit(f"nanoserve serve: --reserved-cpus must be in [0, {cores}), got {reserved}")
    return cores - reserved


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engine_flags = ("dtype", "device", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                    "block_size", "num_kv_blocks", "kv_cache_memory_gib",
                    "long_prefill_token_threshold", "scheduling_policy", "attention_backend",
                    "seed", "enable_prefix_caching", "enable_chunked_prefill",
                    "enforce_eager")
    config = {k: getattr(args, k) for k in engine_flags if getattr(args, k) is not None}
    num_threads = engine_threads(args.reserved_cpus)
    if num_threads is not None:  # before the CPU kernels' OpenMP starts (it reads the env)
        os.environ["OMP_NUM_THREADS"] = str(num_threads)

    def build() -> LLM:
        llm = LLM(args.model, **config)
        if args.trace_file is not None:  # every served step, for scripts/reader/trace_page.py
            llm.trace_to(args.trace_file, source="serve")
        return llm

    engine = EngineThread(build, num_threads)
    engine.ready.wait()
    if isinstance(engine.error, ValueError):
        sys.exit(f"nanoserve serve: {engine.error}")
    if engine.error is not None:
        raise engine.error
    name = args.served_model_name or args.model or MODEL_NAME
    server = Server(engine, name, args.api_key)
    llm = engine.llm
    print(f"nanoserve: serving {name} on http://{args.host}:{args.port}/v1 "
          f"(dtype {llm.config.dtype}, {llm.scheduler.block_manager.num_blocks} KV blocks)",
          file=sys.stderr, flush=True)
    UvicornServer(uvicorn.Config(server.app, host=args.host, port=args.port,
                                 log_level=args.uvicorn_log_level,
                                 timeout_graceful_shutdown=args.shutdown_timeout)).run()


def cli() -> None:
    """The `nanoserve` console script: `nanoserve serve [MODEL] [flags]`."""
    if len(sys.argv) < 2 or sys.argv[1] != "serve":
        sys.exit("usage: nanoserve serve [MODEL] [--port 8000] [engine flags] (see --help)")
    main(sys.argv[2:])


if __name__ == "__main__":
    main()
