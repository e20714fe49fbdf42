"""The engine's CPU team on a shared machine (entrypoints/cpu_share.py): it shrinks to the cores
other processes leave, grows back when they leave, does not flap in between, and reads real
/proc figures (a real spinning process shows up as about one core)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from nanoserve.entrypoints import cpu_share
from nanoserve.entrypoints.cpu_share import CoreShare, read_jiffies

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_the_team_follows_the_cores_others_leave(monkeypatch):
    """4 cores, periods of 1 s: the team is the cores others' demand (what they used, and what
    they kept our ready threads waiting for) leaves; between the thresholds it stays; our own
    threads waiting alone never shrink it."""
    sizes, clock, ticks = [], [0.0], [(0, 0, 0, 0)]
    monkeypatch.setattr(torch, "set_num_threads", sizes.append)
    monkeypatch.setattr(cpu_share.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cpu_share, "read_jiffies", lambda cpus: ticks[0])
    share = CoreShare(max_threads=4, cpus=[0, 1, 2, 3])
    # (cores others used, ours, cores' worth of our threads waiting) -> the team after it
    for others, ours, waited, team in [(0.1, 3.9, 0.0, 4), (0.6, 3.0, 0.4, 3), (0.5, 3.0, 0.0, 3),
                                       (1.6, 2.4, 0.4, 2), (1.0, 2.0, 0.0, 3),
                                       (0.1, 3.9, 0.9, 4), (0.3, 2.0, 0.0, 4), (3.9, 0.1, 0.0, 1)]:
        busy, total, own, wait = ticks[0]
        ticks[0] = (busy + round((others + ours) * 100), total + 400, own + round(ours * 100),
                    wait + round(waited * 1e9))
        clock[0] += 1.0
        share.update()
        assert share.threads == team and share.others == pytest.approx(others)
        assert share.waited == pytest.approx(waited)
    assert sizes == [3, 2, 3, 4, 1]  # set only when it changes


def test_a_spinning_process_counts_as_a_core():
    cpus = sorted(__import__("os").sched_getaffinity(0))
    before = read_jiffies(cpus)
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                                "while time.time() - t < 1.5: pass"])
    try:
        time.sleep(1.4)
        after = read_jiffies(cpus)
    finally:
        spinner.wait(timeout=10)
    busy, total, own, waited = (b - a for a, b in zip(before, after))
    assert 0 <= own <= busy <= total and waited >= 0
    assert (busy - own) * len(cpus) / total > 0.5  # about 1: the spinner's core


def test_the_llm_updates_it_before_each_step(monkeypatch):
    from nanoserve import LLM
    from tests.common.tiny_model import tiny_model_dir

    calls = []
    monkeypatch.setattr(CoreShare, "probe", classmethod(lambda cls: cls(2, [0, 1])))
    monkeypatch.setattr(CoreShare, "update", lambda self: calls.append(self))
    llm = LLM(tiny_model_dir(), dtype="float32", num_kv_blocks=8, skip_tokenizer_init=True)
    llm.generate([[1, 2, 3]], use_tqdm=False)
    assert calls and all(c is llm.core_share for c in calls)
