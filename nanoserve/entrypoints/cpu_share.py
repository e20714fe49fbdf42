"""The engine's CPU threads on a shared machine: as many as the cores other processes leave.

An OpenMP team waits at the end of every parallel region for its slowest thread, and a decode
step is a few hundred regions. When another process keeps one of the cores busy, the engine's
thread there gets half of that core, so every region, and so every step, waits for it (on 2
cores a spinning neighbour made served steps 8x slower, issue 37). vLLM's CPU engine binds its
threads to the cores it reserves; here the team follows the machine. Every half second, between
steps and on the engine's thread, `CoreShare.update` reads what other processes took of this
process's cores (/proc/stat less /proc/self/stat) and what they kept this process's ready
threads waiting for (schedstat's run delay), and sizes the team to the cores that leaves (at
most the team it started with, at least one); the kernel then runs the smaller team on the free
cores. It shrinks only while others take at least a quarter of a core (our own threads waiting
on each other never shrink it) and grows back once they take under 0.4: no flapping between.

Only the team of the thread that steps the engine changes (OpenMP's thread count is per
thread), and only on Linux (elsewhere `CoreShare.probe()` is None). Figures: docs/serving.md."""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

SHRINK_AT, GROW_BELOW = 0.75, 0.4  # others' demand, in cores
OTHERS_AT_LEAST = 0.25  # cores others must take themselves before the team shrinks
PERIOD_S = 0.5
log = logging.getLogger("nanoserve")


def read_jiffies(cpus: list[int]) -> tuple[int, int, int, int]:
    """(busy, total) clock ticks of `cpus` since boot, this process's own CPU ticks, and the ns
    its threads spent ready to run but waiting for a core (schedstat's run_delay)."""
    busy = total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                user, nice, system, idle, iowait, irq, softirq = map(int, fields[:7])
                work = user + nice + system + irq + softirq  # steal: the hypervisor's, not ours
                busy, total = busy + work, total + work + idle + iowait
    with open("/proc/self/stat") as f:  # utime, stime: fields 14 and 15, after "(comm)"
        own = sum(map(int, f.read().rpartition(")")[2].split()[11:13]))
    waited = 0
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that just ended
            with open(f"/proc/self/task/{task}/schedstat") as f:
                waited += int(f.read().split()[1])
    return busy, total, own, waited


class CoreShare:
    def __init__(self, max_threads: int, cpus: list[int]) -> None:
        self.max_threads, self.cpus, self.threads = max_threads, cpus, max_threads
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
        now = read_jiffies(self.cpus)
        busy, total, own, waited = (b - a for a, b in zip(self.last, now))
        wall, self.last, self.last_time = now_time - self.last_time, now, now_time
        self.next_update = now_time + PERIOD_S
        if total <= 0 or wall <= 0:
            return
        self.others = max(0.0, (busy - own) * len(self.cpus) / total)
        self.waited = waited / 1e9 / wall
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
