"""The engine's CPU team on a shared machine (entrypoints/cpu_share.py): it shrinks to the cores
other processes leave, grows back when they leave, does not flap in between, and reads real
/proc figures (a real spinning process shows up as about one core)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from nanoserve.entrypoints import cpu_share
from nanoserve.entrypoints.cpu_share import CoreShare, Ticks, read_jiffies

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_the_team_follows_the_cores_others_leave(monkeypatch):
    """4 cores, periods of 1 s: the team is the cores others' demand (what they used, and what
    they kept our ready threads waiting for) leaves; between the thresholds it stays; our own
    threads waiting alone never shrink it. A smaller team is held to the cores others used
    least; a team of one alone there, the process's other threads on the other cores."""
    sizes, holds, clock = [], [], [0.0]
    ticks = [Ticks({c: 0 for c in range(4)}, 0, 0, {c: (0, c) for c in range(4)}, 0)]
    monkeypatch.setattr(torch, "set_num_threads", sizes.append)
    monkeypatch.setattr(cpu_share.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cpu_share, "read_jiffies", lambda cpus: ticks[0])
    monkeypatch.setattr(cpu_share, "hold_to", lambda mine, rest: holds.append((mine, rest)))
    share = CoreShare(max_threads=4, cpus=[0, 1, 2, 3])
    # (cores others used on cores 0-3, cores' worth of our threads waiting) -> team, held cores
    for others, waited, team, held in [
            ((0, 0, 0, 0.1), 0.0, 4, [0, 1, 2, 3]), ((0, 0.6, 0, 0), 0.4, 3, [0, 2, 3]),
            ((0, 0.5, 0, 0), 0.0, 3, [0, 2, 3]), ((0, 0.6, 1.0, 0), 0.4, 2, [0, 3]),
            ((0.5, 0.5, 0, 0), 0.0, 3, [0, 2, 3]), ((0, 0, 0, 0.1), 0.9, 4, [0, 1, 2, 3]),
            ((0.3, 0, 0, 0), 0.0, 4, [0, 1, 2, 3]), ((1.0, 0.6, 1.0, 1.0), 0.0, 1, [1])]:
        busy, total, own, threads, wait = ticks[0]
        ours = [round((1 - x) * 100) for x in others]  # one thread of ours on each core fills
        ticks[0] = Ticks({c: busy[c] + 100 for c in range(4)}, total + 400,  # what others leave
                         own + sum(ours), {c: (threads[c][0] + ours[c], c) for c in range(4)},
                         wait + round(waited * 1e9))
        clock[0] += 1.0
        share.update()
        assert share.threads == team and share.others == pytest.approx(sum(others))
        assert share.waited == pytest.approx(waited) and share.held == held
    assert sizes == [3, 2, 3, 4, 1]  # set only when it changes
    assert holds == [([0, 2, 3], [0, 2, 3]), ([0, 3], [0, 3]), ([0, 2, 3], [0, 2, 3]),
                     ([0, 1, 2, 3], [0, 1, 2, 3]), ([1], [0, 2, 3])]
    share.release()  # LLM.shutdown(): the whole team on every core again
    assert sizes[-1] == 4 and holds[-1] == ([0, 1, 2, 3], [0, 1, 2, 3])


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
    busy = sum(after.busy.values()) - sum(before.busy.values())
    total, own, waited = (after[i] - before[i] for i in (1, 2, 4))
    assert 0 <= own <= busy <= total and waited >= 0 and threading.get_native_id() in after.threads
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


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_a_team_of_one_is_held_apart_from_the_other_threads():
    """hold_to on real threads (in a child process, whose affinity it changes): the caller on
    its core, the process's other thread on the others."""
    code = """
import os, threading
from nanoserve.entrypoints.cpu_share import hold_to
cpus = sorted(os.sched_getaffinity(0))
ids, go = [], threading.Event()
other = threading.Thread(target=lambda: (ids.append(threading.get_native_id()), go.wait()))
other.start()
while not ids:
    pass
hold_to(cpus[:1], cpus[1:])
print(sorted(os.sched_getaffinity(0)) == cpus[:1], sorted(os.sched_getaffinity(ids[0])) == cpus[1:])
go.set()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["True", "True"], out.stderr


def test_an_engine_dropped_while_holding_lets_go(monkeypatch):
    """No shutdown(): the cores are given back when the CoreShare is collected; one that no
    longer holds gives nothing (another engine may be holding by then)."""
    import gc

    holds = []
    monkeypatch.setattr(cpu_share, "hold_to", lambda mine, rest: holds.append((mine, rest)))
    monkeypatch.setattr(cpu_share, "read_jiffies", lambda cpus: None)
    for team_after, given_back in ((1, [([0, 1], [0, 1])]), (2, [])):
        holds.clear()
        share = CoreShare(max_threads=2, cpus=[0, 1])
        share.threads = 1
        share.hold({0: 1.0, 1: 0.0})  # a team of one: core 1, the rest of us on core 0
        share.threads = team_after
        share.hold({0: 1.0, 1: 0.0})  # whole again: it lets go itself
        held = [([1], [0])] + ([([0, 1], [0, 1])] if team_after == 2 else [])
        del share
        gc.collect()
        assert holds == held + given_back
