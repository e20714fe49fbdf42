"""§2–§3, §6: a JSON-lines record of every step, drawn by `scripts/reader/trace_page.py`. A run's
header line, then per step: each batch row with its seat and role (prefill chunk, decode, or a
static "idle row" = "slot quay không"), the token budget spent, waiting queue, free KV blocks,
who was admitted, preempted ("nạn nhân", §6.3) or finished. A seat is what the chapter calls a
"slot" in the batch (in the code a slot is a KV position, `slot_mapping`): the lowest free one on
admission, freed at finish (static: batch end) or preemption."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoserve.config import EngineConfig
    from nanoserve.engine.block_manager import BlockManager
    from nanoserve.engine.request import Request
    from nanoserve.engine.scheduler import Scheduler, SchedulerOutput


class Tracer:
    """Call `record()` once per step, after `update_from_output()`: it appends the step's JSON
    line to `path` (if any) and prints `trace_line` to stderr (if `print_lines`)."""

    def __init__(self, path: str | None, config: EngineConfig, block_manager: BlockManager,
                 source: str = "engine", print_lines: bool = False) -> None:
        self.path, self.print_lines = path, print_lines
        self.header = {"type": "run", "name": config.batching, "policy": config.scheduling_policy,
                       "max_num_seqs": config.max_num_seqs,
                       "token_budget": config.max_num_batched_tokens,
                       "num_blocks": block_manager.num_blocks,
                       "block_size": block_manager.block_size, "source": source}
        self.seats: dict[str, int] = {}  # request_id -> seat
        self.num_steps = 0
        self.start = time.monotonic()  # t_s: when a measured step ended (served traffic's gaps)

    @classmethod
    def from_config(cls, config: EngineConfig, block_manager: BlockManager) -> Tracer | None:
        """The engine's: JSON lines to `trace_file`, printed lines if `trace` (or
        NANOSERVE_TRACE=1); None if neither is asked for."""
        print_lines = config.trace or os.environ.get("NANOSERVE_TRACE", "") not in ("", "0")
        if config.trace_file is None and not print_lines:
            return None
        return cls(config.trace_file, config, block_manager, print_lines=print_lines)

    def step_record(self, out: SchedulerOutput, finished: list[Request], scheduler: Scheduler,
                    time_ms: float | None = None) -> dict[str, Any]:
        """This step's line (and the seats it frees and takes)."""
        self.num_steps += 1
        live = {r.request_id for group in (scheduler.running, out.idle_rows, finished,
                out.preempted, [s.request for s in out.scheduled]) for r in group}
        self.seats = {rid: k for rid, k in self.seats.items() if rid in live}  # aborted: freed
        admitted = {r.request_id for r in out.admitted}
        # Continuous: victims leave before anyone is admitted. Static: a batch is admitted
        # first and one of its own rows can be the victim, so it sits down, then leaves.
        late = [r for r in out.preempted if r.request_id in admitted]
        victims = {r.request_id: self.seats.pop(r.request_id, None)
                   for r in out.preempted if r.request_id not in admitted}
        for req in out.admitted:  # the lowest free seat
            used = set(self.seats.values())
            self.seats[req.request_id] = next(k for k in range(len(used) + 1) if k not in used)
        victims.update({r.request_id: self.seats.pop(r.request_id) for r in late})
        rows = []
        for s in out.scheduled:
            req, n = s.request, s.num_new_tokens
            end = req.num_computed_tokens  # recorded after the step: these n are computed
            rows.append({"request": req.request_id, "seat": self.seats[req.request_id],
                         "role": "decode" if s.is_decode else "prefill", "start": end - n,
                         "end": end})
        rows += [{"request": r.request_id, "seat": self.seats[r.request_id], "role": "idle"}
                 for r in out.idle_rows]
        rule = ("PRIORITY: lowest priority, then latest arrival" if self.header["policy"] ==
                "priority" else "FCFS: the request that joined running last")
        bm = scheduler.block_manager
        record = {
            "type": "step", "step": self.num_steps,
            "time_ms": None if time_ms is None else round(time_ms, 3),
            "t_s": None if time_ms is None else round(time.monotonic() - self.start, 3),
            "token_budget": out.token_budget, "num_scheduled_tokens": out.num_scheduled_tokens,
            "num_waiting": len(scheduler.waiting), "num_running": len(scheduler.running),
            "num_free_blocks": bm.num_free_blocks, "num_blocks": bm.num_blocks,
            "rows": sorted(rows, key=lambda r: r["seat"]),
            "admitted": [r.request_id for r in out.admitted],
            "preempted": [{"request": rid, "seat": seat,
                           "reason": f"out of free KV blocks; victim by {rule}; will recompute"}
                          for rid, seat in victims.items()],
            "finished": [{"request": r.request_id, "reason": r.finish_reason.value}
                         for r in finished]}
        for req in finished:
            self.seats.pop(req.request_id, None)
        return record

    def record(self, out: SchedulerOutput, finished: list[Request], scheduler: Scheduler,
               time_ms: float | None = None) -> dict[str, Any]:
        """This step's line, appended to `path` if any (one file can hold several runs)."""
        record = self.step_record(out, finished, scheduler, time_ms)
        if self.path is not None:
            lines = ([self.header] if record["step"] == 1 else []) + [record]
            with open(self.path, "a", encoding="utf-8") as f:  # a short trace needs no close()
                f.writelines(json.dumps(x) + "\n" for x in lines)
        if self.print_lines:
            print(trace_line(self.num_steps, out, finished, scheduler), file=sys.stderr)
        return record


def trace_line(step: int, out: SchedulerOutput, finished: list[Request],
               scheduler: Scheduler) -> str:
    """One printed line per step (`trace=True`), so a reader *sees* iteration-level scheduling."""
    decode = [s.request.request_id for s in out.scheduled if s.is_decode]
    # After update_from_output: the chunk ends at num_computed_tokens.
    prefill = [f"{s.request.request_id}[{s.request.num_computed_tokens - s.num_new_tokens}:"
               f"{s.request.num_computed_tokens})" for s in out.scheduled if not s.is_decode]
    parts = [f"step {step:4d}", f"decode {' '.join(decode) or '-'}",
             f"prefill {' '.join(prefill) or '-'}"]
    events = {"idle": [r.request_id for r in out.idle_rows],
              "PREEMPTED": [r.request_id for r in out.preempted],
              "finished": [f"{r.request_id}({r.finish_reason.value})" for r in finished]}
    parts += [f"{label} {' '.join(ids)}" for label, ids in events.items() if ids]
    bm = scheduler.block_manager
    parts += [f"budget {out.num_scheduled_tokens}/{out.token_budget}",
              f"waiting {len(scheduler.waiting)}",
              f"free blocks {bm.num_free_blocks}/{bm.num_blocks}"]
    return " | ".join(parts)
