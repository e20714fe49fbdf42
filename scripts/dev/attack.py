"""Issue 38's attacks, re-run: each case of its "Measured" 1-7 against a real server on
127.0.0.1, and what it gets now: the attacker's status, the server's RSS growth, /health's
latency while it runs, and a victim's (a streaming greedy request with the key) inter-token gap
and latency beside it. Every loop is bounded in count and time; traffic goes to 127.0.0.1 only.

    flock /tmp/nanoserve-bench.lock .venv/bin/python scripts/dev/attack.py [--quick] [--case 3.]

It starts `python -m nanoserve.serve --dtype float32 --max-num-seqs 8 --api-key KEY` (the
bundled model) itself, and prints a Markdown table (docs/serving.md)."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.server.harness import ServerProcess  # noqa: E402

KEY = "sesame"
AUTH = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
FLAGS = ["--dtype", "float32", "--max-num-seqs", "8", "--api-key", KEY]


class Probe:
    """While an attack runs: the server's RSS, /health's latency, a victim's token gaps."""

    def __init__(self, server: ServerProcess) -> None:
        self.server, self.stop, self.done = server, threading.Event(), threading.Event()
        self.rss, self.health, self.gaps, self.latency = [], [], [], None

    def __enter__(self) -> Probe:
        self.rss0 = self.server.rss_mib()
        self.threads = [threading.Thread(target=f, daemon=True) for f in
                        (self._rss, self._health, self._victim)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _rss(self) -> None:
        while not self.stop.wait(0.05):
            self.rss.append(self.server.rss_mib())

    def _health(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.stop.wait(0.05):
                start = time.perf_counter()
                try:
                    c.get(self.server.base + "/health")
                except httpx.TransportError:
                    pass
                self.health.append(1000 * (time.perf_counter() - start))

    def _victim(self) -> None:
        time.sleep(0.3)  # the attack is under way
        body = {"model": "m", "prompt": "The three primary colors are", "max_tokens": 96,
                "temperature": 0, "ignore_eos": True, "stream": True}
        start = last = time.perf_counter()
        try:
            with httpx.stream("POST", self.server.base + "/v1/completions", json=body,
                              headers=AUTH, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        self.gaps.append(1000 * (now - last))
                        last = now
            self.latency = 1000 * (time.perf_counter() - start)
        finally:
            self.done.set()

    def row(self, case: str, result: str) -> dict:
        h, g = sorted(self.health) or [0.0], self.gaps[1:] or [0.0]  # gaps after the first
        return {"case": case, "result": result,
                "rss_growth_mib": round(max(self.rss, default=self.rss0) - self.rss0, 1),
                "health_p50_ms": round(statistics.median(h), 1),
                "health_p99_ms": round(h[min(len(h) - 1, int(0.99 * len(h)))], 1),
                "health_max_ms": round(h[-1], 1), "health_polls": len(self.health),
                "victim_gap_p50_ms": round(statistics.median(g), 1),
                "victim_gap_max_ms": round(max(g), 1),
                "victim_latency_ms": round(self.latency or -1, 0)}


def raw(server, head: bytes, filler: bytes, max_bytes: int) -> str:
    """Send head, then filler until answered or max_bytes; the status line's code."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        sent, answer = 0, b""
        try:
            s.sendall(head)
            s.settimeout(0.001)
            while sent < max_bytes and not answer:
                s.sendall(filler)
                sent += len(filler)
                try:
                    answer = s.recv(4096)
                except (TimeoutError, BlockingIOError):
                    pass
            s.settimeout(10)
            answer = answer or s.recv(4096)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass
    code = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1") else "none"
    return f"{code} after {sent / 2**20:.2f} MiB sent"


# One client, its connections kept alive, for every attack: a new httpx.Client costs ~18 ms of
# CPU (its TLS context), and the attacker shares the server's two cores, so a flood that built
# one per request measured mostly the attacker. A real one reuses connections and bytes.
CLIENT = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=16))


def post(server, body: dict | bytes, path: str = "/v1/completions") -> int:
    """(A large body is passed as bytes, serialized once: the client shares the CPU.)"""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return CLIENT.post(server.base + path, content=content, headers=AUTH).status_code


def slowloris(server, n: int, wait: float) -> str:
    """n connections that never finish their headers; how many the server still holds."""
    socks, answers = [], {"408": 0, "503": 0, "closed": 0, "open": 0}
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        socks.append(s)
    time.sleep(wait)
    for s in socks:
        s.settimeout(0.01)
        try:
            got = s.recv(4096)
            answers[got[9:12].decode() if got.startswith(b"HTTP/1.1 ") else "closed"] += 1
        except (TimeoutError, BlockingIOError):
            answers["open"] += 1
        except ConnectionResetError:
            answers["closed"] += 1
        s.close()
    return f"after {wait:g} s: {answers['open']} of {n} still open, " + ", ".join(
        f"{v} {k}" for k, v in answers.items() if v and k != "open")


def concurrently(n: int, fn) -> list:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: fn(), range(n)))


def paced(period: float, attack):
    """The attack, then a wait to fill `period` seconds (none if it took longer). The floods of
    big bodies repeat at this rate for as long as the victim runs: a fixed pace, so that a
    server that answers faster meets the same attack (back-to-back, it would meet more)."""
    def one_round():
        start = time.perf_counter()
        result = attack()
        time.sleep(max(0.0, start + period - time.perf_counter()))
        return result
    return one_round


def cases(server, quick: bool, period: float) -> list[tuple[str, object, int]]:
    """(name, attack, at most how many times it repeats while the victim runs)."""
    # 1.29 MB of UTF-8 (1.06 M characters, under the body limit); 660,000 characters (under
    # max_model_len x the longest token: tokenized); 110,000 stop strings (1.1 MB)
    long_text = json.dumps({"prompt": "hello world phở 🍜 " * 56000, "max_tokens": 1},
                           ensure_ascii=False).encode()
    fits = json.dumps({"prompt": "hello world " * 55000, "max_tokens": 1}).encode()
    stops = json.dumps({"prompt": "hi", "stop": [f"s{i}" for i in range(110000)]}).encode()
    mib, chat = (8 if quick else 64), "/v1/chat/completions"
    tool_call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    return [
        ("1. 1 KB headers on one connection", lambda: raw(
            server, b"GET /health HTTP/1.1\r\n", b"x-h: " + b"a" * 1019 + b"\r\n", mib << 20),
         200),
        ("1. a huge URL", lambda: raw(server, b"GET /", b"a" * 65536, mib << 20), 200),
        ("1. a huge header value", lambda: raw(
            server, b"GET /health HTTP/1.1\r\nx-big: ", b"a" * 65536, mib << 20), 200),
        ("2. slowloris: 500 partial requests", lambda: slowloris(server, 500, 12), 1),
        ("2. slowloris: 5,000 partial requests", lambda: slowloris(server, 5000, 12), 1),
        ("3. 4 requests with 110,000 stop strings", paced(period, lambda: concurrently(
            4, lambda: post(server, stops))), 1000),
        ("3. 8 concurrent 1.3 MB prompts", paced(period, lambda: concurrently(
            8, lambda: post(server, long_text))), 1000),
        ("3. 8 concurrent 660,000-character prompts", lambda: concurrently(
            8, lambda: post(server, fits)), 1),
        ("4. JSON nested 100,000 deep", lambda: post(
            server, b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"), 200),
        ("4. a lone surrogate in prompt / model", lambda: [
            post(server, b'{"prompt": "a\\ud800"}'),
            post(server, b'{"model": "\\ud800", "prompt": "a"}')], 200),
        ("5. logit_bias, min_tokens, response_format, tools", lambda: [
            post(server, {"prompt": "a", "logit_bias": {"5": 100}}),
            post(server, {"prompt": "a", "min_tokens": 5}),
            post(server, {"prompt": "a", "response_format": {"type": "json_object"}}),
            post(server, {"messages": [{"role": "user", "content": "a"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]}, chat)],
         200),
        ('5. max_tokens true, "3"; temperature true; prompt [true], [1.0, 2.0]', lambda: [
            post(server, {"prompt": "a", "max_tokens": True}),
            post(server, {"prompt": "a", "max_tokens": "3"}),
            post(server, {"prompt": "a", "temperature": True}),
            post(server, {"prompt": [True]}), post(server, {"prompt": [1.0, 2.0]})], 200),
        ("5. logprobs 0 (a logprob given?); assistant content null + tool_calls", lambda: [
            httpx.post(server.base + "/v1/completions", headers=AUTH, timeout=60, json={
                "prompt": "a", "max_tokens": 2, "logprobs": 0}).json()["choices"][0][
                "logprobs"]["token_logprobs"] is not None,
            post(server, {"max_tokens": 2, "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                {"role": "tool", "tool_call_id": "c", "content": "1"}]}, chat)], 1),
        ("7. 500 clients gone before their body is read", lambda: disconnects(server, 500), 1),
    ]


def disconnects(server, n: int) -> str:
    before = len(server.log())
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
                      + KEY.encode() + b"\r\ncontent-length: 5000\r\n\r\n{\"pro")
    time.sleep(1)
    return f"{len(server.log()) - before} bytes of log"


def shutdown(model: str) -> str:
    """6: 8 running streams, 4 queued, 2 non-streaming; SIGTERM with --shutdown-timeout 2."""
    s = ServerProcess(model, [*FLAGS, "--shutdown-timeout", "2"])
    ends, statuses = [], []
    body = {"prompt": "a", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}

    def stream() -> None:
        lines = []
        try:
            with httpx.stream("POST", s.base + "/v1/completions", headers=AUTH, timeout=60,
                              json={**body, "stream": True}) as r:
                lines = [x for x in r.iter_lines() if x]
            ends.append("error+[DONE]" if lines[-1] == "data: [DONE]" and '"error"' in
                        lines[-2] else lines[-1][:40])
        except httpx.HTTPError as e:
            ends.append(type(e).__name__)

    def whole() -> None:
        statuses.append(httpx.post(s.base + "/v1/completions", headers=AUTH, json=body,
                                   timeout=60).status_code)

    threads = [threading.Thread(target=stream) for _ in range(12)] + \
        [threading.Thread(target=whole) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(3)
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    code = s.proc.wait(60)
    s.stop()
    return (f"streams: {ends.count('error+[DONE]')}/12 error+[DONE]; non-streaming "
            f"{sorted(statuses)}; exit {code}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 MiB floods, not 64")
    p.add_argument("--model", default=None, help="an HF directory (default: the bundled one)")
    p.add_argument("--round-s", type=float, default=0.2,
                   help="item 3's floods: a round (4 or 8 bodies at once) every this many "
                        "seconds while the victim runs (default 0.2; 0: back-to-back)")
    p.add_argument("--case", action="append", default=[], metavar="TEXT",
                   help="only the cases whose name contains TEXT (repeatable; the quiet row "
                        "always runs; item 6, SIGTERM, only if named: --case 6.)")
    args = p.parse_args()
    from nanoserve.entrypoints.bundled import default_model_dir
    model = args.model or default_model_dir()
    rows = []
    server = ServerProcess(model, FLAGS)
    try:
        with Probe(server) as probe:  # quiet: the victim alone
            pass
        rows.append(probe.row("quiet (no attack)", "-"))
        for name, attack, times in cases(server, args.quick, args.round_s):
            if args.case and not any(c in name for c in args.case):
                continue
            with Probe(server) as probe:  # the attack, again until the victim is done
                results = [attack()]
                while len(results) < times and not probe.done.wait(0.01):
                    results.append(attack())
            rows.append(probe.row(name, f"{results[0]} (x{len(results)})"))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    name = "6. SIGTERM past --shutdown-timeout 2 s (12 streams, 2 whole)"
    if not args.case or any(c in name for c in args.case):
        rows.append({"case": name, "result": shutdown(model)})
    print("\n| case | what it gets | RSS growth MiB | /health p50 / p99 / max ms (polls) | "
          "victim gap p50 / max ms | victim latency ms |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['result']} | {r.get('rss_growth_mib', '')} | "
              f"{r.get('health_p50_ms', '')} / {r.get('health_p99_ms', '')} / "
              f"{r.get('health_max_ms', '')} ({r.get('health_polls', '')}) | "
              f"{r.get('victim_gap_p50_ms', '')} / {r.get('victim_gap_max_ms', '')} | "
              f"{r.get('victim_latency_ms', '')} |")


if __name__ == "__main__":
    main()
