"""vLLM's stat line on the server's stderr (metrics.py's LoggingStatLogger): what it counts, that
an idle engine goes quiet after one line that shows it idle, --disable-log-stats, and a bad
NANOSERVE_LOG_STATS_INTERVAL refused by name."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest

from nanoserve.engine.llm_engine import EngineStats
from nanoserve.entrypoints.metrics import LoggingStatLogger
from tests.common.tiny_model import tiny_model_dir
from tests.server.harness import MAX_MODEL_LEN, TINY_FLAGS, ServerProcess

LINE = re.compile(r"nanoserve: Avg prompt throughput: ([\d.]+) tokens/s, Avg generation "
                  r"throughput: ([\d.]+) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, "
                  r"KV cache usage: ([\d.]+)%, Prefix cache hit rate: ([\d.]+)%")


def stats(running: int = 0, waiting: int = 0, usage: float = 0.0) -> EngineStats:
    return EngineStats(running, waiting, usage, 10, 0, 0.0, 0)


def test_the_line_counts_the_interval_and_goes_quiet_when_idle():
    metrics = SimpleNamespace(num_prompt_tokens=0, num_generation_tokens=0, seen=(0, 0, 0),
                              stats=stats())
    logger = LoggingStatLogger(metrics, 10.0)
    logger.last = (100.0, 0, 0, 0, 0)
    assert logger.line(110.0) is None  # idle from the start: nothing to say
    metrics.num_prompt_tokens, metrics.num_generation_tokens = 300, 50
    metrics.seen, metrics.stats = (0, 400, 100), stats(2, 1, 0.125)
    assert logger.line(120.0) == (
        "Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 25.0%")
    metrics.num_generation_tokens, metrics.stats = 70, stats()  # the last ones finished
    assert logger.line(124.0).startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation "
                                         "throughput: 5.0 tokens/s, Running: 0 reqs")
    assert logger.line(134.0).startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation "
                                         "throughput: 0.0 tokens/s")  # the line that shows idle
    assert logger.line(144.0) is None and logger.line(154.0) is None


def lines(server: ServerProcess) -> list[tuple[float, ...]]:
    return [tuple(map(float, m.groups())) for m in LINE.finditer(server.log())]


def test_a_served_request_shows_in_the_line_then_the_server_goes_quiet():
    server = ServerProcess(tiny_model_dir(MAX_MODEL_LEN), TINY_FLAGS,
                           env={"NANOSERVE_LOG_STATS_INTERVAL": "0.2"})
    try:
        out = server.client().completions.create(model="m", prompt="hello there", max_tokens=40,
                                                 temperature=0)
        assert out.usage.completion_tokens == 40
        deadline = time.monotonic() + 30
        while not (found := lines(server)) or found[-1][:2] != (0.0, 0.0):
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        assert sum(line[0] for line in found) > 0 and sum(line[1] for line in found) > 0
        time.sleep(1.0)  # five more periods, all idle: no line
        assert lines(server) == found
    finally:
        server.stop()


@pytest.mark.parametrize("flags, env, expected", [
    (["--disable-log-stats"], {"NANOSERVE_LOG_STATS_INTERVAL": "0.2"}, None),
    ([], {"NANOSERVE_LOG_STATS_INTERVAL": "0"}, "NANOSERVE_LOG_STATS_INTERVAL must be"),
])
def test_disabled_or_refused(flags, env, expected):
    if expected is not None:
        with pytest.raises(RuntimeError, match=expected):
            ServerProcess(tiny_model_dir(MAX_MODEL_LEN), TINY_FLAGS + flags, env=env)
        return
    server = ServerProcess(tiny_model_dir(MAX_MODEL_LEN), TINY_FLAGS + flags, env=env)
    try:
        server.client().completions.create(model="m", prompt="hi", max_tokens=8)
        time.sleep(1.0)
        assert lines(server) == [] and "Avg prompt throughput" not in server.log()
    finally:
        server.stop()
