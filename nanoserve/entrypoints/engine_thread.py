"""§4's loop while serving: one engine thread owns the `LLM` and runs "receive, schedule, forward,
process, repeat"; between two `step()`s it takes the adds and aborts that the asyncio front end
put in its inbox (a thread-safe queue), and when nothing is left it blocks on that inbox (never
spins). Each step's outputs (DELTAs, detokenized on the engine thread) go back to the event loop
with one `call_soon_threadsafe`; there a per-request `Collector` keeps them until its handler
reads, so a slow client never stalls the loop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.workers import WorkerDied
from nanoserve.entrypoints.metrics import Metrics
from nanoserve.entrypoints.outputs import RequestOutput
from nanoserve.entrypoints.protocol import ShuttingDown


class Collector:
    """One request's outputs, kept on the event loop until its handler reads them."""

    def __init__(self, ready: asyncio.Event | None = None) -> None:
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.ready = ready or asyncio.Event()  # shared by a batch's prompts (serving_engine.py)
        self.outputs: list[RequestOutput] = []
        self.request_id: str | None = None  # the engine's id: read and written there only

    def put(self, output: RequestOutput) -> None:
        self.outputs.append(output)
        self.ready.set()

    def take(self) -> list[RequestOutput]:
        """Every output since the last take() (the handler waits on `ready` first)."""
        outputs, self.outputs = self.outputs, []
        return outputs


class EngineThread:
    """The loop on its own thread, which also builds the LLM (`build`): the only thread that
    touches it. The step's OpenMP threads then spin between parallel regions: each thread that
    ever runs one keeps its own OpenMP team, and with more team threads than cores libgomp's
    idle threads sleep at once instead of spinning, so every region waits for their wake-up
    (docs/serving.md)."""

    def __init__(self, build: Callable[[], LLM], num_threads: int | None = None) -> None:
        self.build, self.num_threads = build, num_threads
        self.llm: LLM | None = None
        self.error: BaseException | None = None  # what building the LLM raised
        self.fatal: WorkerDied | None = None  # what ended serving
        self.ready = threading.Event()  # set once the LLM exists, or failed to
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, before any request
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.live: dict[str, Collector] = {}  # request_id -> its collector
        self.expired = False  # past --shutdown-timeout: what runs is aborted, no add accepted
        self.num_expired = 0  # requests that expire() cut off, or refused after it
        self.thread = threading.Thread(target=self.run, name="nanoserve-engine", daemon=True)
        self.thread.start()

    def add(self, collector: Collector, prompt: list[int], params: SamplingParams,
            priority: int = 0) -> None:
        self.inbox.put(("add", collector, prompt, params, priority))

    def abort(self, collector: Collector) -> None:
        self.inbox.put(("abort", collector))

    def expire(self) -> None:
        """Shutdown's timeout passed: abort every request (each handler then answers 503, or
        ends its stream with an error event) and refuse any add from now on."""
        self.expired = True  # (read by the handlers; set before the engine sees the item)
        self.inbox.put(("expire", None))

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
            if kind == "expire":
                self.num_expired += len(self.live)
                for request_id in list(self.live):
                    self.llm.abort(request_id)
                continue
            if self.expired:  # cut off too (a beam search's next round)
                self.num_expired += 1
                self._to_loop(_resolve, collector.accepted, ShuttingDown("the server is "
                                                                         "shutting down"))
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
            # What exists now (modules, the model, the tokenizer) lives to the end: out of the
            # garbage collector's sight (vLLM's freeze_gc_heap), or every so many requests a
            # full collection walks it all while the whole process waits (docs/serving.md).
            gc.collect()
            gc.freeze()
        except BaseException as e:  # ValueError: a bad flag; main() exits with it
            self.error = e
            return
        finally:
            self.ready.set()
        try:
            self._serve()
        finally:
            gc.unfreeze()  # in-process (tests): the LLM is collectable again once dropped

    def _serve(self) -> None:
        while self.fatal is None and self._receive(block=not self.llm.has_unfinished_requests()):
            self._step()
        if self.fatal is not None:
            return
        for request_id in list(self.live):  # shutdown: what is left is aborted
            self.llm.abort(request_id)
        while self.llm.has_unfinished_requests():
            self._step()

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except WorkerDied as e:  # a tensor-parallel rank is gone: end every request, then exit
            print(f"nanoserve: {e}", file=sys.stderr, flush=True)
            self.fatal = e
            for request_id in list(self.live):
                self.llm.abort(request_id)
            outputs, self.llm._pending = self.llm._pending, []  # (no step can return them)
            os.kill(os.getpid(), signal.SIGTERM)  # the server shuts down, main() exits 1
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
