"""§6.1–§6.3: the iteration-level Scheduler (after vLLM V1's scheduler.py).

Two queues: `waiting` (never scheduled, or preempted) and `running` (owns KV blocks).
Every step `schedule()` spends a token budget (§6.2):
  1. running requests first, each taking its next tokens (one for a decode, a chunk for
     a prefill); when the BlockManager has no free block, preempt by recompute (§6.3);
  2. only if nothing was preempted, admit waiting requests while budget and
     `max_num_seqs` allow.
After the forward pass, `update_from_output()` appends sampled tokens, checks stops and
frees the blocks of finished requests at once (§3, §4), so the next step can use them.

The "static" policy is the §2 baseline on the same machinery: a batch is admitted only
when `running` is empty, and a finished request keeps computing a wasted row (an "idle
row") until the whole batch is done, as in HF `generate`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.sequence import FinishReason, Request, RequestStatus
from nanoserve.engine.waiting_queue import make_waiting_queue


@dataclass
class SchedulerOutput:
    """What one step computes, in batch order. The ModelRunner reads nothing else."""

    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request_id -> n
    idle_rows: list[Request] = field(default_factory=list)  # static policy: wasted rows
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.idle_rows


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, block_size: int) -> None:
        self.config = config
        self.policy = config.scheduling_policy
        self.block_manager = BlockManager(num_kv_blocks, block_size, config.enable_prefix_caching)
        # A request can never hold more tokens than the whole cache.
        self.max_model_len = min(config.max_model_len, num_kv_blocks * block_size)
        self.waiting = make_waiting_queue(self.policy)
        self.running: deque[Request] = deque()
        self.num_preemptions = 0

    def add_request(self, req: Request) -> None:
        self.waiting.push(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    # -- §6.2: one schedule step ------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.policy == "static" and not self.running:
            self._admit_static_batch(out)

        # Priority 1: requests already running (mostly decodes).
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.is_finished:  # static policy only: the row computes, uselessly
                out.idle_rows.append(req)
                i += 1
                continue
            num_new = self._num_new_tokens(req, budget)
            while not self.block_manager.allocate_slots(req, num_new):
                victim = self._pick_victim()
                budget += self._preempt(victim, out)
                if victim is req:
                    break
                if self.running.index(req) < i:  # a victim before `req` was removed
                    i -= 1
            if req.status == RequestStatus.PREEMPTED:
                continue  # `req` preempted itself; the request now at index i is next
            self._schedule(req, num_new, out)
            budget -= num_new
            i += 1

        # Priority 2: new requests, only if nothing was preempted this step.
        if self.policy != "static" and not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting.peek()
                computed = self.block_manager.get_computed_blocks(req)
                num_remaining = req.num_tokens - len(computed) * self.block_manager.block_size
                if not self.config.enable_chunked_prefill and num_remaining > budget:
                    break
                num_new = min(num_remaining, budget, self._prefill_cap())
                if not self.block_manager.allocate_slots(req, num_new, computed):
                    break  # no room without preempting; running requests come first
                self.waiting.pop()
                self._start_running(req, len(computed), out)
                self._schedule(req, num_new, out)
                budget -= num_new
        return out

    def _admit_static_batch(self, out: SchedulerOutput) -> None:
        """§2: take a whole batch at once; its prefills are then chunked by the budget."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            computed = self.block_manager.get_computed_blocks(req)
            if not self.block_manager.allocate_slots(req, 0, computed):
                break
            self.waiting.pop()
            self._start_running(req, len(computed), out)

    def _start_running(self, req: Request, num_cached_blocks: int, out: SchedulerOutput) -> None:
        req.num_computed_tokens = num_cached_blocks * self.block_manager.block_size
        if self.config.enable_prefix_caching:
            self.block_manager.record_prefix_lookup(req.num_tokens, req.num_computed_tokens)
        if req.status == RequestStatus.WAITING:
            req.num_cached_tokens = req.num_computed_tokens
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.running.append(req)
        out.admitted.append(req)

    def _prefill_cap(self) -> int:
        cap = self.config.long_prefill_token_threshold
        return cap if cap is not None else self.config.max_num_batched_tokens

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        return min(req.num_tokens - req.num_computed_tokens, budget, self._prefill_cap())

    def _schedule(self, req: Request, num_new: int, out: SchedulerOutput) -> None:
        out.scheduled.append(req)
        out.num_scheduled_tokens[req.request_id] = num_new

    # -- §6.3: preemption by recompute ------------------------------------------------

    def _pick_victim(self) -> Request:
        """FCFS: the request that joined `running` last. PRIORITY: the largest
        (priority, arrival_time), i.e. the least important, then the latest arrival."""
        candidates = [r for r in self.running if not r.is_finished]
        if self.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Free the victim's blocks, forget its KV (num_computed_tokens = 0) and put it at
        the front of `waiting`. Returns the budget it gives back if it was scheduled."""
        self.running.remove(victim)
        self.block_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(victim)
        out.preempted.append(victim)
        refund = out.num_scheduled_tokens.pop(victim.request_id, 0)
        if refund:
            out.scheduled.remove(victim)
        return refund

    # -- §4: process the step's output ------------------------------------------------

    def update_from_output(self, out: SchedulerOutput,
                           sampled_token_ids: dict[str, int]) -> list[Request]:
        """Advance each scheduled request, append its sampled token if its known tokens
        are now all computed, check stops, and free finished requests. Returns the
        requests that left the engine this step."""
        now = time.monotonic()
        finished: list[Request] = []
        for req in out.scheduled:
            req.num_computed_tokens += out.num_scheduled_tokens[req.request_id]
            self.block_manager.cache_full_blocks(req)
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk: nothing sampled yet
            req.append_token(sampled_token_ids[req.request_id])
            if req.first_token_time is None:
                req.first_token_time = now
            reason = self._check_stop(req)
            if reason is not None:
                req.status, req.finish_reason = RequestStatus.FINISHED, reason
                req.finish_time = now
                if self.policy != "static":
                    self.block_manager.free(req)
                    finished.append(req)
        if self.policy == "static":
            if self.running and all(r.is_finished for r in self.running):
                finished = list(self.running)  # the whole batch leaves together
                for req in finished:
                    req.finish_time = now
                    self.block_manager.free(req)
        if finished:
            self.running = deque(r for r in self.running if not r.is_finished)
        return finished

    def _check_stop(self, req: Request) -> FinishReason | None:
        params, last = req.sampling_params, req.token_ids[-1]
        if not params.ignore_eos and last in req.eos_token_ids:
            return FinishReason.STOP
        if last in params.stop_token_ids:
            return FinishReason.STOP
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def abort(self, request_id: str) -> Request | None:
        """Remove a waiting, running or preempted request and free its blocks. Unknown or
        already finished ids are a no-op (returns None), as in vLLM. A static-policy row
        that finished but still waits for its batch (its output not out yet) counts as
        running: it is aborted too, so its blocks don't outlive it (e.g. a failed generate)."""
        for req in self.running:
            if req.request_id == request_id:  # finished only if a static idle row
                self.running.remove(req)
                self.block_manager.free(req)
                return self._mark_aborted(req)
        req = self.waiting.remove(request_id)
        return self._mark_aborted(req) if req is not None else None

    @staticmethod
    def _mark_aborted(req: Request) -> Request:
        req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.ABORT
        req.finish_time = time.monotonic()
        return req
