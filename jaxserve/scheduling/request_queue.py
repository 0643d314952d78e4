"""The waiting queue, and the one order of importance that admission and preemption share.

Importance is one total order of keys, the same for admission and for choosing victims: fcfs
orders by arrival; priority by `arrival_time + priority * priority_aging_s` (lower first), that
is, every second of waiting improves a request by 1 / priority_aging_s levels. Keys never change,
so the order holds for requests that wait and run alike, and it bounds waiting: a request of
priority p that arrived at t comes before every request of priority >= q arriving after
t + (p - q) * priority_aging_s, which can then neither be admitted before it nor preempt it. Under
any steady load of priority q it therefore waits at most (p - q) * priority_aging_s plus the time
to serve the requests that arrived before that moment and come first. A preempted request keeps
its key, so it returns ahead of everything that came after it.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Iterator

from jaxserve.scheduling.request import Request


class ImportanceOrder:
    """Gives each request its key once, at submission: the lowest key is admitted first, and
    the highest is preempted first."""

    def __init__(self, policy: str, priority_aging_s: float | None):
        self._policy = policy
        self._aging = priority_aging_s
        self._counter = itertools.count()

    def key_of(self, req: Request) -> tuple:
        """A new key for `req` (module docstring); n breaks ties in order of submission."""
        n = next(self._counter)
        if self._policy != "priority":
            return (req.arrival_time, n)
        aging = self._aging
        if aging is None:
            return (req.priority, req.arrival_time, n)
        # arrival + priority * aging orders requests as `priority - wait / aging` does at any
        # one instant, without ever having to re-sort the queue as time passes.
        return (req.arrival_time + req.priority * aging, req.priority, n)


class WaitQueue:
    """Waiting requests, popped in key order (ImportanceOrder).

    A preempted request re-enters with its old key, so it goes back to the front: ahead of
    every request that arrived after it.
    """

    def __init__(self):
        self._heap: list[tuple[tuple, Request]] = []
        # Queued requests of each adapter, kept as they come and go so that the LoRA gauge
        # (engine/metrics.py) never walks the queue.
        self.lora_counts: collections.Counter[str] = collections.Counter()

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (req for _, req in self._heap)

    def in_order(self) -> list[Request]:
        """The requests in the order pop() would give them (keys are unique)."""
        return [req for _, req in sorted(self._heap)]

    def push(self, key: tuple, req: Request) -> None:
        """Queues `req` under `key`, its place in the order."""
        heapq.heappush(self._heap, (key, req))
        if req.lora_name is not None:
            self.lora_counts[req.lora_name] += 1

    def peek(self) -> Request:
        """The most important waiting request, left in the queue."""
        return self._heap[0][1]

    def pop(self) -> Request:
        """Takes the most important waiting request out of the queue."""
        return self.pop_entry()[1]

    def pop_entry(self) -> tuple[tuple, Request]:
        """Takes the most important waiting request out with its key, to `push` it back."""
        entry = heapq.heappop(self._heap)
        self._uncount(entry[1])
        return entry

    def remove(self, req: Request) -> bool:
        """O(n), but only aborts and stop strings of queued requests take this path."""
        for i, (_, queued) in enumerate(self._heap):
            if queued is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                self._uncount(req)
                return True
        return False

    def _uncount(self, req: Request) -> None:
        """`req` left the queue: one request fewer of its adapter."""
        name = req.lora_name
        if name is not None:
            self.lora_counts[name] -= 1
            if not self.lora_counts[name]:
                del self.lora_counts[name]
