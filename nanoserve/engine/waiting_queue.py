"""§6.1: the waiting queue, ordered by the scheduling policy.

FCFS (and static): arrival order; a preempted request goes back to the *front*, so it
resumes before requests that never ran. PRIORITY: smallest (priority, arrival_time)
first; a preempted request simply re-enters the heap, which puts it where it belongs.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from nanoserve.engine.sequence import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._queue.append(req)

    def push_front(self, req: Request) -> None:
        self._queue.appendleft(req)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request_id: str) -> Request | None:
        for req in self._queue:
            if req.request_id == request_id:
                self._queue.remove(req)
                return req
        return None

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()  # tie-breaker: Requests are not comparable

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._counter), req))

    push_front = push  # the heap order already decides where a preempted request goes

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request_id: str) -> Request | None:
        for i, entry in enumerate(self._heap):
            if entry[3].request_id == request_id:
                self._heap.pop(i)
                heapq.heapify(self._heap)  # O(n), but abort is rare
                return entry[3]
        return None

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
