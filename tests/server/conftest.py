"""Fixtures shared by the server tests: one tiny-model server for this folder's tests (starting
one costs ~10 s on a 2-core VM, once a file was ~80 s of the suite), stopped after the folder's
last test so that it is no stray child process to the tests after it that check nothing is left
behind (tests/tp); and the same model in this process as the reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve import LLM
from tests.common.tiny_model import tiny_model_dir
from tests.server.harness import MAX_MODEL_LEN, TINY_CONFIG, TINY_FLAGS, ServerProcess

HERE = Path(__file__).parent
_shared: list[ServerProcess] = []  # the running server, if any


@pytest.fixture
def server() -> ServerProcess:
    if _shared and _shared[0].proc.poll() is not None:  # a test's load ended it: a new one
        _shared.pop().stop()
    if not _shared:
        _shared.append(ServerProcess(tiny_model_dir(MAX_MODEL_LEN), TINY_FLAGS))
    return _shared[0]


def pytest_runtest_teardown(item, nextitem) -> None:
    if _shared and (nextitem is None or Path(nextitem.path).parent != HERE):
        _shared.pop().stop()


@pytest.fixture(scope="session")
def ref_llm() -> LLM:
    return LLM(tiny_model_dir(MAX_MODEL_LEN), **TINY_CONFIG)
