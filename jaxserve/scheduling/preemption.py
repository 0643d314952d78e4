"""Preemption: freeing the least important running requests when pages or slots run out.

A victim gives back its pages and slot and waits again under its old key (request_queue.py), to
recompute its prompt and outputs later, or, when the host pool takes its pages (offload.py), to
restore them and continue; the outputs it produced are kept either way. Two needs preempt: a
running request that needs a page when none is left (`allocate_or_preempt`, any policy), and,
under the priority policy, a waiting request that finds no slot or pages and is more important
than enough running requests (`victims_for`, which admission then preempts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxserve.scheduling.kv_cache_manager import KVCacheManager
from jaxserve.scheduling.offload import Offload
from jaxserve.scheduling.request import Request, RequestStatus
from jaxserve.scheduling.step_plan import StepPlan


class Preemption:
    """Chooses victims by key (highest first) and sends them back to wait."""

    def __init__(
        self,
        kv: KVCacheManager,
        running: list[Request],
        keys: dict[str, tuple],
        *,
        release: Callable[[Request], None],
        requeue: Callable[[Request], None],
        offload: Offload,
    ):
        self.kv = kv
        self.running = running  # the scheduler's running requests, in admission order
        self.keys = keys  # every unfinished request's key, by id
        self._release = release  # gives back a running request's pages and slot
        self._requeue = requeue  # queues a preempted request under its key
        self.offload = offload  # saves a victim's pages to the host when that is cheaper
        self.num_preemptions = 0  # total, for metrics

    def allocate_or_preempt(self, req: Request, num_tokens: int, plan: StepPlan) -> bool:
        """Pages for `req`, preempting the least important running requests until they fit.

        Returns False when `req` itself was the least important and got preempted. It always
        fits alone: add_request refused anything larger than the pool.
        """
        while not self.kv.allocate(req.request_id, num_tokens):
            victim = max(self.running, key=lambda r: self.keys[r.request_id])
            self.preempt(victim, plan)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request, plan: StepPlan) -> None:
        """Frees running `req`'s pages and slot, unplans it and queues it to be restored or
        recomputed later."""
        swapped = self.offload.save(req)  # reads its table: before the release drops it
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        if not swapped:
            req.num_computed_tokens = 0  # recompute prompt + outputs; the outputs are kept
        req.num_preemptions += 1
        self.num_preemptions += 1
        plan.drop(req.request_id)
        plan.preempted.append(req.request_id)
        self._requeue(req)

    def victims_for(
        self, req: Request, need_slot: bool, need_pages: int, hit: Sequence[int]
    ) -> list[Request] | None:
        """Running requests less important than waiting `req` whose preemption frees a slot
        (if `need_slot`) and `need_pages` pages, least important first; None when those are
        not enough: preempting without then admitting would only waste their work.

        A victim's pages count only if no one else holds them and `req` is not about to reuse
        them (`hit`, its cached prefix).
        """
        key = self.keys[req.request_id]
        victims = []
        for victim in sorted(self.running, key=lambda r: self.keys[r.request_id])[::-1]:
            if self.keys[victim.request_id] <= key or not (need_slot or need_pages > 0):
                break
            victims.append(victim)
            need_slot = False
            need_pages -= self.kv.num_private_pages(victim.request_id, exclude=hit)
        if need_slot or need_pages > 0:
            return None
        return victims
