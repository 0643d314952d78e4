"""KV beyond the device pool: swap-or-recompute preemption, and the host tier of the prefix cache.

The scheduler decides, the runtime copies. While a plan is made this class records which pages
move (`swap_out`: device page -> host page, `swap_in`: host page -> device page); the plan
carries them (`SchedulerOutput`) and the engine copies them as it dispatches the step
(runtime/kv_transfer.py), in the order host_pool.py's docstring gives. A restored request runs
from the next plan on: its pages are written before that plan's step, so its copy gates it
alone. Three moves:

- a preempted request's computed pages go to the host when that is cheaper than computing its
  tokens again (`preemption="auto"`, priced by `SwapPricer`), or always (`"swap"`); it waits
  with its `num_computed_tokens` kept, and on readmission its pages come back and it continues
  where it stopped;
- a published page the device evicts is saved to the host tier (when the host pool has room);
- a request whose prefix continues in the host tier past the device's cached pages gets those
  pages restored instead of computing them.

A victim recomputes when the host pool cannot hold its pages. Plain Python, no jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxserve.scheduling.cost_model import CostModel, work_of
from jaxserve.scheduling.host_pool import HostPagePool
from jaxserve.scheduling.kv_cache_manager import KVCacheManager
from jaxserve.scheduling.request import Request
from jaxserve.scheduling.types import PREEMPTION_MODES


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwapPricer:
    """What a swap and a recompute cost, in seconds, for `preemption="auto"`.

    The engine measures the host bandwidth at warm-up and prices a prefill by the step-cost model
    (or a timed step); tests hand in their own numbers.
    """

    bytes_per_page: int  # one page over all layers, keys and values
    host_bytes_per_s: float  # measured device -> host -> device copy rate
    prefill_seconds: Callable[[int], float]  # seconds to compute this many tokens again

    def swap_is_cheaper(self, num_pages: int, num_tokens: int) -> bool:
        """Copying `num_pages` out and back beats computing `num_tokens` again."""
        swap = 2 * num_pages * self.bytes_per_page / self.host_bytes_per_s
        return swap < self.prefill_seconds(num_tokens)


class Offload:
    """The host pool's side of one scheduler: decides swaps and records a plan's copies."""

    def __init__(self, kv: KVCacheManager, host: HostPagePool, mode: str, page_size: int):
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption={mode!r} must be one of {PREEMPTION_MODES}.")
        if mode != "recompute" and not host.num_pages:
            raise ValueError(
                f"preemption={mode!r} needs a host KV pool, but it has {host.num_pages} pages."
            )
        self.kv = kv
        self.host = host
        self.mode = mode
        self.page_size = page_size
        self.pricer: SwapPricer | None = None  # None under "auto": always swap when it fits
        self.stats = host.stats
        # The current plan's copies, taken by `take_copies` when the plan is done.
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        # Device pages this plan restores or forks into: written after its saves' reads.
        self._restored: set[int] = set()
        # Host pages this plan writes: read only from the next plan on, since the engine makes a
        # plan's host reads before its host writes.
        self._written: set[int] = set()
        self._lost: dict[str, int] = {}  # tokens each recomputing victim had computed
        if host.num_pages:
            kv.on_evict = self._save_evicted

    def take_copies(self) -> dict[str, list[tuple[int, int]]]:
        """The plan's copies by SchedulerOutput field; starts the next plan's lists."""
        copies = dict(swap_out=self.swap_out, swap_in=self.swap_in)
        self.swap_out, self.swap_in = [], []
        # A restored page is written before the next plan's copies: no guard needed then.
        self._restored, self._written = set(), set()
        return copies

    # ---- preemption -----------------------------------------------------------------------

    def save(self, req: Request) -> bool:
        """Saves running `req`'s computed pages to the host if the mode and price say so and
        they fit; True when it did (it then keeps `num_computed_tokens`). Call before its device
        pages are freed."""
        computed = req.num_computed_tokens
        table = self.kv.table_of(req.request_id)[: self.kv.pages_for(computed)]
        swap = (
            self.mode != "recompute"
            and computed > 0
            and not self._restored.intersection(table)  # its copy back is not made yet
            and (
                self.mode == "swap"
                or self.pricer is None
                or self.pricer.swap_is_cheaper(len(table), computed)
            )
        )
        host_pages = self.host.hold(req.request_id, len(table)) if swap else None
        if host_pages is None:
            self.stats.recompute_preemptions += 1
            self._lost[req.request_id] = computed
            return False
        self.swap_out += zip(table, host_pages, strict=True)
        self._written.update(host_pages)
        self.stats.swap_preemptions += 1
        self.stats.pages_swapped_out += len(table)
        return True

    def restore(self, req: Request) -> None:
        """Queues the copy of swapped `req`'s saved pages into the first pages of its new
        device table (allocated already) and frees its host pages. The copy is written before
        the next plan's step: `req` runs from then on, and no other request waits for it."""
        table = self.kv.table_of(req.request_id)
        host_pages = self.host.release(req.request_id)
        self.swap_in += zip(host_pages, table, strict=False)
        self._restored.update(table[: len(host_pages)])
        self.stats.pages_swapped_in += len(host_pages)

    def forget(self, req: Request) -> None:
        """`req` ended: frees its saved host pages, if any (a copy out still in flight lands in
        a free page, harmlessly: later writes to it land after)."""
        self.host.release(req.request_id)
        self._lost.pop(req.request_id, None)

    def readmitted(self, req: Request, computed: int) -> None:
        """Counts the tokens a recomputing victim computes again (`computed` came from caches)."""
        lost = self._lost.pop(req.request_id, 0)
        self.stats.recomputed_tokens += max(0, lost - computed)

    # ---- the host tier --------------------------------------------------------------------

    def match_host(self, req: Request, num_hit: int) -> list[int]:
        """Host pages that continue `req`'s device prefix hit of `num_hit` pages, leaving at
        least its last token to compute."""
        if not self.host.num_pages:
            return []
        limit = (req.num_tokens - 1) // self.page_size
        pages = self.host.match(req.page_hashes[num_hit:limit])
        for i, page in enumerate(pages):
            if page in self._written:  # saved by this very plan: not on the host yet
                return pages[:i]
        return pages

    def restore_hits(self, req: Request, num_hit: int, host_pages: list[int]) -> None:
        """Queues the copy of `host_pages` into `req`'s device pages after its `num_hit` device
        hits (allocated already). They are published once `req` runs, like the pages it
        computes: until the next step they hold nothing, so no one else may match them now."""
        table = self.kv.table_of(req.request_id)
        dev = table[num_hit : num_hit + len(host_pages)]
        self.swap_in += zip(host_pages, dev, strict=True)
        self._restored.update(dev)

    def forked(self, page: int) -> None:
        """Device page `page` receives a forked partial page in this plan, copied after the
        plan's saves: until then it holds nothing to save (a request holding it that is
        preempted in this plan recomputes)."""
        self._restored.add(page)

    def _save_evicted(self, page: int, page_hash: bytes) -> None:
        """KVCacheManager's eviction hook: the evicted page's keys and values go to the host
        tier, unless a restore of this plan writes the page (its content is not there yet)."""
        if page in self._restored:
            return
        host_page = self.host.offer(page_hash)
        if host_page is not None:
            self.swap_out.append((page, host_page))
            self._written.add(host_page)
            self.stats.pages_offloaded += 1


def prefill_seconds_by(cost: CostModel, chunk: int) -> Callable[[int], float]:
    """Seconds to compute `n` tokens again as prefill chunks of `chunk` tokens (the step's token
    budget), each priced by the step-cost model alone in its step."""

    def seconds(n: int) -> float:
        total, start = 0.0, 0
        while start < n:
            k = min(chunk, n - start)
            total += cost.predict(work_of([(start, k)]))
            start += k
        return total

    return seconds
