"""The server tests' harness: a real `python -m nanoserve.serve` process on 127.0.0.1 (an
ephemeral port) on the tiny model, its /metrics parsed, its RSS read; every wait bounded."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 2048  # long requests, so a disconnect surely comes before their end
# A KV cache of 1/16 GiB: 8191 blocks of the tiny model, twice what 32 requests of 2048 tokens
# hold (the default 1 GiB, 131071 blocks, cost each server ~1.6 s to zero and list at start).
TINY_FLAGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16",
              "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
              "--kv-cache-memory-gib", "0.0625"]
TINY_CONFIG = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "block_size": 16,
               "max_num_seqs": 32, "max_num_batched_tokens": 512, "kv_cache_memory_gib": 0.0625}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, flags: list[str], name: str = "m",
                 env: dict[str, str] | None = None, uds: str | None = None,
                 cafile: str | None = None) -> None:
        """`uds`: it listens on that Unix socket (--uds); `cafile`: on HTTPS, its certificate
        (the flags: --ssl-*) signed by that file's."""
        self.port, self.uds, self.cafile = free_port(), uds, cafile
        self.base = f"http{'s' if cafile else ''}://127.0.0.1:{self.port}"
        flags = [*flags, "--uds", uds] if uds else flags
        # The log to a file: a pipe nobody reads would block the server once 64 KiB are in it.
        fd, self.log_path = tempfile.mkstemp(prefix="nanoserve-server-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanoserve.serve", model, "--port", str(self.port),
             "--served-model-name", name, *flags], cwd=ROOT,
            stdout=fd, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        os.close(fd)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log()}")
            try:
                with self.http() as http:
                    if http.get(self.base + "/health", timeout=2).status_code == 200:
                        return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not come up in 180 s")

    def http(self) -> httpx.Client:
        """A client that reaches it (over its socket, or trusting its certificate)."""
        verify = ssl.create_default_context(cafile=self.cafile) if self.cafile else True
        if self.uds:
            return httpx.Client(transport=httpx.HTTPTransport(uds=self.uds, verify=verify))
        return httpx.Client(verify=verify)

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=kw.pop("api_key", "none"),
                             max_retries=0, timeout=60, **kw)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", timeout=10).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1]) / 1024

    def wait_until(self, ok, timeout: float = 30) -> dict[str, float]:
        """Until ok(metrics) (bounded)."""
        deadline = time.monotonic() + timeout
        while not ok(m := self.metrics()):
            if time.monotonic() > deadline:
                raise AssertionError(f"not there after {timeout} s: {m}")
            time.sleep(0.05)
        return m

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Until nothing runs or waits and every KV block is free (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["nanoserve:num_requests_running"], m["nanoserve:num_requests_waiting"],
                    m["nanoserve:kv_cache_usage_perc"]) == (0, 0, 0):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle after {timeout} s: {m}")
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        Path(self.log_path).unlink(missing_ok=True)
        return self.proc.returncode


def post(server, path: str, content: bytes | str, headers: dict | None = None):
    with server.http() as http:
        return http.post(server.base + path, content=content, timeout=30,
                         headers={"content-type": "application/json", **(headers or {})})
