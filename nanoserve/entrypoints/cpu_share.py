"""The engine's CPU threads on a shared machine: as many as the cores other processes leave, held
to those cores.

An OpenMP team waits at the end of every parallel region for its slowest thread, and a decode
step is a few hundred regions. When another process keeps one of the cores busy, the engine's
thread there gets half of that core, so every region, and so every step, waits for it (on 2
cores a spinning neighbour made served steps 8x slower, issue 37). vLLM's CPU engine binds its
threads to the cores it reserves; here the team follows the machine. Every half second, between
steps and on the engine's thread, `CoreShare.update` reads what other processes took of each of
this process's cores (/proc/stat less our threads' CPU time, each counted on the core it last
ran on) and what they kept this process's ready threads waiting for (schedstat's run delay), and
sizes the team to the cores that leaves (at most the team it started with, at least one). It
shrinks only while others take at least a quarter of a core (our own threads waiting on each
other never shrink it) and grows back once they take under 0.4: no flapping between.

A smaller team is also held to the cores others use least, and let go when the team is whole
again. A team of one is the engine's thread alone: it gets its core to itself and every other
thread of the process (the event loop's, the tokenizer's) runs on the other cores, as vLLM keeps
its API process off its engine's core. A larger team's OpenMP threads cannot be told from the
others, so all of them share the team's cores. Left to the kernel, a served team of one ran its
prefill chunks a fifth slower than held apart from the event loop (docs/serving.md): the threads
that wake beside it take its core, and the kernel moves it onto the neighbour's.

Only the team of the thread that steps the engine changes (OpenMP's thread count is per
thread), and only on Linux (elsewhere `CoreShare.probe()` is None). Figures: docs/serving.md."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from typing import NamedTuple

import torch

SHRINK_AT, GROW_BELOW = 0.75, 0.4  # others' demand, in cores
OTHERS_AT_LEAST = 0.25  # cores others must take themselves before the team shrinks
PERIOD_S = 0.5
log = logging.getLogger("nanoserve")


class Ticks(NamedTuple):
    """Clock ticks since boot, of the cores this process may use."""
    busy: dict[int, int]  # each core's busy ticks
    total: int  # all ticks of those cores together
    own: int  # this process's CPU ticks, its ended threads' too
    threads: dict[int, tuple[int, int]]  # each live thread's CPU ticks and the core it last ran on
    waited: int  # ns this process's threads were ready to run but waited for a core (run_delay)


def read_jiffies(cpus: list[int]) -> Ticks:
    busy, total = dict.fromkeys(cpus, 0), 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in busy:
                user, nice, system, idle, iowait, irq, softirq = map(int, fields[:7])
                work = user + nice + system + irq + softirq  # steal: the hypervisor's, not ours
                busy[int(name[3:])], total = work, total + work + idle + iowait
    with open("/proc/self/stat") as f:  # utime, stime: fields 14 and 15, after "(comm)"
        own = sum(map(int, f.read().rpartition(")")[2].split()[11:13]))
    threads, waited = {}, 0
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that just ended
            with open(f"/proc/self/task/{task}/stat") as f:  # the core: field 39
                fields = f.read().rpartition(")")[2].split()
            threads[int(task)] = int(fields[11]) + int(fields[12]), int(fields[36])
            with open(f"/proc/self/task/{task}/schedstat") as f:
                waited += int(f.read().split()[1])
    return Ticks(busy, total, own, threads, waited)


def hold_to(mine: list[int], rest: list[int]) -> None:
    """The calling thread on `mine`, every other thread of this process on `rest` (threads
    started later inherit their starter's)."""
    me = threading.get_native_id()
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(int(task), mine if int(task) == me else rest)


class CoreShare:
    def __init__(self, max_threads: int, cpus: list[int]) -> None:
        self.max_threads, self.cpus, self.threads = max_threads, cpus, max_threads
        self.held = cpus  # the cores the process's threads may run on
        self.let_go = weakref.finalize(self, lambda: None)  # see hold()
        self.last, self.last_time = read_jiffies(cpus), time.monotonic()
        self.next_update = self.last_time + PERIOD_S
        self.others = self.waited = 0.0  # the last period's, in cores (see update)

    @classmethod
    def probe(cls) -> CoreShare | None:
        """One for this process, if it can read /proc and has more than one thread to give."""
        try:
            cpus = sorted(os.sched_getaffinity(0))
            share = cls(torch.get_num_threads(), cpus)
        except (AttributeError, OSError, ValueError, IndexError):
            return None
        return share if share.max_threads > 1 else None

    def update(self) -> None:
        """Between steps: resize the calling thread's team if a period has passed. `others`:
        the cores other processes kept busy; `waited`: the cores' worth of this process's
        threads that were ready but waited for a core. Others' demand is both (what they took,
        and what they kept from us); our own threads alone never shrink the team."""
        now_time = time.monotonic()
        if now_time < self.next_update:
            return
        last, now = self.last, read_jiffies(self.cpus)
        total, wall = now.total - last.total, now_time - self.last_time
        self.last, self.last_time, self.next_update = now, now_time, now_time + PERIOD_S
        if total <= 0 or wall <= 0:
            return
        self.others = max(0.0, (sum(now.busy.values()) - sum(last.busy.values()) - now.own
                                + last.own) * len(self.cpus) / total)
        self.waited = (now.waited - last.waited) / 1e9 / wall
        demand = self.others + self.waited
        if self.others >= OTHERS_AT_LEAST and demand >= SHRINK_AT:
            threads = max(1, min(self.max_threads, len(self.cpus) - round(demand)))
        elif self.others < GROW_BELOW:
            threads = self.max_threads
        else:
            threads = self.threads
        log.debug("cpu share: others %.2f, waited %.2f: %d threads", self.others, self.waited,
                  threads)
        if threads != self.threads:
            self.threads = threads
            torch.set_num_threads(threads)
        if threads < self.max_threads or self.held != self.cpus:
            self.hold(self.others_by_core(last, now))

    def others_by_core(self, last: Ticks, now: Ticks) -> dict[int, float]:
        """Each core's share (of one core) others took in the period: its busy ticks less
        those of our threads that last ran on it (a thread that ended in it is not counted)."""
        ours = dict.fromkeys(self.cpus, 0)
        for tid, (ticks, cpu) in now.threads.items():
            ours[cpu if cpu in ours else self.cpus[0]] += ticks - last.threads.get(tid, (0,))[0]
        total = now.total - last.total
        return {c: max(0.0, (now.busy[c] - last.busy[c] - ours[c]) * len(self.cpus) / total)
                for c in self.cpus}

    def hold(self, others: dict[int, float]) -> None:
        """A smaller team: held to as many cores as it has threads, those others used least (a
        tie keeps the cores it holds); a team of one, the engine's thread, with the rest of the
        process on the other cores; the whole team again: all let go."""
        held = self.cpus
        if self.threads < self.max_threads:
            cores = sorted(self.cpus, key=lambda c: (round(others[c] * 4), c not in self.held))
            held = sorted(cores[:self.threads])
        if held != self.held:
            self.held = held
            rest = [c for c in self.cpus if c not in held]
            hold_to(held, rest if self.threads == 1 and rest else held)
            # Held, the process stays so after an engine that is dropped without shutdown():
            # letting go then too, and only while it holds (another engine may hold later).
            self.let_go.detach()
            if held != self.cpus:
                self.let_go = weakref.finalize(self, hold_to, self.cpus, self.cpus)

    def release(self) -> None:
        """The whole team again, on every core it started with (an engine that ends)."""
        if self.threads != self.max_threads:
            self.threads = self.max_threads
            torch.set_num_threads(self.max_threads)
        if self.held != self.cpus:
            self.held = self.cpus
            self.let_go()
