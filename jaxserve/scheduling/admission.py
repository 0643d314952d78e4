"""Admission: which waiting requests start, and whether a request may be queued at all.

Waiting requests start in order of importance (request_queue.py) while a slot, the token budget
and pages allow, each with its first prefill chunk; the head of the queue blocks the rest, since
passing it for smaller ones could starve it. With the prefix cache a request starts after its
cached pages (prefix_sharing.py: those on the device, then those restored from the host tier,
offload.py), a swapped request after its own restored pages, and the budget counts only what is
left to compute; one that waits for pages another request is computing now is passed for this
step, not waited on. Under the priority policy a request that finds no room preempts less
important running ones (preemption.py). `check_fits` refuses at submission what could never be
admitted.
"""

from __future__ import annotations

import heapq

from jaxserve.scheduling.batching import ContinuousBatching
from jaxserve.scheduling.kv_cache_manager import KVCacheManager
from jaxserve.scheduling.lora_slots import LoraSlots
from jaxserve.scheduling.offload import Offload
from jaxserve.scheduling.preemption import Preemption
from jaxserve.scheduling.prefix_sharing import PrefixSharing
from jaxserve.scheduling.request import Request, RequestStatus
from jaxserve.scheduling.step_plan import StepPlan
from jaxserve.scheduling.types import RequestRejected, SchedulerConfig


class Admission:
    """Starts waiting requests: a slot, pages and a first chunk for each, in order."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        *,
        prefix: PrefixSharing | None,
        batching: ContinuousBatching,
        preemption: Preemption,
        offload: Offload,
        running: list[Request],
        free_slots: list[int],
        lora_slots: LoraSlots | None = None,
    ):
        self.config = config
        self.kv = kv
        self.prefix = prefix  # None: the prefix cache is off
        self.batching = batching
        self.preemption = preemption
        self.offload = offload  # swapped requests' pages and the host tier of the prefix cache
        self.running = running  # the scheduler's, in admission order: admitted ones join it
        self.free_slots = free_slots  # the scheduler's heap of free slots, lowest first
        self.lora_slots = lora_slots  # adapters' device slots; None: no adapters served
        # Only a waiting request under the priority policy, continuously batched, preempts.
        self._may_preempt = config.policy == "priority" and config.batching == "continuous"

    def admit(self, plan: StepPlan, now: float) -> None:
        """Starts waiting requests in order while a slot, the budget and pages allow."""
        queue = self.batching.admitting()
        if queue is None:
            return
        # Requests waiting for pages another request is computing, set aside for this step.
        set_aside: list[tuple[tuple, Request]] = []
        try:
            self._admit_from(queue, plan, now, set_aside)
        finally:
            for key, req in set_aside:  # back in their places, first at the next admission
                queue.push(key, req)

    def _admit_from(self, queue, plan: StepPlan, now: float, set_aside: list) -> None:
        """`admit`'s loop over `queue`; waiters for shared pages go to `set_aside`."""
        prefix = self.prefix
        while queue and plan.budget > 0:
            req = queue.peek()
            # Made room in this step, or preempted while a step in flight samples for it (it
            # recomputes its outputs, so it waits until they are known): not back yet.
            if req.request_id in plan.preempted or req.num_pending:
                return
            swapped = self.offload.host.is_swapped(req.request_id)
            hit = [] if prefix is None or swapped else prefix.match(req)
            # The prefix continues in the host tier past the device's pages: restored, not run.
            host_hit = [] if prefix is None or swapped else self.offload.match_host(req, len(hit))
            if prefix is not None and not swapped and prefix.waits(req, hit + host_hit):
                # It waits for another request's pages, not for room: those behind it go
                # ahead (they take nothing it waits for), and it is first again next step.
                set_aside.append(queue.pop_entry())
                continue
            lora = req.lora_name
            if lora is not None and not self.lora_slots.can_acquire(lora):
                # Every adapter slot is pinned by running requests of other adapters: it waits
                # for one to finish, and those behind it that need no new slot go ahead.
                set_aside.append(queue.pop_entry())
                continue
            # A swapped request continues where it stopped, its pages restored.
            ps = self.config.page_size
            computed = req.num_computed_tokens if swapped else (len(hit) + len(host_hit)) * ps
            # A partial page to copy after the cached ones (a beam's parent's, a sibling's).
            fork = None if prefix is None or swapped or host_hit else prefix.match_partial(req, hit)
            if fork is not None:
                n = plan.chunk_len(req, computed + fork[1])
                if n and self._room_now(computed + fork[1] + n, hit, fork[0]):
                    computed += fork[1]
                else:  # only where it fits as it is: a preemption might free its source
                    fork = None
            # The budget counts only the tokens still to compute, not those the cache serves.
            n = plan.chunk_len(req, computed)
            # Head of line blocks the rest: skipping it for smaller ones could starve it.
            if not n or not self._make_room(req, computed + n, hit, plan, fork):
                return
            queue.pop()
            if fork is not None:  # the engine copies it on the device before this step
                dst = self.kv.table_of(req.request_id)[len(hit)]
                plan.page_copies.append((fork[0], dst))
                self.offload.forked(dst)
                prefix.admitted_fork(fork[1])
            if swapped:
                self.offload.restore(req)
            else:
                if host_hit:
                    self.offload.restore_hits(req, len(hit), host_hit)
                self.offload.readmitted(req, computed)
                if prefix is not None:
                    prefix.admitted(req, len(hit) + len(host_hit), forked=fork is not None)
                    self.offload.stats.device_hits += len(hit) * ps
                    self.offload.stats.host_hits += len(host_hit) * ps
            req.num_computed_tokens = computed
            if req.num_cached_tokens is None:
                req.num_cached_tokens = min(computed, req.num_prompt_tokens)
            req.status = RequestStatus.RUNNING
            req.slot = heapq.heappop(self.free_slots)
            if lora is not None:
                req.lora_slot, load = self.lora_slots.acquire(lora)
                if load:  # the engine writes its weights there before this step runs
                    plan.lora_loads.append((req.lora_slot, lora))
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.running.append(req)
            # A restored one runs from the next step, once its pages are back (offload.py).
            if not (swapped or host_hit):
                plan.add_chunk(req, n)

    def _room_now(self, num_tokens: int, hit: list[int], fork: int) -> bool:
        """Whether a slot and the pages of `num_tokens` after the cached pages `hit`, the
        cached partial page `fork` kept, are free without preempting anyone."""
        kv = self.kv
        reclaimed = sum(kv.ref_count(p) == 0 for p in [*kv.prefix_pages(hit), fork])
        need = kv.fresh_pages(num_tokens, len(hit))
        return bool(self.free_slots) and need <= kv.num_free_pages - reclaimed

    def _make_room(
        self,
        req: Request,
        num_tokens: int,
        hit: list[int],
        plan: StepPlan,
        fork: tuple[int, int] | None = None,
    ) -> bool:
        """A slot and the pages of `num_tokens` for waiting `req`, allocated, starting with the
        cached pages `hit` (and a fresh page to copy the partial page `fork` into, which
        `_room_now` found room for); False changes nothing.

        Under the priority policy (continuous batching) it may preempt running requests less
        important than `req` (Preemption.victims_for).
        """
        if fork is not None:
            allocated = self.kv.allocate(req.request_id, num_tokens, prefix=hit, fork=fork[0])
            assert allocated, "the free pages were counted by _room_now"
            return True
        need_slot = not self.free_slots
        kv = self.kv
        reclaimed = sum(kv.ref_count(p) == 0 for p in kv.prefix_pages(hit))  # cached: not free
        need_pages = kv.fresh_pages(num_tokens, len(hit)) - (kv.num_free_pages - reclaimed)
        if need_slot or need_pages > 0:
            if not self._may_preempt:
                return False
            victims = self.preemption.victims_for(req, need_slot, need_pages, hit)
            if victims is None:
                return False
            for victim in victims:
                self.preemption.preempt(victim, plan)
        allocated = self.kv.allocate(req.request_id, num_tokens, prefix=hit)
        assert allocated, "the free pages were counted above"
        return True


def check_fits(req: Request, config: SchedulerConfig, kv: KVCacheManager) -> None:
    """Raises RequestRejected when `req` could never be admitted: longer than max_model_len,
    or needing more pages than the whole pool."""
    rid = req.request_id
    if req.lora_name is not None and not config.max_loras:
        raise RequestRejected(
            f"Request {rid!r} names adapter {req.lora_name!r}, but this engine serves no "
            f"adapters (max_loras=0)."
        )
    if req.max_num_tokens > config.max_model_len:
        raise RequestRejected(
            f"Request {rid!r} asks for {req.num_prompt_tokens} prompt + "
            f"{req.sampling_params.max_tokens} output tokens = {req.max_num_tokens}, more "
            f"than max_model_len={config.max_model_len}."
        )
    # The last sampled token is never run through the model, so it needs no cache slot.
    pages = kv.max_pages_held(req.max_num_tokens - 1, config.max_num_batched_tokens)
    if pages > config.num_pages:
        raise RequestRejected(
            f"Request {rid!r} may need {pages} KV pages of {config.page_size} tokens, more than "
            f"the whole pool of num_pages={config.num_pages}."
        )
