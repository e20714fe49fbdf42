"""Big request bodies checked in a helper process before the server parses them (issue 38).

The event loop and the engine thread share one process, so one GIL, and json.loads holds it for
as long as it runs. A 1.1 MB body of 110,000 stop strings took the event loop 9 ms (parse and
checks), a 1.3 MB prompt 3.4 ms; a burst of 4-8 such bodies held /health for 40-60 ms, and the
engine's step, which needs the GIL between its few hundred torch calls, waited at each of them.

So a body of BIG_BYTES or more goes first, as bytes through a pipe, to a helper: a plain Python
process (the checks of validation.py, no torch; at nice 19, so on a small CPU it runs when the
engine leaves a core) that parses it and runs, in the server's order, every check whose cost
grows with the body: the JSON (parse_json), the no-op fields, the caps on `stop`, the types
(pydantic), the prompt's length bound. A body it refuses gets its 400 (the same message and
param) and is never parsed by the server. One it accepts, a prompt that fits max_model_len, is
parsed and checked again by the server like any other (a few ms at most): the rules live once,
in validation.py, and the helper only answers the refusals sooner. The checks that cost nothing
(the model's name, the penalties, the ranges of SamplingParams) stay in the server, so a body
with two faults may be refused for the other one.

The helper ends when the server closes the pipe, or dies. Should the helper die first, the
server parses every body itself again (with a warning in its log); so it does with the bodies
of a flood past MAX_WAITING."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import struct
import sys
from pathlib import Path

from starlette.requests import ClientDisconnect, Request

from nanoserve.entrypoints.protocol import APIError
from nanoserve.entrypoints.validation import (
    CHAT,
    COMPLETION,
    DETOKENIZE,
    RESPONSES,
    TOKENIZE,
    Endpoint,
    check_prompt_length,
    check_request,
    parse_json,
)

BIG_BYTES = 1 << 16  # below it json.loads holds the GIL for at most ~0.3 ms
MAX_WAITING = 16  # bodies with or waiting for the helper; more are parsed by the server itself
# a request frame names its endpoint by its index here
ENDPOINTS = (COMPLETION, CHAT, TOKENIZE, DETOKENIZE, RESPONSES)
REQUEST, VERDICT = struct.Struct("!BI"), struct.Struct("!I")  # the frames' heads
log = logging.getLogger("nanoserve")

# The helper's interpreter imports nanoserve.entrypoints (this module, validation and protocol:
# pydantic, no torch) through a stand-in for the `nanoserve` package, whose own __init__ would
# import the engine and torch.
BOOT = ("import sys, types; package = types.ModuleType('nanoserve'); "
        "package.__path__ = [sys.argv[1]]; sys.modules['nanoserve'] = package; "
        "from nanoserve.entrypoints.body_checker import main; main()")


class BodyChecker:
    """The server's side: start(), then read() (refusal() for each big body), then close()."""

    def __init__(self, longest_token: int, max_model_len: int) -> None:
        self.args = (str(longest_token), str(max_model_len))
        self.max_body_bytes = (1 << 20) + 32 * max_model_len  # text or token ids
        self.proc: asyncio.subprocess.Process | None = None
        self.lock = asyncio.Lock()  # one body in the pipe at a time: frames never interleave
        self.waiting = 0

    async def start(self) -> None:
        package = Path(__file__).resolve().parents[1]
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", BOOT, str(package), *self.args,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        except OSError as e:
            log.warning("nanoserve: no body checker (%r); the server parses big bodies itself", e)

    async def read(self, request: Request, endpoint: Endpoint) -> dict:
        """A request's body, at most max_body_bytes (413), also without a Content-Length (a
        chunked upload), parsed; a big one only if refusal() finds nothing to refuse."""
        too_big = APIError(f"request body must be at most {self.max_body_bytes} bytes", None, 413)
        size = request.headers.get("content-length", "0")
        if not size.isdigit() or int(size) > self.max_body_bytes:
            raise too_big
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                chunks.append(chunk)
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise too_big
        except ClientDisconnect:  # gone before its body was read: nobody to answer, no log
            raise APIError("the client disconnected", None, 499) from None
        raw = b"".join(chunks)
        if len(raw) >= BIG_BYTES and (refusal := await self.refusal(raw, endpoint)) is not None:
            raise refusal
        return parse_json(raw)

    async def refusal(self, raw: bytes, endpoint: Endpoint) -> APIError | None:
        """The helper's 400 for this body, or None: accepted, or not asked. At nice 19 the
        helper is slow while the engine is busy; past MAX_WAITING bodies a flood is not queued
        for it (their memory held, legitimate big bodies starved) but parsed as before."""
        if self.waiting >= MAX_WAITING:
            return None
        self.waiting += 1
        try:  # shielded: a handler cancelled mid-exchange must not leave half a frame behind
            return await asyncio.shield(self._exchange(raw, ENDPOINTS.index(endpoint)))
        finally:
            self.waiting -= 1

    async def _exchange(self, raw: bytes, index: int) -> APIError | None:
        async with self.lock:
            if self.proc is None:
                return None
            try:
                self.proc.stdin.write(REQUEST.pack(index, len(raw)))
                self.proc.stdin.write(raw)
                await self.proc.stdin.drain()
                (size,) = VERDICT.unpack(await self.proc.stdout.readexactly(VERDICT.size))
                verdict = await self.proc.stdout.readexactly(size)
            except (OSError, RuntimeError, asyncio.IncompleteReadError) as e:  # (uvloop: a
                # closed pipe's write is a RuntimeError)
                log.warning("nanoserve: the body checker is gone (%r); the server parses "
                            "big bodies itself", e)
                await self.close()
                return None
        if not verdict:
            return None
        error = json.loads(verdict)
        return APIError(error["message"], error["param"], error["code"])

    async def close(self) -> None:
        """Close the pipe: the helper ends. Killed if it has not within 5 s."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except asyncio.TimeoutError:  # (TimeoutError itself only from Python 3.11)
            proc.kill()
            await proc.wait()


def first_refusal(raw: bytes, endpoint: Endpoint, longest: int,
                  max_model_len: int) -> APIError | None:
    """What the server would refuse the body for, of the checks that grow with it."""
    try:
        req = check_request(parse_json(raw), endpoint)
        for prompt in endpoint.prompts_of(req):
            check_prompt_length(endpoint, endpoint.num_chars(prompt), longest, max_model_len)
    except APIError as e:
        return e
    except Exception:  # not ours to answer: the server's own checks will
        return None
    return None


def main() -> None:
    """The helper: request frames in on stdin, verdicts out on stdout, until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    with contextlib.suppress(OSError):
        os.nice(19)
    longest, max_model_len = int(sys.argv[2]), int(sys.argv[3])
    requests, verdicts = sys.stdin.buffer, sys.stdout.buffer
    while len(head := requests.read(REQUEST.size)) == REQUEST.size:
        index, size = REQUEST.unpack(head)
        refusal = first_refusal(requests.read(size), ENDPOINTS[index], longest, max_model_len)
        verdict = b"" if refusal is None else json.dumps(
            {"message": refusal.message, "param": refusal.param, "code": refusal.code}).encode()
        verdicts.write(VERDICT.pack(len(verdict)) + verdict)
        verdicts.flush()
