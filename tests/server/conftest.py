"""Fixtures shared by the server tests: one tiny-model server a test file (starting one costs
seconds; a session-wide one would outlive this folder and be a stray child process to the tests
that check nothing is left behind), and the same model in this process as the reference."""

from __future__ import annotations

import pytest

from nanoserve import LLM
from tests.common.tiny_model import tiny_model_dir
from tests.server.harness import MAX_MODEL_LEN, TINY_CONFIG, TINY_FLAGS, ServerProcess


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(tiny_model_dir(MAX_MODEL_LEN), TINY_FLAGS)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def ref_llm() -> LLM:
    return LLM(tiny_model_dir(MAX_MODEL_LEN), **TINY_CONFIG)
