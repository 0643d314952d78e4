"""What changed in the prefix cache, as events a KV-aware router can follow (docs/kv_events.md).

A router that sends each request to the replica already holding its prefix (vLLM's and llm-d's
KV indexers) learns what every replica caches from events in vLLM's schema: a page became
matchable (`BlockStored`), stopped being matchable (`BlockRemoved`), or every page went at once
(`AllBlocksCleared`). `KVCacheManager` and `HostPagePool` are the only places the cache changes,
so they record these events into a `KVEventLog` as they change it; the engine takes the log's
events once an iteration and publishes them (engine/kv_events.py). Neither holds a log unless
the engine publishes: with events off nothing is recorded at all.

Only full pages published under a hash are events: they are what `match` finds. A prompt's
partial page (copy on write, kv_cache_manager) is matched by its tokens inside one engine, and
vLLM's schema has no partial blocks, so it is never announced.

Two media, vLLM's names: "GPU" for the device pool, whatever the device (the tier vLLM's consumers
know as the accelerator's), and "CPU" for the host tier of the prefix cache (host_pool.py). The
log remembers each announced page's parent and tokens while some medium holds it, so a page that
moves to the host tier is announced there with the same tokens, and a removal is announced only
for a page it announced. Plain Python, no jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"

# How the events are laid out on the wire (engine/kv_events.py, docs/kv_events.md): "map", each
# event a map keyed by field name, as vLLM publishes since vllm-project/vllm#42892; "array",
# each event a positional array, as vLLM published before.
KV_EVENTS_FORMATS = ("map", "array")


def external_hash(page_hash: bytes) -> int:
    """A page hash as events carry it: the low 64 bits of the SHA-256 digest, an unsigned int,
    as vLLM sends its own block hashes by default (a 64-bit int is what indexers key on)."""
    return int.from_bytes(page_hash[-8:], "big")


@dataclasses.dataclass(frozen=True)
class BlockStored:
    """Consecutive pages of one sequence became matchable in `medium`: page i holds
    `token_ids[i * block_size : (i + 1) * block_size]`, and the first follows the page hashed
    `parent_block_hash` (None: it starts a sequence)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None
    medium: str


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    """These pages are no longer matchable in `medium` (evicted, or dropped)."""

    block_hashes: tuple[int, ...]
    medium: str


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    """Every page of every medium was dropped (new weights: Engine.update_weights, sleep)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclasses.dataclass
class _Page:
    parent: bytes | None
    tokens: tuple[int, ...]
    lora_name: str | None
    media: set[str]


class KVEventLog:
    """The events of the prefix cache since the engine last took them, and what each page it
    announced holds (to announce its move to another medium, or to resend everything)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._events: list[KVEvent] = []
        self._pages: dict[bytes, _Page] = {}  # announced and held by some medium, oldest first

    def __len__(self) -> int:
        return len(self._events)

    def take(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def stored(
        self,
        hashes: Sequence[bytes],
        parent: bytes | None,
        tokens: Sequence[int],
        lora_name: str | None = None,
        medium: str = MEDIUM_DEVICE,
    ) -> None:
        """Pages of one sequence, hashed `hashes` in order after the page hashed `parent`,
        holding `tokens` (page_size each), became matchable in `medium`."""
        if not hashes:
            return
        ps = self.page_size
        if len(tokens) != len(hashes) * ps:
            raise ValueError(
                f"{len(hashes)} pages of {ps} tokens cannot hold {len(tokens)} tokens."
            )
        tokens = tuple(int(t) for t in tokens)
        prev = parent
        for i, h in enumerate(hashes):
            page = self._pages.get(h)
            if page is None:
                self._pages[h] = _Page(prev, tokens[i * ps : (i + 1) * ps], lora_name, {medium})
            else:
                page.media.add(medium)
            prev = h
        self._events.append(
            BlockStored(
                block_hashes=tuple(external_hash(h) for h in hashes),
                parent_block_hash=None if parent is None else external_hash(parent),
                token_ids=tokens,
                block_size=ps,
                lora_name=lora_name,
                medium=medium,
            )
        )

    def copied(self, page_hash: bytes, medium: str) -> None:
        """A page announced in another medium is now matchable in `medium` too, with the same
        parent and tokens (a device page saved to the host tier). Unknown pages are skipped:
        there are none, since every page reaches the host tier from the device."""
        page = self._pages.get(page_hash)
        if page is None or medium in page.media:
            return
        self.stored([page_hash], page.parent, page.tokens, page.lora_name, medium)

    def removed(self, hashes: Sequence[bytes], medium: str) -> None:
        """These pages stopped being matchable in `medium`; those it never announced there
        (dropped already by a clear) are left out."""
        gone = []
        for h in hashes:
            page = self._pages.get(h)
            if page is None or medium not in page.media:
                continue
            page.media.discard(medium)
            if not page.media:
                del self._pages[h]
            gone.append(external_hash(h))
        if gone:
            self._events.append(BlockRemoved(block_hashes=tuple(gone), medium=medium))

    def cleared(self) -> None:
        """Every page of every medium was dropped."""
        self._pages.clear()
        self._events.append(AllBlocksCleared())

    def snapshot(self) -> list[KVEvent]:
        """A clear followed by every page held now, each medium's: what a subscriber that
        missed events (the publisher's queue was full) needs to hold the cache exactly again.
        Pages come in the order they were first announced, so a parent comes before its
        children."""
        events: list[KVEvent] = [AllBlocksCleared()]
        for h, page in self._pages.items():
            parent = None if page.parent is None else external_hash(page.parent)
            for medium in sorted(page.media):
                events.append(
                    BlockStored(
                        block_hashes=(external_hash(h),),
                        parent_block_hash=parent,
                        token_ids=page.tokens,
                        block_size=self.page_size,
                        lora_name=page.lora_name,
                        medium=medium,
                    )
                )
        return events
