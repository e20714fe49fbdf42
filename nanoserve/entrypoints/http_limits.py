"""Limits at the HTTP layer, below the app: uvicorn's httptools protocol (its C parser) with
bounds on what one connection may make the server keep or wait for. uvicorn has none of its own
for httptools: the URL and each header are appended to as they arrive (a 150 MB header grew the
server 300 MB, each append on the event loop), a connection that never finishes its headers is
kept forever, and as many connections are accepted as there are file descriptors.

- URL over max_url_bytes: 414. Request line and headers over max_header_bytes, or more than
  max_header_count headers: 431. Counted as bytes arrive, so no more than the limit and one
  read (at most 256 KiB) is ever kept.
- Headers not complete header_timeout seconds after the connection opened (or after the last
  response, on a kept-alive connection): 408 and close (just close if nothing came). A body
  not complete body_timeout seconds after its headers: 408 and close. (Slowloris.)
- At max_connections open, a new connection closes the one that has waited longest for its
  headers (408; just closed if it sent nothing): slow or idle clients make room for new ones,
  so a slowloris flood cannot lock others out. Only when every connection has a request in
  flight does the new one get a 503. The file descriptors are never exhausted.

Every refusal is a JSON error (the app's shape) with `connection: close`, and is not logged:
a flood must not become a flood of log lines. Bodies are bounded by the app (413)."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from nanoserve.entrypoints.protocol import APIError


@dataclass(frozen=True)
class HttpLimits:
    max_url_bytes: int = 8192  # 414 (nginx: 8 KiB)
    max_header_bytes: int = 65536  # 431 (the request line and all headers)
    max_header_count: int = 256  # 431 (vLLM's --h11-max-header-count)
    header_timeout: float = 10.0  # seconds to send the request line and headers: 408
    body_timeout: float = 30.0  # seconds to send the body after the headers: 408
    max_connections: int = 4096  # open at once; more: the oldest waiting for headers goes

    def protocol(self) -> type[HttpToolsProtocol]:
        """The protocol class for uvicorn.Config(http=...), with these limits."""
        return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,),
                    {"limits": self, "heads": OrderedDict()})


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits: HttpLimits
    heads: OrderedDict  # the server's connections waiting for headers, the longest first
    timer: asyncio.TimerHandle | None = None
    reading_head = False  # from the connection (or the last response) to the headers' end
    head_bytes = head_bytes_parsed = num_headers = 0
    refusal: tuple[int, str] | None = None  # what a parser callback refused the request for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            if not self.heads:  # every connection has a request in flight
                self.transport = transport  # (connection_lost closes it)
                self._refuse(503, f"more than {self.limits.max_connections} open connections")
                return
            oldest = next(iter(self.heads))
            oldest._timed_out(f"closed to make room: {self.limits.max_connections} open "
                              f"connections")
        super().connection_made(transport)
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """uvicorn's, less its log line per malformed request, with the head's bytes counted."""
        self._unset_keepalive_if_required()
        if self.reading_head:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            self._refuse(*(self.refusal or (400, "invalid HTTP request")))
            return
        if self.reading_head and self.head_bytes > self.limits.max_header_bytes:
            self._refuse(431, f"request line and headers over {self.limits.max_header_bytes} "
                              f"bytes")

    # -- the parser's callbacks ----------------------------------------------------------

    def on_url(self, url: bytes) -> None:
        if len(self.url) + len(url) > self.limits.max_url_bytes:
            self.refusal = (414, f"URL over {self.limits.max_url_bytes} bytes")
            raise ValueError(self.refusal[1])  # the parser stops: data_received refuses
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.num_headers += 1
        self.head_bytes_parsed += len(name) + len(value)
        if self.num_headers > self.limits.max_header_count:
            self.refusal = (431, f"more than {self.limits.max_header_count} headers")
            raise ValueError(self.refusal[1])
        if self.head_bytes_parsed > self.limits.max_header_bytes:  # within one read
            self.refusal = (431, f"headers over {self.limits.max_header_bytes} bytes")
            raise ValueError(self.refusal[1])
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.reading_head, self.head_bytes, self.num_headers, self.head_bytes_parsed = \
            False, 0, 0, 0
        self._arm(self.limits.body_timeout, f"request body not received in "
                                            f"{self.limits.body_timeout:g} s")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()
        self._maybe_start_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # (it may start a pipelined request)
        self._maybe_start_head()

    def _maybe_start_head(self) -> None:
        """Once a request was read and answered, the next one's head is awaited (kept-alive)."""
        if self.cycle.response_complete and not self.cycle.more_body and \
                not self.transport.is_closing():
            self._start_head()

    # -- timers and refusals -----------------------------------------------------------

    def _start_head(self) -> None:
        self.reading_head, self.head_bytes, self.head_bytes_parsed = True, 0, 0
        self._arm(self.limits.header_timeout, f"request headers not received in "
                                              f"{self.limits.header_timeout:g} s")
        self.heads[self] = None

    def _arm(self, seconds: float, why: str) -> None:
        self._disarm()
        self.timer = self.loop.call_later(seconds, self._timed_out, why)

    def _disarm(self) -> None:
        self.heads.pop(self, None)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _timed_out(self, why: str) -> None:
        if self.reading_head and self.head_bytes == 0:  # an idle connection: nothing to answer
            self._disarm()
            self.transport.close()
        else:
            self._refuse(408, why)

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` (unless a response already started) and close the connection."""
        self._disarm()
        if self.transport.is_closing():
            return
        if self.reading_head or self.cycle is None or not self.cycle.response_started:
            body = json.dumps({"error": {"message": message, "type": APIError.TYPES[status],
                                         "param": None, "code": status}}).encode()
            self.transport.write(b"".join([
                STATUS_LINE[status], b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]))
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's receive() now says http.disconnect
            self.cycle.message_event.set()
        self.transport.close()
