"""§3–§4 served: an OpenAI-compatible HTTP server on the chapter's loop ("receive, schedule,
forward, process, repeat"), with requests that really arrive while others run; the layout is
vLLM's entrypoints/openai: this file (the app), cli_args.py (the flags), protocol.py (the wire)
and validation.py (its checks), one serving class per endpoint (serving_completion.py,
serving_chat.py, serving_responses.py, sharing serving_engine.py and choices.py;
serving_tokenization.py), the engine thread that owns the `LLM` (engine_thread.py), the uvicorn
server and its shutdown (launcher.py), the HTTP layer's limits (http_limits.py), and the helper
process that checks big bodies first (body_checker.py).

    python -m nanoserve.serve [MODEL] --port 8000      (or: nanoserve serve [MODEL] ...)

Endpoints and fields are vLLM's: /v1/completions, /v1/chat/completions, /v1/responses,
/v1/models, /tokenize, /detokenize, /health, /version, /metrics (Prometheus, vLLM's metric
names as `nanoserve:`). Errors are {"error": {"message", "type", "param", "code"}}: 400 for a
bad value (param names the field), 404 for an unknown model, 401 without the --api-key. Prompts
are tokenized on tokenizer threads; the event loop only parses and writes JSON, and a body of 64
KiB or more only once the helper found nothing to refuse in it. Unknown fields are ignored, as in
vLLM; fields nanoserve cannot honour are a 400 (validation.py)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import sys
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import version

import prometheus_client as prom
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from nanoserve import LLM
from nanoserve.entrypoints.body_checker import BodyChecker
from nanoserve.entrypoints.bundled import MODEL_NAME
from nanoserve.entrypoints.cli_args import (
    ServingOptions,
    chat_template,
    engine_config,
    engine_threads,
    http_limits,
    log_stats_interval,
    parse_args,
    serving_options,
)
from nanoserve.entrypoints.engine_thread import EngineThread
from nanoserve.entrypoints.launcher import (
    UvicornServer,
    address,
    request_id_headers,
    uvicorn_config,
)
from nanoserve.entrypoints.metrics import LoggingStatLogger
from nanoserve.entrypoints.protocol import APIError
from nanoserve.entrypoints.serving_chat import OpenAIServingChat
from nanoserve.entrypoints.serving_completion import OpenAIServingCompletion
from nanoserve.entrypoints.serving_responses import OpenAIServingResponses
from nanoserve.entrypoints.serving_tokenization import OpenAIServingTokenization
from nanoserve.entrypoints.tokenizer_pool import TokenizerPool
from nanoserve.entrypoints.validation import (
    CHAT,
    COMPLETION,
    DETOKENIZE,
    RESPONSES,
    TOKENIZE,
    Endpoint,
    longest_token,
)


class Server:
    def __init__(self, engine: EngineThread, model_names: list[str],
                 api_keys: list[str] | None = None, options: ServingOptions | None = None,
                 log_stats_interval: float | None = 10.0, fastapi_docs: bool = True) -> None:
        self.engine, self.llm = engine, engine.llm  # the front end reads its config, tokenizer
        self.model_names = model_names  # --served-model-name: answers carry the first
        self.api_keys = [key.encode() for key in api_keys or []]
        self.draining = False  # shutting down: new requests get a 503
        self.log_stats_interval = log_stats_interval  # vLLM's stat line (None: none)
        self.max_model_len = self.llm.config.max_model_len
        self.tokenizers = TokenizerPool(self.llm.tokenizer)
        longest = longest_token(self.llm.tokenizer)
        serving = (engine, model_names, self.tokenizers, longest, options)
        self.completion = OpenAIServingCompletion(*serving)
        self.chat = OpenAIServingChat(*serving)
        self.responses = OpenAIServingResponses(*serving)
        self.tokenization = OpenAIServingTokenization(
            model_names, self.tokenizers, self.max_model_len, len(self.llm.tokenizer),
            options.default_chat_template_kwargs if options else None)
        self.bodies = BodyChecker(longest, self.max_model_len)
        docs = {} if fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
        self.app = FastAPI(lifespan=self.lifespan, **docs)
        self.app.get("/health")(self.health)
        self.app.get("/metrics")(self.metrics)
        self.app.get("/version")(lambda: {"version": version("nanoserve")})  # vLLM's, ours
        self.app.get("/v1/models")(self.models)
        for path, endpoint, answer in (("/v1/completions", COMPLETION, self.completion.create),
                                       ("/v1/chat/completions", CHAT, self.chat.create),
                                       ("/v1/responses", RESPONSES, self.responses.create),
                                       ("/tokenize", TOKENIZE, self.tokenization.tokenize),
                                       ("/detokenize", DETOKENIZE, self.tokenization.detokenize)):
            self.app.post(path)(self.route(endpoint, answer))

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        self.engine.loop = asyncio.get_running_loop()
        await self.bodies.start()
        logger = None if self.log_stats_interval is None else asyncio.create_task(
            LoggingStatLogger(self.engine.metrics, self.log_stats_interval).run())
        yield
        if logger is not None:
            logger.cancel()
        self.engine.stop()  # after uvicorn finished (or cancelled) the in-flight requests
        self.tokenizers.shutdown()
        await self.bodies.close()

    def authorize(self, request: Request) -> None:
        """In constant time: how long the comparisons take says nothing of the keys (each is
        compared, whichever matches)."""
        if not self.api_keys:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given = given.encode("utf-8", "surrogateescape")
        matches = sum(hmac.compare_digest(given, key) for key in self.api_keys)
        if scheme.lower() != "bearer" or not matches:  # the scheme in any case (RFC 7235)
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
            "id": name, "object": "model", "created": int(time.time()),
            "owned_by": "nanoserve", "root": self.llm.model_dir, "parent": None,
            "max_model_len": self.max_model_len} for name in self.model_names]})

    def route(self, endpoint: Endpoint, answer: Callable[[dict], Awaitable[Response]]):
        async def handler(request: Request) -> Response:
            return await self.serve(request, endpoint, answer)
        return handler

    async def serve(self, request: Request, endpoint: Endpoint,
                    answer: Callable[[dict], Awaitable[Response]]) -> Response:
        """Read the body, let `answer` answer; a disconnect before the answer aborts it."""
        try:
            if self.draining:
                raise APIError("the server is shutting down", None, 503)
            self.authorize(request)
            body = await self.bodies.read(request, endpoint)
            if endpoint in (COMPLETION, CHAT) and "x-request-id" in request.headers:
                body["request_id"] = request.headers["x-request-id"]  # vLLM's: over the body's
        except APIError as e:
            return e.response()
        work = asyncio.ensure_future(answer(body))
        disconnect = asyncio.ensure_future(_disconnected(request))  # the body is read: safe
        await asyncio.wait((work, disconnect), return_when=asyncio.FIRST_COMPLETED)
        disconnect.cancel()
        if not work.done():  # the client left before the answer: create()'s finally aborts
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return Response(status_code=499)
        try:
            return work.result()
        except APIError as e:
            return e.response()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = engine_config(args)
    interval = None if args.disable_log_stats else log_stats_interval()
    num_threads = engine_threads(args.reserved_cpus)
    if num_threads is not None:  # before the CPU kernels' OpenMP starts (it reads the env)
        os.environ["OMP_NUM_THREADS"] = str(num_threads)

    def build() -> LLM:
        llm = LLM(args.model, tokenizer=args.tokenizer, generation_config=args.generation_config,
                  override_generation_config=args.override_generation_config, **config)
        if args.trace_file is not None:  # every served step, for scripts/reader/trace_page.py
            llm.trace_to(args.trace_file, source="serve")
        return llm

    engine = EngineThread(build, num_threads)
    engine.ready.wait()
    if isinstance(engine.error, (ValueError, FileNotFoundError)):  # a model folder without one
        sys.exit(f"nanoserve serve: {engine.error}")
    if engine.error is not None:
        raise engine.error
    names = args.served_model_name or [args.model or MODEL_NAME]
    llm = engine.llm
    try:  # before the tokenizer threads copy the tokenizer
        if args.chat_template is not None:
            llm.tokenizer.chat_template = chat_template(args.chat_template, llm.tokenizer)
    except ValueError as e:
        engine.stop()
        llm.shutdown()  # tensor parallel: the other ranks
        sys.exit(f"nanoserve serve: {e}")
    options = serving_options(args, llm.sampling_defaults)
    server = Server(engine, names, args.api_key, options, interval,
                    fastapi_docs=not args.disable_fastapi_docs)
    if args.allowed_origins:  # vLLM's CORS flags; none by default (docs/serving.md: why)
        server.app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                                  allow_credentials=args.allow_credentials,
                                  allow_methods=args.allowed_methods,
                                  allow_headers=args.allowed_headers)
    print(f"nanoserve: serving {', '.join(names)} on {address(args)} "
          f"(dtype {llm.config.dtype}, {llm.scheduler.block_manager.num_blocks} KV blocks)",
          file=sys.stderr, flush=True)
    app = request_id_headers(server.app) if args.enable_request_id_headers else server.app
    config = uvicorn_config(app, args, http_limits(args).protocol())
    UvicornServer(config, server, args.shutdown_timeout).run()
    llm.shutdown()  # tensor parallel: the other ranks
    if engine.fatal is not None:
        sys.exit(f"nanoserve serve: {engine.fatal}")
    if engine.num_expired:
        sys.exit(f"nanoserve serve: {engine.num_expired} request(s) cut off when "
                 f"--shutdown-timeout ({args.shutdown_timeout:g} s) passed")


def cli() -> None:
    """The `nanoserve` console script: `nanoserve serve [MODEL] [flags]`."""
    if len(sys.argv) < 2 or sys.argv[1] != "serve":
        sys.exit("usage: nanoserve serve [MODEL] [--port 8000] [engine flags] (see --help)")
    main(sys.argv[2:])


if __name__ == "__main__":
    main()
