"""The scheduler's books checked against each other: what tests assert after every step.

Kept out of the scheduler because serving never runs it: it walks every request and page.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from jaxserve.scheduling.host_pool import HostPagePool
from jaxserve.scheduling.kv_cache_manager import KVCacheManager
from jaxserve.scheduling.prefix_sharing import PrefixSharing
from jaxserve.scheduling.request import Request, RequestStatus


def check_invariants(
    *,
    kv: KVCacheManager,
    host: HostPagePool,
    prefix: PrefixSharing | None,
    running: list[Request],
    free_slots: list[int],
    queued: Iterable[Request],
    unfinished: Collection[str],
    max_num_seqs: int,
) -> None:
    """Raises AssertionError if the books disagree: pages, slots, running and queued requests,
    the pages being computed, and the ids of the `unfinished` requests."""
    kv.check_invariants()
    host.check_invariants()
    slots = [r.slot for r in running]
    if sorted(slots + free_slots) != list(range(max_num_seqs)):
        raise AssertionError(f"Slots {slots} in use and {free_slots} free disagree.")
    for req in running:
        pages = kv.num_pages_of(req.request_id)
        if req.status != RequestStatus.RUNNING or pages < kv.pages_for(req.num_computed_tokens):
            raise AssertionError(
                f"Running request {req.request_id!r} is {req.status!r} and holds {pages} pages "
                f"for {req.num_computed_tokens} computed tokens."
            )
    queued = list(queued)
    for req in queued:
        if req.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            raise AssertionError(f"Queued request {req.request_id!r} is {req.status!r}.")
        if req.slot is not None or kv.num_pages_of(req.request_id):
            raise AssertionError(f"Queued request {req.request_id!r} holds a slot or pages.")
        # Only a swapped request keeps its computed tokens, in exactly the host pages they need.
        saved = len(host.swapped_pages(req.request_id))
        if saved != kv.pages_for(req.num_computed_tokens):
            raise AssertionError(
                f"Queued request {req.request_id!r} has {req.num_computed_tokens} computed "
                f"tokens but {saved} swapped host pages."
            )
    if prefix is not None:
        prefix.check_invariants()
    ids = [r.request_id for r in [*running, *queued]]
    queued_ids = {r.request_id for r in queued}
    stray = [rid for rid in host.swapped_ids() if rid not in queued_ids]
    if stray:
        raise AssertionError(f"Requests {stray} hold swapped host pages but are not queued.")
    if len(ids) != len(set(ids)) or set(ids) != set(unfinished):
        raise AssertionError(
            f"Every unfinished request must be running or queued, once: running or queued "
            f"{sorted(ids)}, unfinished {sorted(unfinished)}."
        )
