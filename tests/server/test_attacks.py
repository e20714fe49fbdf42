"""The server under attack at the HTTP layer (nanoserve/entrypoints/http_limits.py), on raw
sockets to 127.0.0.1: huge URLs and headers (414, 431, memory kept bounded), slowloris (partial
headers or bodies closed after their timeout), a flood of connections (the oldest waiting ones
closed to make room, a 503 only when all are busy; the server still serving), clients that
leave before their body is read (no log lines). Its own server, with short timeouts and a small
connection cap, so that each test takes seconds."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.common.tiny_model import tiny_model_dir
from tests.server.harness import MAX_MODEL_LEN, TINY_FLAGS, ServerProcess

MAX_CONNECTIONS, TIMEOUT = 48, 1.0
FLAGS = [*TINY_FLAGS, "--max-connections", str(MAX_CONNECTIONS), "--header-timeout",
         str(TIMEOUT), "--body-timeout", str(TIMEOUT), "--max-header-bytes", "16384",
         "--max-url-bytes", "4096", "--max-header-count", "64"]
GOOD = b'{"model": "m", "prompt": [5, 6, 7], "max_tokens": 2}'


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(tiny_model_dir(MAX_MODEL_LEN), FLAGS)
    yield s
    s.stop()


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def send_until_refused(sock: socket.socket, head: bytes, filler: bytes, max_bytes: int) -> bytes:
    """Send `head`, then `filler` until the server answers or `max_bytes` went; the answer."""
    sent = 0
    try:
        sock.sendall(head)
        sock.settimeout(0.001)
        while sent < max_bytes:
            sock.sendall(filler)
            sent += len(filler)
            try:
                if answer := sock.recv(65536):
                    return answer
            except (TimeoutError, BlockingIOError):
                pass
    except (BrokenPipeError, ConnectionResetError):
        pass
    sock.settimeout(5)
    try:
        return sock.recv(65536)
    except (ConnectionResetError, TimeoutError):
        return b""


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def healthy(server) -> None:
    r = httpx.post(server.base + "/v1/completions", content=GOOD, timeout=10)
    assert r.status_code == 200 and httpx.get(server.base + "/health").status_code == 200


@pytest.mark.parametrize("head, filler, code", [
    (b"GET /", b"a" * 65536, 414),
    (b"GET / HTTP/1.1\r\nhost: x\r\nx-big: ", b"a" * 65536, 431),
    (b"GET / HTTP/1.1\r\n", b"x-h: 1\r\n" * 64, 431),
], ids=["url", "header-value", "many-headers"])
def test_huge_url_and_headers_are_refused_keeping_memory_bounded(server, head, filler, code):
    rss = server.rss_mib()
    with connect(server) as sock:
        answer = send_until_refused(sock, head, filler, 64 << 20)
    assert status(answer) == code, answer[:200]
    assert answer.endswith(b"}") and b'"code": %d' % code in answer  # the JSON error
    assert server.rss_mib() - rss < 32
    healthy(server)


def test_slowloris_partial_heads_and_bodies_are_closed_after_the_timeout(server):
    socks = [connect(server) for _ in range(MAX_CONNECTIONS // 2)]
    for i, sock in enumerate(socks):
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" if i % 2 else
                     b"POST /v1/completions HTTP/1.1\r\ncontent-length: 100\r\n\r\n{")
    healthy(server)  # meanwhile, others are served
    start = time.monotonic()
    for sock in socks:
        sock.settimeout(max(0.1, start + 3 * TIMEOUT - time.monotonic()))
        assert status(sock.recv(65536)) == 408  # then closed:
        assert sock.recv(65536) == b""
        sock.close()
    assert time.monotonic() - start < 3 * TIMEOUT


def test_a_flood_of_connections_closes_the_oldest_waiting_ones_then_gets_503s(server):
    """At the cap a new connection closes the one that waited longest for its headers (so
    slowloris cannot lock others out); only when all have requests in flight is it a 503."""
    idle = [connect(server) for _ in range(MAX_CONNECTIONS)]
    time.sleep(0.2)  # all accepted
    new = [connect(server) for _ in range(10)]
    for sock in idle[:10]:  # the 10 oldest made room (they sent nothing: just closed)
        sock.settimeout(5)
        assert sock.recv(65536) == b""
    healthy(server)  # a new client is served at the cap (closing one more idle connection)
    for sock in idle[10:] + new:
        sock.close()
    time.sleep(0.2)
    busy = [connect(server) for _ in range(MAX_CONNECTIONS)]  # each mid-body: in flight
    for sock in busy:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\ncontent-length: 100\r\n\r\n{")
    time.sleep(0.2)
    for _ in range(5):
        with connect(server) as sock:
            sock.settimeout(5)
            assert status(sock.recv(65536)) == 503
    for sock in busy:  # then the body timeout frees them
        sock.settimeout(3 * TIMEOUT)
        assert status(sock.recv(65536)) == 408
        sock.close()
    healthy(server)


def test_clients_that_leave_before_their_body_is_read_are_not_logged(server):
    before = len(server.log())
    for i in range(100):
        with connect(server) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n"
                         b"content-type: application/json\r\n\r\n" + GOOD[:i % len(GOOD)])
    for _ in range(20):  # no garbage from 100 connections
        sock = connect(server)
        sock.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
        assert status(sock.recv(65536)) == 400
        sock.close()
    healthy(server)
    time.sleep(0.5)
    assert len(server.log()) - before < 500, server.log()[before:][:2000]


def test_a_keep_alive_connection_serves_requests_then_times_out(server):
    with httpx.Client(base_url=server.base, timeout=10) as client:
        for _ in range(3):
            assert client.post("/v1/completions", content=GOOD).status_code == 200
    with connect(server) as sock:
        request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
                   % len(GOOD) + GOOD)
        sock.sendall(request + request)  # two pipelined
        sock.settimeout(10)
        got = b""
        while got.count(b"total_tokens") < 2:  # both answers, bodies included
            got += sock.recv(65536)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # a third, never finished
        assert got.count(b"HTTP/1.1 200") == 2 and status(sock.recv(65536)) == 408
