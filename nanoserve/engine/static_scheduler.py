"""§2: static batching, the baseline continuous batching is measured against. Same BlockManager,
Request and running loop as `Scheduler`; only admission and release differ, as in HF `generate`: a
batch is admitted whole after the previous one left, and a finished request keeps its seat and
blocks, its row still computed (an "idle row", pure waste) till the batch ends."""

from __future__ import annotations

import time

from nanoserve.config import EngineConfig
from nanoserve.engine.request import FinishReason, Request
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput


class StaticScheduler(Scheduler):
    def __init__(self, config: EngineConfig, num_kv_blocks: int, block_size: int) -> None:
        super().__init__(config, num_kv_blocks, block_size)
        self.idle_rows: list[Request] = []  # finished, waiting for their batch to end

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or bool(self.idle_rows)

    def schedule(self) -> SchedulerOutput:
        admitted = self._admit_batch() if not self.running and not self.idle_rows else []
        out = super().schedule()  # the running loop; `_can_admit` keeps waiting out
        out.admitted, out.idle_rows = admitted, list(self.idle_rows)
        return out

    def _admit_batch(self) -> list[Request]:
        """Up to max_num_seqs requests at once, whatever the budget (it chunks their prefills)."""
        admitted = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            computed_blocks, num_cached = self.block_manager.get_computed_blocks(req)
            if not self.block_manager.allocate_slots(req, 0, computed_blocks):
                break
            self.waiting.pop()
            self._start_running(req, num_cached)
            admitted.append(req)
        return admitted

    def _can_admit(self, req: Request) -> bool:
        return False  # nobody joins a batch once it runs

    def _release(self, finished: list[Request]) -> list[Request]:
        """Finished rows keep their blocks until the whole batch leaves together."""
        self.idle_rows += finished
        if self.running:
            return []
        batch, self.idle_rows = self.idle_rows, []
        now = time.monotonic()
        for req in batch:
            req.finish_time = now  # the user gets the output only now
            self.block_manager.free(req)
        return batch

    def finish_request(self, request_id: str, reason: FinishReason,
                       drop_finished: bool = False) -> Request | None:
        """Ending a finished row waiting for its batch is a no-op (None): it leaves with its
        batch, unless `drop_finished` (a failed generate()) removes it and frees its blocks."""
        for req in self.idle_rows:
            if req.request_id == request_id:
                if drop_finished:
                    self.idle_rows.remove(req)
                    self.block_manager.free(req)
                return None
        return super().finish_request(request_id, reason)

