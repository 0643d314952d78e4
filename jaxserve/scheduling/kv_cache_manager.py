"""Host bookkeeping of the paged KV pool: page tables, reference counts and the prefix cache.

The device pool (`models/kv_pool.KVPages`) is one preallocated array; this class only hands out
page numbers 0..num_pages-1 and records each sequence's page table, so admission and preemption
are list operations that cost microseconds. Plain Python, no jax.

Pages are shared, not copied (docs/architecture.md, Decision 9). Every page has a reference
count: the number of page tables listing it. A full page whose keys and values are computed can be
*published* under a hash chained over its tokens (`PageHasher`): a later sequence with the same
tokens up to the end of that page reuses it instead of recomputing it. A page is in exactly one
of three states:

- used: listed by at least one table (ref count >= 1);
- cached: no table lists it but it holds a published page; kept on an LRU list and evicted,
  least recently freed first, only when a fresh page is needed and the free list is empty;
- free: no table lists it and it holds nothing worth keeping.

so `used + cached + free == num_pages` always. Only published pages are shared, and they are full
and never written again. The `n > 1` samples of one prompt and the beams of a beam search share a
prompt's full pages this way (scheduling/prefix_sharing.py).

A prompt's last, *partial* page is forked instead (copy on write): once its tokens are computed
the page is published as a partial page under its parent's hash and its tokens
(`publish_partial`), and a later sequence whose tokens go on the same way after the same full
pages (a beam's child, a sibling sample) takes a fresh page, which the engine fills by copying the
partial page on the device before the step (`allocate(..., fork=...)`, `SchedulerOutput.
page_copies`), and computes only the tokens past the copied ones. A partial page is never shared:
its owner and every child write their own next tokens into it. It stays readable while its owner
holds it (the slots a partial page publishes are never written again) and, once freed, is cached
like a published full page, evicted least recently freed first.

Groups (the hybrid pool of models whose layers differ, models/kv_pool.KVLayout): the layers may
be split into `len(windows)` groups that share the page numbers, each page one group's layers, and
each sequence has a table per group, all covering the same slots. Group 0 attends to every
earlier token: its table is *the* table (`table_of`, `tables`, `match`). A group with a sliding
window W reads only the keys of the last W positions, so once a sequence has computed c tokens
its pages wholly before position c - W + 1 are dead to it: `slide` releases them (cached if
published, so a later prompt with the same tokens still finds them). Their entries stay in the
table (a live table only grows) but no longer count: the entries before `live_start` are stale
and the attention never reads them. A prefix hit of k pages then needs group 0's first k pages
and each windowed group's pages from its `live_start(k * page_size)` to k, found by group 0's
page hashes; `match` returns the longest k for which every group has them. Partial pages are not
forked with groups (`publish_partial` declines): a sibling computes its partial page itself.

With KV events on (`events`, scheduling/kv_events.py) every change of the set of published full
pages is recorded as it is made: a page published (`publish`), evicted (`_fresh_page`), or all of
them dropped (`drop_published`). Nothing else changes that set.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence

from jaxserve.scheduling.kv_events import MEDIUM_DEVICE, KVEventLog

# Partial pages a lookup compares, most recent first (`KVCacheManager.match_partial`).
PARTIAL_CANDIDATES = 16


def pages_held_at_most(
    windows: Sequence[int | None], page_size: int, num_tokens: int, max_chunk: int
) -> int:
    """The most pages one sequence of `num_tokens` slots holds at once over groups of these
    `windows` (KVCacheManager.max_pages_held), to size a pool before any manager exists."""
    n = -(-num_tokens // page_size)
    total = 0
    for window in windows:
        live = n if window is None else -(-(window - 1 + max_chunk) // page_size) + 1
        total += min(n, live)
    return total


class PageHasher:
    """Identifies full pages by a hash chained over their tokens and their parent's hash.

    Two pages have the same hash only if their tokens and every token before them are the same
    and the salts are equal (SHA-256: a collision, which would serve wrong keys and values, is
    not a practical concern). The salt is the hook for anything else that changes the KV: the
    model (`model_key`, one per engine) and, per request, e.g. a LoRA adapter or a tenant's
    `cache_salt` that keeps its cache apart from others'.
    """

    def __init__(self, page_size: int, model_key: str = ""):
        self.page_size = page_size
        self.model_key = model_key
        self._roots: dict[str | None, bytes] = {}

    def root(self, salt: str | None = None) -> bytes:
        """The parent hash of a sequence's first page."""
        root = self._roots.get(salt)
        if root is None:
            if len(self._roots) > 256:  # per-request salts must not grow this without bound
                self._roots.clear()
            text = f"{self.model_key}\0{'' if salt is None else salt}"
            root = self._roots[salt] = hashlib.sha256(text.encode()).digest()
        return root

    def extend(self, hashes: list[bytes], tail: Sequence[int], salt: str | None = None) -> None:
        """Appends to `hashes` (a sequence's page hashes so far) those of the full pages of
        `tail`, the sequence's tokens from position `len(hashes) * page_size` on.

        Taking only the tail keeps the cost at the new pages, not the whole history.
        """
        ps = self.page_size
        parent = hashes[-1] if hashes else self.root(salt)
        for start in range(0, len(tail) - ps + 1, ps):
            tokens = array.array("q", tail[start : start + ps]).tobytes()
            parent = hashlib.sha256(parent + tokens).digest()
            hashes.append(parent)


@dataclasses.dataclass
class PrefixCacheStats:
    """Counters of the prefix cache since start; `hit_rate` is hits over queried tokens."""

    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of those, tokens served from cached pages
    evictions: int = 0  # cached pages dropped to make fresh ones

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Page tables of live sequences over a fixed pool of `num_pages` pages of `page_size` slots.

    A "sequence" is anything with a page table: a request, or one sample or beam of it.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_pages_per_seq: int,
        windows: Sequence[int | None] = (None,),
    ):
        if num_pages < 1 or page_size < 1 or max_pages_per_seq < 1:
            raise ValueError(
                f"The KV pool needs {num_pages=}, {page_size=} and {max_pages_per_seq=} all >= 1."
            )
        windows = tuple(windows)
        if not windows or windows[0] is not None or any(w is not None and w < 1 for w in windows):
            raise ValueError(
                f"The KV groups' windows {windows} must start with None (group 0 attends to "
                "every earlier token) and the others be None or a window of at least 1 token."
            )
        self.windows = windows
        self.num_groups = len(windows)
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        # A stack popped from the end: low page numbers go first, and freed pages are reused first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._refs = [0] * num_pages
        self._hash_of: list[bytes | None] = [None] * num_pages  # published pages only
        self._page_of: dict[bytes, int] = {}  # hash -> the page published under it
        self._tables: dict[str, list[int]] = {}
        # Groups 1..: each sequence's tables (same length as group 0's) and, per group, how many
        # leading entries `slide` released; each group's hash index. Empty with one group.
        self._group_tables: dict[str, tuple[list[int], ...]] = {}
        self._dead: dict[str, list[int]] = {}
        self._group_of = [0] * num_pages  # the group a published page is published in
        self._group_index: list[dict[bytes, int]] = [{} for _ in windows[1:]]
        self._published: dict[str, int] = {}  # leading pages of each table already published
        # Partial pages (copy on write): page -> (key, tokens), and by key (the parent page's
        # hash and the first token) the pages published under it, oldest first.
        self._partial_of: dict[int, tuple[tuple[bytes, int], tuple[int, ...]]] = {}
        self._partials: dict[tuple[bytes, int], dict[int, tuple[int, ...]]] = {}
        self.stats = PrefixCacheStats()
        # Called with (page, hash) as a published page is evicted, before it is handed out
        # again: the host tier saves it there (scheduling/offload.py). None: dropped.
        self.on_evict: Callable[[int, bytes], None] | None = None
        # What changed in the prefix cache, for KV-aware routers (kv_events.py); None: off, and
        # nothing is recorded.
        self.events: KVEventLog | None = None

    # ---- gauges ---------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages a new allocation may take: the free ones plus the cached ones it may evict."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_pages(self) -> int:
        return len(self._cached)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free) - len(self._cached)

    def published_hashes(self) -> list[bytes]:
        """The hashes a lookup may match now, one per published full page: the set the KV
        events (`events`) tell subscribers of."""
        return list(self._page_of)

    def drop_published(self) -> int:
        """Forgets every published page, for pages computed with weights no longer served
        (Engine.update_weights): cached pages become free and no hash matches again. Only with
        no table alive (the engine drains its requests first); returns the pages dropped."""
        if self._tables:
            raise RuntimeError(
                f"Cannot drop the prefix cache while {len(self._tables)} sequences hold pages; "
                "finish or abort them first."
            )
        dropped = len(self._page_of)
        if self.events is not None:
            self.events.cleared()
        self._partial_of.clear()
        self._partials.clear()
        self._free.extend(reversed(self._cached))  # LRU ones last: freed pages go first
        self._cached.clear()
        self._hash_of = [None] * self.num_pages
        self._page_of.clear()
        for index in self._group_index:
            index.clear()
        self._published.clear()
        return dropped

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` cache slots."""
        return -(-num_tokens // self.page_size)

    def num_pages_of(self, seq_id: str) -> int:
        return len(self._tables.get(seq_id, ()))

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def num_private_pages(self, seq_id: str, exclude: Sequence[int] = ()) -> int:
        """Pages only `seq_id` lists (freeing it releases exactly these), less `exclude`."""
        skip = set(exclude)
        return sum(self._refs[p] == 1 and p not in skip for p in self._live_pages(seq_id))

    def _live_pages(self, seq_id: str) -> list[int]:
        """The pages the sequence's tables hold a reference to, every group's."""
        pages = list(self._tables.get(seq_id, ()))
        for table, dead in zip(
            self._group_tables.get(seq_id, ()), self._dead.get(seq_id, ()), strict=True
        ):
            pages.extend(table[dead:])
        return pages

    def page_table(self, seq_id: str) -> list[int]:
        """A copy of the sequence's pages in order (empty when it holds none)."""
        return list(self._tables.get(seq_id, ()))

    def table_of(self, seq_id: str) -> list[int]:
        """The sequence's live page table, not a copy: read it, never change it.

        It only grows while the sequence holds it (`allocate`); `free` drops it from the
        manager but leaves the list as it was, so a plan that holds it still reads the pages it
        was planned with. The scheduler hands it to every step instead of copying up to
        max_pages_per_seq ints per row.
        """
        return self._tables[seq_id]

    @property
    def group_tables(self) -> Mapping[str, tuple[list[int], ...]]:
        """Every sequence's live tables of groups 1.. by id (empty with one group); entries
        before a group's `live_start` are stale."""
        return self._group_tables

    def live_start(self, group: int, num_computed: int) -> int:
        """The first page of `group`'s table a query at position `num_computed` or later may
        read: 0 for a full group; for a window W, the page of position num_computed - W + 1."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, (num_computed - window + 1) // self.page_size)

    def fresh_pages(self, num_tokens: int, held: int = 0) -> int:
        """Pages `allocate` takes to grow a table of `held` pages to `num_tokens` slots: one
        per new page in every group."""
        return self.num_groups * max(0, self.pages_for(num_tokens) - held)

    def max_pages_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most pages a sequence of `num_tokens` slots holds at once when each step runs
        at most `max_chunk` of its tokens (a windowed group keeps its window and the chunk)."""
        return pages_held_at_most(self.windows, self.page_size, num_tokens, max_chunk)

    def prefix_pages(self, prefix: Sequence[int]) -> list[int]:
        """Every page a table started with group 0's cached `prefix` (from `match`) takes: the
        prefix, then each windowed group's pages for the window before its end."""
        pages = list(prefix)
        if self.num_groups > 1 and prefix:
            for group in range(1, self.num_groups):
                pages.extend(self._group_prefix(group, prefix)[1])
        return pages

    def _group_prefix(self, group: int, prefix: Sequence[int]) -> tuple[int, list[int]]:
        """(live_start, the pages from it) of `group` for group 0's cached `prefix`."""
        index = self._group_index[group - 1]
        lo = self.live_start(group, len(prefix) * self.page_size)
        pages = []
        for page in prefix[lo:]:
            got = index.get(self._hash_of[page])
            if got is None:
                raise ValueError(
                    f"Group {group} holds no page published as group 0's page {page}: "
                    "the prefix did not come from match()."
                )
            pages.append(got)
        return lo, pages

    @property
    def tables(self) -> Mapping[str, list[int]]:
        """Every sequence's live page table by id (`table_of` for all of them): the
        scheduler's per-row lookup is then one dict read, not a method call."""
        return self._tables

    # ---- allocation -----------------------------------------------------------------------

    def allocate(
        self, seq_id: str, num_tokens: int, prefix: Sequence[int] = (), fork: int | None = None
    ) -> bool:
        """Grows the sequence's table to cover `num_tokens` slots; all or nothing.

        `prefix`: cached pages (from `match`) that start the table of a sequence that holds none
        yet; they are shared, not copied. `fork`: a partial page (from `match_partial`) the page
        after them is to be copied from; it is kept from eviction while the fresh pages are
        taken, and the caller copies it into `table_of(seq_id)[len(prefix)]`. Returns False,
        changing nothing, when too few pages are free or evictable: the caller then preempts or
        waits. More pages than one sequence may hold is a caller bug (admission refuses such
        requests), so it raises.
        """
        table = self._tables.get(seq_id)
        want = self.pages_for(num_tokens)
        if want > self.max_pages_per_seq:
            raise ValueError(
                f"Sequence {seq_id!r} needs {want} pages for {num_tokens} tokens, more than "
                f"{self.max_pages_per_seq=}."
            )
        if prefix and table:
            raise ValueError(
                f"Sequence {seq_id!r} already holds {len(table)} pages; a cached prefix can "
                f"only start a new table."
            )
        held = len(table) if table else len(prefix)
        need = max(0, want - held)
        groups = self.num_groups
        group_prefixes = [self._group_prefix(g, prefix) for g in range(1, groups)] if prefix else []
        taken = self.prefix_pages(prefix) if group_prefixes else prefix
        reclaimed = sum(self._refs[p] == 0 for p in taken)  # cached now, ours once shared
        if fork is not None:
            if groups > 1:
                raise ValueError(
                    f"Sequence {seq_id!r} cannot fork page {fork}: with KV groups "
                    "partial pages are not published."
                )
            if fork in prefix or fork not in self._partial_of or len(table or ()) or not need:
                raise ValueError(
                    f"Sequence {seq_id!r} cannot fork page {fork}: it must be a published "
                    f"partial page, not in the prefix {list(prefix)}, copied into a fresh page "
                    f"of a new table."
                )
            reclaimed += self._refs[fork] == 0  # cached: must not be evicted for the copy
        if groups * need > self.num_free_pages - reclaimed:
            return False
        if table is None:
            table = self._tables[seq_id] = []
            self._published[seq_id] = 0
            if groups > 1:
                self._group_tables[seq_id] = tuple([] for _ in range(1, groups))
                self._dead[seq_id] = [0] * (groups - 1)
        for page in prefix:
            self._ref(page)
            table.append(page)
        for g, (lo, pages) in enumerate(group_prefixes):
            # The entries before the window are stale from the start: page 0, never read.
            group_table = self._group_tables[seq_id][g]
            group_table.extend([0] * lo)
            for page in pages:
                self._ref(page)
                group_table.append(page)
            self._dead[seq_id][g] = lo
        self._published[seq_id] += len(prefix)  # a matched page is published already
        if fork is not None:
            self._ref(fork)  # held while the fresh pages are taken, then back where it was
        for _ in range(need):
            table.append(self._fresh_page())
        for group_table in self._group_tables.get(seq_id, ()):
            for _ in range(need):
                group_table.append(self._fresh_page())
        if fork is not None:
            self._unref(fork)
        return True

    def slide(self, seq_id: str, num_computed: int) -> int:
        """Releases the pages of the sequence's windowed groups that no query at position
        `num_computed` or later reads; returns how many. Published ones become cached.

        Safe while earlier steps still run: a released page is handed out only to a later
        plan, whose writes the device makes after every earlier step's reads.
        """
        dead = self._dead.get(seq_id)
        if dead is None:
            return 0
        released = 0
        for g, table in enumerate(self._group_tables[seq_id]):
            lo = min(self.live_start(g + 1, num_computed), len(table))
            for i in range(dead[g], lo):
                self._unref(table[i])
                released += 1
            dead[g] = max(dead[g], lo)
        return released

    def _unref(self, page: int) -> None:
        """Drops one reference; an unlisted page becomes cached if it holds anything worth
        keeping (a published full or partial page), else free."""
        self._refs[page] -= 1
        if self._refs[page] < 0:
            raise AssertionError(f"Page {page} was freed more often than held.")
        if self._refs[page] == 0:
            if self._hash_of[page] is None and page not in self._partial_of:
                self._free.append(page)
            else:
                self._cached[page] = None

    def _ref(self, page: int) -> None:
        if self._refs[page] == 0:
            del self._cached[page]
        self._refs[page] += 1

    def _fresh_page(self) -> int:
        """A page with no content worth keeping: a free one, else the least recent cached one."""
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._cached.popitem(last=False)
            self.stats.evictions += 1
            self._drop_partial(page)
            page_hash = self._hash_of[page]
            if page_hash is not None and self._group_of[page]:
                del self._group_index[self._group_of[page] - 1][page_hash]
                self._hash_of[page] = None
                self._group_of[page] = 0
            elif page_hash is not None:
                del self._page_of[page_hash]
                self._hash_of[page] = None
                if self.on_evict is not None:
                    self.on_evict(page, page_hash)
                # After the host tier took it, if it did: the log still knows its tokens then.
                if self.events is not None:
                    self.events.removed([page_hash], MEDIUM_DEVICE)
        self._refs[page] = 1
        return page

    def _drop_partial(self, page: int) -> None:
        """Forgets the partial page `page` published, if any (its slots are to be reused)."""
        entry = self._partial_of.pop(page, None)
        if entry is not None:
            pages = self._partials[entry[0]]
            del pages[page]
            if not pages:
                del self._partials[entry[0]]

    def free(self, seq_id: str) -> int:
        """Drops the sequence's table; returns how many pages it listed (0 if none).

        A page no other table lists becomes cached if published, else free. The table is walked
        backwards so a prefix's last page is evicted before its first: matching stops at the
        first missing page, so evicting from the front would strand the pages behind it.
        """
        table = self._tables.pop(seq_id, [])
        self._published.pop(seq_id, None)
        group_tables = self._group_tables.pop(seq_id, ())
        for group_table, dead in zip(group_tables, self._dead.pop(seq_id, ()), strict=True):
            for page in reversed(group_table[dead:]):
                self._unref(page)
        unhashed = []
        for page in reversed(table):
            self._refs[page] -= 1
            if self._refs[page] < 0:
                raise AssertionError(f"Page {page} of {seq_id!r} was freed more often than held.")
            if self._refs[page]:
                continue
            if self._hash_of[page] is None and page not in self._partial_of:
                unhashed.append(page)
            else:
                self._cached[page] = None
        # Pushed so the next allocation pops them back in table order.
        self._free.extend(unhashed)
        return len(table)

    def trim(self, seq_id: str, num_tokens: int) -> int:
        """Gives back the pages of the sequence's table past `num_tokens` slots; returns how
        many. They are the pages a speculative verification took for proposals that were then
        rejected (scheduler.update): kept, they would count as used for slots nothing holds.
        Published pages are never trimmed."""
        table = self._tables.get(seq_id)
        if not table:
            return 0
        keep = max(self.pages_for(num_tokens), self._published[seq_id])
        if len(table) <= keep:
            return 0
        # A new list, not the old one shortened: a live table only ever grows (`table_of`), so
        # whoever copied it sees a new table rather than a stale one of the same length.
        self._tables[seq_id], dropped = table[:keep], table[keep:]
        for page in reversed(dropped):
            self._unref(page)
        if seq_id in self._group_tables:
            trimmed, n = [], len(dropped)
            for group_table, dead in zip(
                self._group_tables[seq_id], self._dead[seq_id], strict=True
            ):
                if dead > keep:
                    raise AssertionError(
                        f"{seq_id!r} cannot keep {keep} pages: {dead} are released."
                    )
                cut = keep
                for page in reversed(group_table[cut:]):
                    self._unref(page)
                n += len(group_table) - cut
                trimmed.append(group_table[:cut])
            self._group_tables[seq_id] = tuple(trimmed)
            return n
        return len(dropped)

    # ---- the prefix cache -----------------------------------------------------------------

    def match(self, hashes: Sequence[bytes], num_tokens: int) -> list[int]:
        """Pages holding the longest cached prefix of a sequence of `num_tokens` tokens.

        `hashes` are its full pages' hashes (`PageHasher.extend`). Whole pages only, and at
        least the last token is left out: its logits are needed, so it must be computed. Changes
        nothing; `allocate(..., prefix=...)` takes the pages.
        """
        pages = []
        for h in hashes[: (num_tokens - 1) // self.page_size]:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        if self.num_groups > 1:
            while pages and not self._groups_hold(hashes, len(pages)):
                pages.pop()
        return pages

    def _groups_hold(self, hashes: Sequence[bytes], k: int) -> bool:
        """Whether every windowed group holds its pages for a prefix of k pages."""
        for g, index in enumerate(self._group_index, start=1):
            lo = self.live_start(g, k * self.page_size)
            if any(h not in index for h in hashes[lo:k]):
                return False
        return True

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admission's lookup: `num_tokens` queried, `num_hit_tokens` served."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def publish(
        self,
        seq_id: str,
        hashes: Sequence[bytes],
        num_computed_tokens: int,
        tokens: Callable[[int, int], Sequence[int]] | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Publishes the sequence's full pages whose keys and values are now computed.

        `hashes[i]` names page i. A page whose hash another page already holds (two sequences
        computed the same prefix at once) stays unpublished, freed as a plain page later.
        Costs one comparison when no page filled up since the last call. `tokens(start, end)`
        (the sequence's tokens) and its adapter's `lora_name` are read only with KV events on,
        for the event of each run of pages published.
        """
        done = self._published.get(seq_id)
        if done is None:
            return
        full = min(num_computed_tokens // self.page_size, len(hashes))
        if full <= done:
            return
        table = self._tables[seq_id]
        stored = []  # indices of the pages published now
        for i in range(done, full):
            page, h = table[i], hashes[i]
            if self._hash_of[page] is None and h not in self._page_of:
                self._hash_of[page] = h
                self._page_of[h] = page
                stored.append(i)
        if seq_id in self._group_tables:
            groups = zip(
                self._group_tables[seq_id], self._dead[seq_id], self._group_index, strict=True
            )
            for g, (group_table, dead, index) in enumerate(groups, start=1):
                for i in range(max(done, dead), full):  # a released page holds nothing now
                    page, h = group_table[i], hashes[i]
                    if self._hash_of[page] is None and h not in index:
                        self._hash_of[page] = h
                        self._group_of[page] = g
                        index[h] = page
        self._published[seq_id] = full
        if self.events is not None and stored:
            self._record_stored(hashes, stored, tokens, lora_name)

    def _record_stored(self, hashes, stored: list[int], tokens, lora_name) -> None:
        """One event per run of consecutive pages published, each after its run's parent."""
        if tokens is None:
            raise ValueError("KV events need the tokens of the pages published; pass `tokens`.")
        ps = self.page_size
        start = stored[0]
        for n, i in enumerate(stored):
            if n + 1 < len(stored) and stored[n + 1] == i + 1:
                continue  # the run goes on
            self.events.stored(
                hashes[start : i + 1],
                hashes[start - 1] if start else None,
                tokens(start * ps, (i + 1) * ps),
                lora_name,
            )
            if n + 1 < len(stored):
                start = stored[n + 1]

    def publish_partial(
        self, seq_id: str, index: int, parent: bytes, tokens: Sequence[int]
    ) -> bool:
        """Publishes page `index` of the sequence's table as a partial page whose first
        `len(tokens)` slots hold the computed keys and values of `tokens`, which follow the full
        pages ending in the page hashed `parent` (`PageHasher.root` for the first page).

        Not a page published already (full or partial; the page after a table's published ones
        is its own, no other table lists it); returns whether it was published. The owner may
        go on writing the page's later slots.
        """
        table = self._tables.get(seq_id)
        if not tokens or len(tokens) >= self.page_size or not table or index >= len(table):
            return False
        if self.num_groups > 1:  # a fork would copy group 0's page alone
            return False
        page = table[index]
        if self._hash_of[page] is not None or page in self._partial_of:
            return False
        key = (parent, int(tokens[0]))
        entry = tuple(int(t) for t in tokens)
        self._partial_of[page] = (key, entry)
        self._partials.setdefault(key, {})[page] = entry
        return True

    def match_partial(
        self, parent: bytes, tokens: Sequence[int], limit: int
    ) -> tuple[int, int] | None:
        """The partial page published after `parent` whose tokens agree longest with `tokens`,
        the sequence's tokens from that page's first slot, and how many agree (at most `limit`,
        which leaves the tokens the sequence must compute itself); None when not one does.

        Looks at the `PARTIAL_CANDIDATES` most recently published under the same key: forks
        (beams, samples) follow their parent closely, and the scan stays short however many
        prompts share a first page.
        """
        if limit < 1 or not tokens:
            return None
        pages = self._partials.get((parent, int(tokens[0])))
        if not pages:
            return None
        best, best_n = None, 0
        for count, page in enumerate(reversed(pages)):
            if count == PARTIAL_CANDIDATES:
                break
            entry = pages[page]
            n, top = 0, min(len(entry), limit, len(tokens))
            while n < top and entry[n] == tokens[n]:
                n += 1
            if n > best_n:
                best, best_n = page, n
        return None if best is None else (best, best_n)

    def check_invariants(self) -> None:
        """Raises AssertionError unless the books agree: ref counts match the tables, every page
        is used, cached or free exactly once, and the hash index matches the published pages."""
        refs = [0] * self.num_pages
        for seq_id, table in self._tables.items():
            if len(table) > self.max_pages_per_seq:
                raise AssertionError(f"Sequence {seq_id!r} holds {len(table)} pages.")
            for group_table in self._group_tables.get(seq_id, ()):
                if len(group_table) != len(table):
                    raise AssertionError(f"Sequence {seq_id!r}'s group tables differ in length.")
            for page in self._live_pages(seq_id):
                refs[page] += 1
        if set(self._group_tables) - set(self._tables) or set(self._dead) != set(
            self._group_tables
        ):
            raise AssertionError("A sequence has group tables but no table.")
        used = [p for p in range(self.num_pages) if refs[p]]
        every = used + self._free + list(self._cached)
        if (
            refs != self._refs
            or len(every) != self.num_pages
            or set(every) != set(range(self.num_pages))
        ):
            raise AssertionError(
                f"KV pages leaked or doubled: {len(used)} used + {len(self._cached)} cached + "
                f"{len(self._free)} free != {self.num_pages} pages, a page is listed twice, or "
                f"the ref counts disagree with the tables."
            )
        partial = self._partial_of
        if any(self._hash_of[p] is not None or p in partial for p in self._free) or any(
            self._hash_of[p] is None and p not in partial for p in self._cached
        ):
            raise AssertionError("A free page holds a hash, or a cached page none.")
        by_key = {(key, p): e for p, (key, e) in partial.items()}
        indexed = {(key, p): e for key, pages in self._partials.items() for p, e in pages.items()}
        if by_key != indexed or any(not pages for pages in self._partials.values()):
            raise AssertionError("The partial-page index disagrees with the partial pages.")
        for g in range(self.num_groups):
            index = self._group_index[g - 1] if g else self._page_of
            published = {
                h: p
                for p, h in enumerate(self._hash_of)
                if h is not None and self._group_of[p] == g
            }
            if published != index:
                raise AssertionError(f"Group {g}'s hash index disagrees with its published pages.")
