"""Suite-wide set-up.

`--cpu avx2|avx512_bf16|amx` fakes the CPU probe (nanoserve/utils/cpu.py) for the whole run, so
`dtype="auto"` and the fast paths' kernel choice behave as on that machine: the suite must be green
with each (`make test-cpus`). Tests that need one dtype pin it; the `fake_cpu` fixture fakes one
machine inside a test. The header names the real CPU and the fake.

Hypothesis profiles: `NANOSERVE_HYPOTHESIS_PROFILE=mutate` (set by scripts/dev/mutate.py) makes the
property tests derandomized and database-free, so a mutant is killed or survives the same way on
every run; the default profile stays random, to keep finding new cases."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from nanoserve.utils import cpu

settings.register_profile("mutate", derandomize=True, database=None, print_blob=False)
settings.load_profile(os.environ.get("NANOSERVE_HYPOTHESIS_PROFILE", "default"))

# What each kind of CPU reports: (flags, native bf16).
FAKE_CPUS = {"avx2": (frozenset({"avx2"}), False),
             "avx512_bf16": (frozenset({"avx2", "avx512f", "avx512_bf16"}), True),
             "amx": (frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}), True)}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu", default="native", choices=("native", *FAKE_CPUS),
                     help="fake the CPU probe: dtype='auto' and kernel choice see this CPU")


def pytest_report_header(config: pytest.Config) -> str:
    return f"{cpu.describe()}; probe faked as: {config.getoption('--cpu')}"


def _fake(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    flags, native_bf16 = FAKE_CPUS[kind]
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu, "has_native_bf16", lambda: native_bf16)


@pytest.fixture(autouse=True)
def _cpu_from_option(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if (kind := request.config.getoption("--cpu")) != "native":
        _fake(monkeypatch, kind)


@pytest.fixture
def fake_cpu(monkeypatch: pytest.MonkeyPatch):
    """fake_cpu("avx2") makes this test see that CPU."""
    return lambda kind: _fake(monkeypatch, kind)
