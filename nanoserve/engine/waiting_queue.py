"""§6.1: the waiting queue, ordered by the scheduling policy. FCFS (and static): arrival order; a
preempted request goes back to the *front*, so it resumes before requests that never ran. PRIORITY:
smallest (priority, arrival_time) first, preempted or not."""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from nanoserve.engine.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: list[Request] = []

    def push(self, req: Request) -> None:
        self._queue.append(req)

    def push_front(self, req: Request) -> None:
        self._queue.insert(0, req)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.pop(0)

    def remove(self, request_id: str) -> Request | None:
        req = next((r for r in self._queue if r.request_id == request_id), None)
        if req is not None:
            self._queue.remove(req)
        return req

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue(FCFSQueue):
    def push(self, req: Request) -> None:
        # insort_right: after equal keys, so ties keep their push order.
        bisect.insort_right(self._queue, req, key=lambda r: (r.priority, r.arrival_time))

    push_front = push  # the order already decides where a preempted request goes
