"""Batching modes: who may join a step. Continuous batching serves; static and dynamic compare.

Continuous batching (the engine's mode) lets any waiting request join any step. Static and
dynamic batching, kept to measure continuous batching against, admit fixed groups of up to
`batch_size` requests that run until all members finish: static forms a group whenever the last
one is done, dynamic also waits for a full group unless its oldest request has waited
`dynamic_timeout_s`. All three emit the same plans, so one runner serves them all. Each mode owns
the waiting queues; the scheduler asks it which queue admission takes from and where a preempted
request waits.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterator, Mapping

from jaxserve.scheduling.request import Request
from jaxserve.scheduling.request_queue import WaitQueue
from jaxserve.scheduling.types import SchedulerConfig


class ContinuousBatching:
    """Every waiting request may join any step, in order of importance."""

    def __init__(self):
        self.waiting = WaitQueue()

    def __len__(self) -> int:
        return len(self.waiting)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.waiting)

    def lora_counts(self) -> collections.Counter[str]:
        """Waiting requests of each adapter they name (each queue counts its own)."""
        return self.waiting.lora_counts

    def form_group(self, now: float, keys: Mapping[str, tuple]) -> None:
        """Nothing to form: continuous batching has no groups."""

    def admitting(self) -> WaitQueue | None:
        """The queue admission starts requests from now; None: none may start."""
        return self.waiting

    def requeue(self) -> WaitQueue:
        """The queue a preempted request waits in."""
        return self.waiting

    def slots_open(self, free: int) -> int:
        """How many of the `free` slots the next schedule() may give to waiting requests."""
        return free

    def remove(self, req: Request) -> None:
        """Takes a queued request that finished out of its queue."""
        self.waiting.remove(req)

    def finished(self, request_id: str) -> None:
        """Notes that a request finished (queued or running)."""


class GroupBatching(ContinuousBatching):
    """Static (`timeout_s` None) or dynamic batching: fixed groups of up to `batch_size`."""

    def __init__(self, batch_size: int, timeout_s: float | None):
        super().__init__()
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        # Ids of the current group's unfinished members, and those of them that wait for
        # (re)admission. None: no group yet.
        self.group: set[str] | None = None
        self.group_waiting = WaitQueue()

    def __len__(self) -> int:
        return len(self.waiting) + len(self.group_waiting)

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain(self.waiting, self.group_waiting)

    def lora_counts(self) -> collections.Counter[str]:
        return self.waiting.lora_counts + self.group_waiting.lora_counts

    def form_group(self, now: float, keys: Mapping[str, tuple]) -> None:
        """The next group forms only when the last one is done (dynamic: when it is full, or
        its oldest request has waited timeout_s)."""
        if self.group or not self.waiting:
            return
        if self.timeout_s is not None and len(self.waiting) < self.batch_size:
            oldest = min(req.arrival_time for req in self.waiting)
            if now - oldest < self.timeout_s:
                return
        self.group = set()
        while self.waiting and len(self.group) < self.batch_size:
            req = self.waiting.pop()
            self.group.add(req.request_id)
            self.group_waiting.push(keys[req.request_id], req)

    def admitting(self) -> WaitQueue | None:
        return self.group_waiting if self.group else None

    def requeue(self) -> WaitQueue:
        return self.group_waiting if self.group is not None else self.waiting

    def slots_open(self, free: int) -> int:
        # Free slots are filled only when the next group forms.
        return 0 if self.group else min(free, self.batch_size)

    def remove(self, req: Request) -> None:
        if not self.waiting.remove(req):
            self.group_waiting.remove(req)

    def finished(self, request_id: str) -> None:
        if self.group is not None:
            self.group.discard(request_id)


def batching_of(config: SchedulerConfig) -> ContinuousBatching:
    """The batching mode `config.batching` names."""
    if config.batching == "continuous":
        return ContinuousBatching()
    timeout = config.dynamic_timeout_s if config.batching == "dynamic" else None
    return GroupBatching(config.batch_size, timeout)
