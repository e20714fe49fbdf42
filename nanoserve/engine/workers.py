"""Tensor parallel (tensor_parallel_size > 1): one model split over N processes, one a rank, as
nano-vllm and vLLM do it. Rank 0 runs the chapter's loop unchanged (the scheduler and block
manager exist once, there) and broadcasts each step's StepInputs (block tables included) over a
gloo group; every rank holds its shard of each layer (layers/linear.py) and the KV of its own
heads, and runs the same forward in lockstep on torch.distributed (gloo on a CPU, NCCL on CUDA).

Rank 0 starts the other ranks itself (torch.multiprocessing, spawn) on one machine; under
`torchrun` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) every process runs the same script,
and LLM() on a rank > 0 serves its rank until rank 0 shuts down, then exits the process. A rank
that dies makes the next step fail at once (liveness, or the collective's error or 60 s
timeout), never hang; shutdown, garbage collection and exit leave no process behind."""

from __future__ import annotations

import datetime
import os
import socket
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from nanoserve.config import EngineConfig

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # a step's all-reduce never takes this long
IDLE_TIMEOUT = datetime.timedelta(days=365)  # the ranks > 0 wait this long for the next step


class WorkerDied(RuntimeError):
    """A tensor-parallel rank is gone: the engine cannot step any more."""


def init_rank(config: EngineConfig, rank: int, init_method: str | None) -> dist.ProcessGroup:
    """Join the process group as `rank`; on a CPU take this rank's share of the cores. Returns
    the gloo group the step inputs travel on."""
    if config.device == "cpu":
        share = max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)
        torch.set_num_threads(share)
        os.environ["OMP_NUM_THREADS"] = str(share)  # the fast path's C kernels, loaded later
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    backend = "gloo" if config.device == "cpu" else "nccl"
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                            world_size=config.tensor_parallel_size, timeout=COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def torchrun_rank() -> int | None:
    """This process's rank if torchrun (or the like) started it, else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ \
        else None


def receive(group: dist.ProcessGroup) -> object | None:
    """On a rank > 0: the next step's inputs, rank 0's StepInputs (None: shut down)."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Workers:
    """Rank 0's hold on the other ranks: it starts them (unless torchrun did), joins their process
    group, sends them each step and stops them."""

    def __init__(self, config: EngineConfig, model_dir: str,
                 worker_main: Callable[[EngineConfig, str, int, str], None]) -> None:
        """`worker_main(config, model_dir, rank, init_method)` runs a rank > 0 (model_runner's)."""
        self.procs: list[mp.Process] = []
        self.init_method = None  # torchrun: its environment
        if torchrun_rank() is None:
            with socket.socket() as s:  # a free port on this machine for the rendezvous
                s.bind(("127.0.0.1", 0))
                self.init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
            context = mp.get_context("spawn")
            self.procs = [context.Process(target=worker_main, daemon=True, name=f"tp-rank-{r}",
                                          args=(config, model_dir, r, self.init_method))
                          for r in range(1, config.tensor_parallel_size)]
            for proc in self.procs:
                proc.start()
            weakref.finalize(self, release, self.procs)  # garbage collection and exit too
        self.group = init_rank(config, 0, self.init_method)

    def check(self, error: Exception | None = None) -> None:
        """WorkerDied if a rank exited (after `error`, a collective's: waiting a moment for
        the process to be reaped) or if the collective failed anyway."""
        for rank, proc in enumerate(self.procs, start=1):
            if error is not None:
                proc.join(timeout=2)
            if not proc.is_alive():
                raise WorkerDied(f"tensor-parallel rank {rank} exited (exit code "
                                 f"{proc.exitcode}); the engine cannot step any more")
        if error is not None:
            raise WorkerDied(f"a tensor-parallel collective failed: {error}") from error

    def send(self, step: object | None) -> None:
        self.check()
        try:
            dist.broadcast_object_list([step], src=0, group=self.group)
        except RuntimeError as e:  # a rank died during the collective
            self.check(e)

    def stop(self) -> None:
        """Tell the ranks to exit, give them a few seconds, then kill what is left."""
        if all(proc.is_alive() for proc in self.procs):
            try:
                self.send(None)
            except WorkerDied:
                pass
        for proc in self.procs:
            proc.join(timeout=10)
        release(self.procs)


def release(procs: list[mp.Process]) -> None:
    """Kill what is left of the ranks and leave the process group, so that this process can
    start another engine with tensor_parallel_size > 1 (one default group a process)."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    if dist.is_initialized():
        dist.destroy_process_group()
