"""Shutdown past --shutdown-timeout (nanoserve/entrypoints/api_server.py, engine_thread.py):
every stream still open ends with an error event and `data: [DONE]` in intact chunked framing
(running or still queued), every non-streaming request gets a JSON 503, and the process exits
non-zero, saying how many requests it cut off. Bounded: a few seconds."""

from __future__ import annotations

import json
import signal
import threading

import httpx

from tests.common.tiny_model import tiny_model_dir
from tests.server.harness import MAX_MODEL_LEN, TINY_FLAGS, ServerProcess

LONG = {"model": "m", "prompt": [5, 6, 7], "max_tokens": MAX_MODEL_LEN - 10, "ignore_eos": True,
        "temperature": 0}


def test_past_the_shutdown_timeout_streams_end_with_an_error_then_done_and_exit_is_1():
    s = ServerProcess(tiny_model_dir(MAX_MODEL_LEN),
                      [*TINY_FLAGS, "--max-num-seqs", "2", "--shutdown-timeout", "0.5"])
    events: dict[str, list[str]] = {"running": [], "queued": []}
    answers: list[httpx.Response] = []
    started = threading.Event()

    def stream(name: str) -> None:
        with httpx.stream("POST", s.base + "/v1/completions", json={**LONG, "stream": True},
                          timeout=30) as r:
            for line in r.iter_lines():  # httpx raises on broken chunked framing
                if line:
                    events[name].append(line)
                    started.set()

    def answer() -> None:
        answers.append(httpx.post(s.base + "/v1/completions", json=LONG, timeout=30))

    try:
        threads = [threading.Thread(target=stream, args=("running",)),
                   threading.Thread(target=answer)]
        for t in threads:
            t.start()
        assert started.wait(20)
        threads.append(threading.Thread(target=stream, args=("queued",)))  # no seat left
        threads[-1].start()
        s.wait_until(lambda m: m["nanoserve:num_requests_waiting"] == 1)
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert s.proc.wait(30) == 1
        assert "3 request(s) cut off" in s.log()
    finally:
        s.stop()
    for name in ("running", "queued"):
        *_, error, done = events[name]
        assert done == "data: [DONE]", name
        assert json.loads(error[len("data: "):])["error"]["code"] == 503, (name, error)
    assert len(events["running"]) > 3  # it had streamed tokens before
    [r] = answers
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"


def test_a_beam_search_cut_off_at_shutdown_is_a_503_and_nothing_hangs():
    """Past the timeout a search's round is aborted (or its next round refused): a 503."""
    s = ServerProcess(tiny_model_dir(MAX_MODEL_LEN), [*TINY_FLAGS, "--shutdown-timeout", "0.5"])
    answers: list[httpx.Response] = []
    body = {**LONG, "n": 2, "use_beam_search": True}
    try:
        thread = threading.Thread(target=lambda: answers.append(
            httpx.post(s.base + "/v1/completions", json=body, timeout=30)))
        thread.start()
        s.wait_until(lambda m: m["nanoserve:generation_tokens_total"] >= 20)  # rounds ran
        s.proc.send_signal(signal.SIGTERM)
        thread.join(30)
        assert s.proc.wait(30) == 1
    finally:
        s.stop()
    [r] = answers
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
