"""§6.1–§6.3: the iteration-level Scheduler, FCFS or PRIORITY (after vLLM V1's scheduler.py); the
§2 baseline, static batching, is its own class in static_scheduler.py.

Two queues: `waiting` (never scheduled, or preempted) and `running` (owns KV blocks). Each step
`schedule()` spends a token budget in §6.2's order: running requests first, preempting by recompute
when no block is free (§6.3); then, if nothing was preempted, waiting ones. After the forward pass
`update_from_output()` appends tokens, checks stops and frees finished requests at once (§3, §4).

As in vLLM 0.32: a waiting or preempted request is admitted only if the blocks of its whole current
sequence fit (`scheduler_reserve_full_isl=True`), because one admitted on its first chunk alone
would soon need blocks that only preempting others can give; `long_prefill_token_threshold` caps a
chunk only if another request is running or waiting, because it exists to keep one long prefill
from starving the others."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoserve.config import EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.request import FinishReason, Request, RequestStatus
from nanoserve.engine.waiting_queue import FCFSQueue, PriorityQueue


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    samples: bool  # this step computes the request's last known token, so a token is sampled
    is_decode: bool = False  # it computes the token sampled last step (§6: a case, not a phase)


@dataclass
class SchedulerOutput:
    """What one step computes (the model runner also reads the requests' own state)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in scheduling order
    token_budget: int = 0  # the step's max_num_batched_tokens
    idle_rows: list[Request] = field(default_factory=list)  # static batching (§2) only
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.idle_rows


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, block_size: int) -> None:
        self.config = config
        self.block_manager = BlockManager(num_kv_blocks, block_size, config.enable_prefix_caching)
        # A request can never hold more tokens than the whole cache: it stops there.
        self.max_model_len_in_cache = min(config.max_model_len, num_kv_blocks * block_size)
        self.waiting = PriorityQueue() if config.scheduling_policy == "priority" else FCFSQueue()
        self.running: deque[Request] = deque()
        self.num_preemptions = 0
        # Whether a request's new text completes one of its stop strings: the engine's
        # detokenizer knows (the scheduler sees tokens only). None: no text, no stop strings.
        self.stop_string_in: Callable[[Request], bool] | None = None

    def add_request(self, req: Request) -> None:
        self.waiting.push(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """§6.2: one schedule step, its decisions in the chapter's order (1-3 below)."""
        token_budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(token_budget=token_budget)
        alone = len(self.running) + len(self.waiting) <= 1  # no other request to protect
        cap = None if alone else self.config.long_prefill_token_threshold

        # 1. Running requests first (mostly decodes), each taking its next tokens.
        for req in list(self.running):  # a copy: preempting removes from `running`
            if token_budget == 0:
                break
            if req.status == RequestStatus.PREEMPTED:
                continue  # evicted earlier in this step by a request ahead of it
            num_remaining = req.num_tokens - req.num_computed_tokens
            if not self.config.enable_chunked_prefill and num_remaining > token_budget:
                continue  # a static batch's prompt: whole in a later step, never chunked
            num_new = min(num_remaining, token_budget, cap or token_budget)
            # 2. No free block: preempt a victim (§6.3) and retry, until it fits or evicts itself.
            while not (allocated := self.block_manager.allocate_slots(req, num_new)):
                victim = self._pick_victim()
                token_budget += self._preempt_request(victim, out)
                if victim is req:
                    break
            if not allocated:
                break  # it evicted itself: the running loop ends here, as in vLLM V1
            self._add_to_output(req, num_new, out)
            token_budget -= num_new

        # 3. Waiting requests, only if nothing was preempted this step.
        while not out.preempted and self.waiting and token_budget > 0:
            req = self.waiting.peek()
            if not self._can_admit(req):
                break
            computed_blocks, num_cached = self.block_manager.get_computed_blocks(req)
            num_remaining = req.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and num_remaining > token_budget:
                break  # the whole prompt must fit in one step
            num_new = min(num_remaining, token_budget, cap or token_budget)
            # Room for all its tokens, not just this chunk, or it would soon preempt others.
            if not self.block_manager.allocate_slots(req, num_new, computed_blocks,
                                                     full_sequence_must_fit=True):
                break  # no room without preempting; running requests come first
            self.waiting.pop()
            self._start_running(req, num_cached)
            out.admitted.append(req)
            self._add_to_output(req, num_new, out)
            token_budget -= num_new
        return out

    def _can_admit(self, req: Request) -> bool:
        return len(self.running) < self.config.max_num_seqs

    def _start_running(self, req: Request, num_cached_tokens: int) -> None:
        req.num_computed_tokens = num_cached_tokens
        if req.status == RequestStatus.WAITING:  # the first admission, not a resumption
            req.num_cached_tokens = num_cached_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    @staticmethod
    def _add_to_output(req: Request, num_new: int, out: SchedulerOutput) -> None:
        """The one place that decides if a row samples (reaches the last known token), decodes."""
        samples = req.num_computed_tokens + num_new == req.num_tokens
        decode = num_new == 1 and req.num_computed_tokens >= req.num_prompt_tokens
        out.scheduled.append(ScheduledRequest(req, num_new, samples, decode))

    def _pick_victim(self) -> Request:
        """§6.3. FCFS: the last to join `running`. PRIORITY: least important, latest arrival."""
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt_request(self, victim: Request, out: SchedulerOutput) -> int:
        """Drop its blocks and KV, requeue it in front; return the budget it held this step."""
        self.running.remove(victim)
        self.block_manager.free(victim)
        victim.num_computed_tokens, victim.status = 0, RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(victim)
        out.preempted.append(victim)
        for entry in out.scheduled:
            if entry.request is victim:  # PRIORITY can evict a request scheduled before
                out.scheduled.remove(entry)
                return entry.num_new_tokens
        return 0

    def update_from_output(self, out: SchedulerOutput,
                           sampled_token_ids: dict[str, int | str]) -> list[Request]:
        """§4, process the step's output: advance each scheduled request, append its sampled
        token, check stops, release finished requests. Returns those that left this step."""
        now = time.monotonic()
        finished: list[Request] = []
        for entry in out.scheduled:
            req = entry.request
            req.num_computed_tokens += entry.num_new_tokens
            self.block_manager.cache_full_blocks(req)
            if not entry.samples:
                continue  # a prefill chunk: nothing sampled yet
            token = sampled_token_ids[req.request_id]
            if isinstance(token, str):  # the sampler failed this row: only this request ends
                req.error, reason = token, FinishReason.ERROR
            else:
                req.token_ids.append(token)
                req.first_token_time = req.first_token_time or now
                reason = self._check_stop(req)
            if reason is not None:
                req.status, req.finish_reason, req.finish_time = RequestStatus.FINISHED, reason, now
                finished.append(req)
        if finished:
            self.running = deque(r for r in self.running if not r.is_finished)
        return self._release(finished)

    def _release(self, finished: list[Request]) -> list[Request]:
        """§3: a finished request frees its blocks at once, for the next step to use."""
        for req in finished:
            self.block_manager.free(req)
        return finished

    def _check_stop(self, req: Request) -> FinishReason | None:
        """EOS, a stop token or a stop string (vLLM's order: before the length limits)."""
        params, last = req.sampling_params, req.token_ids[-1]
        if (not params.ignore_eos and last in req.eos_token_ids) or last in params.stop_token_ids:
            return FinishReason.STOP
        if params.stop and self.stop_string_in is not None and self.stop_string_in(req):
            return FinishReason.STOP
        if (params.max_tokens is not None and req.num_output_tokens >= params.max_tokens
                or req.num_tokens >= self.max_model_len_in_cache):  # max_tokens None: the context
            return FinishReason.LENGTH
        return None

    def finish_request(self, request_id: str, reason: FinishReason,
                       drop_finished: bool = False) -> Request | None:
        """End a waiting, running or preempted request from outside the step (an abort), freeing
        its blocks at once; unknown or finished ids: no-op, None."""
        for req in self.running:
            if req.request_id == request_id:
                self.running.remove(req)
                self.block_manager.free(req)
                break
        else:  # not running: waiting (or preempted), or unknown
            req = self.waiting.remove(request_id)
            if req is None:
                return None
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        req.finish_time = time.monotonic()
        return req

