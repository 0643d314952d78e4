"""Host bookkeeping of the KV pages kept in host memory: swapped requests and the host tier.

The device pool is small; host memory is 10-100x larger. This class hands out host page numbers
0..num_pages-1 the way `KVCacheManager` hands out device ones, and records what each holds; the
runtime (`runtime/kv_transfer.py`) owns the bytes and copies pages between the two pools as the
scheduler's plans say (`SchedulerOutput.swap_out` / `swap_in`). Plain Python, no jax.

A host page is in exactly one of three states:

- swapped: part of a preempted request's saved pages (`hold`), until it is restored or ends;
- cached: the host tier of the prefix cache. A published page evicted from the device pool
  keeps its hash here (`offer`), so a later request whose prefix reaches it restores it instead
  of recomputing it. Least recently used first out, only when a fresh page is needed;
- free: holds nothing worth keeping.

so `swapped + cached + free == num_pages` always. Swapped pages are never evicted: a swap that
finds no room is not made (the victim recomputes instead).

Ordering (why a page is never both reused and in flight): the engine runs a plan's copies in a
fixed order, host reads (restores) before host writes (saves), device reads (saves) before
device writes (restores), all before the step, and host writes land in the order made. So a page
freed in a plan may be handed out again in the same plan.

With KV events on (`events`, scheduling/kv_events.py) the host tier is the "CPU" medium: a page
saved into it (`offer`), evicted from it (`_take`) or dropped (`drop_cached`) is recorded there.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from jaxserve.scheduling.kv_events import MEDIUM_HOST, KVEventLog


@dataclasses.dataclass
class OffloadStats:
    """Counters of the host pool since start: swaps, the host tier, and recomputed work."""

    swap_preemptions: int = 0  # victims whose pages went to the host
    recompute_preemptions: int = 0  # victims whose pages were dropped
    pages_swapped_out: int = 0  # device -> host copies of swapped requests' pages
    pages_swapped_in: int = 0  # host -> device copies restoring swapped requests
    pages_offloaded: int = 0  # device -> host copies of evicted published pages (host tier)
    host_hits: int = 0  # prompt tokens served from the host tier (restored, not computed)
    device_hits: int = 0  # prompt tokens served from pages still on the device
    host_evictions: int = 0  # host-tier pages dropped for fresh ones
    recomputed_tokens: int = 0  # tokens computed again after a preemption dropped them


class HostPagePool:
    """Host page numbers, which request's saved pages each holds, and the host prefix tier."""

    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"The host KV pool needs num_pages >= 0, not {num_pages}.")
        self.num_pages = num_pages
        # Pages never handed out yet are not listed: a pool of millions of pages costs nothing
        # until used. `_free` holds pages given back; `_fresh` is the next never-used one.
        self._fresh = 0
        self._free: list[int] = []
        self._cached: collections.OrderedDict[int, bytes] = collections.OrderedDict()  # LRU first
        self._page_of: dict[bytes, int] = {}  # hash -> cached host page
        self._swapped: dict[str, list[int]] = {}  # request id -> its saved pages, in table order
        self._num_swapped = 0  # pages in _swapped, kept so the engine's gauges cost nothing
        self.stats = OffloadStats()
        # The host tier's changes, for KV-aware routers (kv_events.py); None: off.
        self.events: KVEventLog | None = None

    # ---- gauges ---------------------------------------------------------------------------

    @property
    def num_swapped_pages(self) -> int:
        return self._num_swapped

    @property
    def num_cached_pages(self) -> int:
        return len(self._cached)

    @property
    def num_used_pages(self) -> int:
        """Pages holding something: swapped or cached."""
        return self._fresh - len(self._free)

    @property
    def num_available(self) -> int:
        """Pages a save may take: free, never used, or cached (evicted for it)."""
        return self.num_pages - self._fresh + len(self._free) + len(self._cached)

    def cached_hashes(self) -> list[bytes]:
        """The hashes the host tier holds now: the set its KV events tell subscribers of."""
        return list(self._page_of)

    def drop_cached(self) -> int:
        """Frees every host-tier page (their keys and values came from weights no longer
        served, Engine.update_weights); swapped pages stay. Returns the pages dropped."""
        dropped = len(self._cached)
        if self.events is not None:
            self.events.removed(list(self._page_of), MEDIUM_HOST)
        self._free.extend(self._cached)
        self._cached.clear()
        self._page_of.clear()
        return dropped

    # ---- swapped requests -----------------------------------------------------------------

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def swapped_ids(self) -> list[str]:
        """Requests holding saved pages."""
        return list(self._swapped)

    def swapped_pages(self, request_id: str) -> list[int]:
        """The request's saved host pages in table order (empty when it holds none)."""
        return list(self._swapped.get(request_id, ()))

    def hold(self, request_id: str, num_pages: int) -> list[int] | None:
        """Fresh host pages for `num_pages` pages of a request being swapped out, evicting host
        tier pages if needed; None (changing nothing) when even that is not enough."""
        if request_id in self._swapped:
            raise ValueError(f"Request {request_id!r} already holds swapped host pages.")
        if num_pages > self.num_available:
            return None
        pages = [self._take() for _ in range(num_pages)]
        self._swapped[request_id] = pages
        self._num_swapped += num_pages
        return pages

    def release(self, request_id: str) -> list[int]:
        """Frees a request's saved pages (restored, or the request ended); returns them."""
        pages = self._swapped.pop(request_id, [])
        self._num_swapped -= len(pages)
        self._free.extend(reversed(pages))
        return pages

    # ---- the host tier of the prefix cache ------------------------------------------------

    def offer(self, page_hash: bytes) -> int | None:
        """A host page to save an evicted device page published under `page_hash` into, or None
        when it is kept already (then only refreshed) or no page is free or evictable."""
        page = self._page_of.get(page_hash)
        if page is not None:
            self._cached.move_to_end(page)
            return None
        if not self.num_available:
            return None
        page = self._take()
        self._cached[page] = page_hash
        self._page_of[page_hash] = page
        if self.events is not None:
            self.events.copied(page_hash, MEDIUM_HOST)
        return page

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Host pages holding the longest run of `hashes` from its start (whole pages); each
        found page becomes the most recently used."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            self._cached.move_to_end(page)
            pages.append(page)
        return pages

    def _take(self) -> int:
        """A page with nothing worth keeping: a free one, a never-used one, else the least
        recently used host-tier page."""
        if self._free:
            return self._free.pop()
        if self._fresh < self.num_pages:
            self._fresh += 1
            return self._fresh - 1
        page, page_hash = self._cached.popitem(last=False)
        del self._page_of[page_hash]
        self.stats.host_evictions += 1
        if self.events is not None:
            self.events.removed([page_hash], MEDIUM_HOST)
        return page

    def check_invariants(self) -> None:
        """Raises AssertionError unless every host page handed out is swapped, cached or free
        exactly once, and the hash index matches the cached pages."""
        swapped = [p for pages in self._swapped.values() for p in pages]
        if len(swapped) != self._num_swapped:
            raise AssertionError(f"{len(swapped)} swapped host pages, counted {self._num_swapped}.")
        every = swapped + list(self._cached) + self._free
        if sorted(every) != list(range(self._fresh)) or self._fresh > self.num_pages:
            raise AssertionError(
                f"Host KV pages leaked or doubled: {len(swapped)} swapped + {len(self._cached)} "
                f"cached + {len(self._free)} free != {self._fresh} handed out (of "
                f"{self.num_pages})."
            )
        if {h: p for p, h in self._cached.items()} != self._page_of:
            raise AssertionError("The host tier's hash index disagrees with its cached pages.")
