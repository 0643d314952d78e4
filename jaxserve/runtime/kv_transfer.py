"""Page copies between the device KV pool and a pool of pages in host memory.

The scheduler decides which pages move (scheduling/offload.py) and each plan carries the pairs
(`SchedulerOutput.swap_out`: device page -> host page, `swap_in`: host page -> device page);
`KVTransfer.copy` starts them as the engine dispatches the plan's step. Nothing here knows the
pool's layout: every leaf of the pool pytree holds its pages on axis 1 (today K and V of
[layers, pages, page_size, kv_heads, head_dim]; any [layers, pages, ...] works), and the host
pool mirrors each leaf with its own page count on that axis.

No compile while serving (docs/architecture.md, Decision 3): pages move in groups of a fixed
GROUP pages, padded, through one jitted gather and one jitted scatter, both compiled at warm-up
(`warm_up`). Padding reads page 0 and writes past the pool's end, which the scatter drops.

Asynchronous: a save dispatches the gather on the device and starts its copy to the host
(`copy_to_host_async`) without waiting; the bytes land in the host arrays later (`poll`, each
engine iteration, takes what is done without blocking), and a restore blocks only when it reads
a host page whose save has not landed yet. A restore reads the host pages now and puts
them on the device (an asynchronous copy), while the step of the plan that admitted the request
runs; the scatter into the pool (`write`) is dispatched before the next plan's step, the first
one the restored request runs in. The device runs them in order, so that step sees the pages,
and no other request's step waits for the copy.

Order within one plan (what makes freeing a page in the plan that copies it safe, host_pool.py):
the last plan's restores are written, then this plan's restores read the host (into fresh
staging arrays), then its saves' gathers, then its step. Host writes land in the order the saves
were made.
"""

from __future__ import annotations

import collections
import math
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.step_batch import pack_chunks
from jaxserve.runtime.sampling import SamplingBatch

GROUP = 16  # pages per copy call: one compiled shape each way


def gather_pages(pool, pages: jax.Array):
    """Every leaf's pages `pages` (i32[GROUP]) along axis 1: the pool pytree of [L, GROUP, ...]."""
    return jax.tree.map(lambda leaf: jnp.take(leaf, pages, axis=1), pool)


def scatter_pages(pool, pages: jax.Array, values):
    """The pool with `values` (the pool pytree of [L, GROUP, ...]) written into pages `pages`
    (i32[GROUP]) along axis 1; an index past the pool's end (padding) writes nothing."""
    return jax.tree.map(lambda leaf, v: leaf.at[:, pages].set(v, mode="drop"), pool, values)


class KVTransfer:
    """The host pool's bytes and the copies between it and the device pool."""

    def __init__(self, pool, num_host_pages: int, group: int = GROUP):
        leaves, self._treedef = jax.tree.flatten(pool)
        self.group = group
        self.num_pages = leaves[0].shape[1]  # the device pool's
        self.num_host_pages = num_host_pages
        # np.zeros maps fresh memory lazily: the host pool costs RAM only as pages are used.
        self.host = [
            np.zeros((leaf.shape[0], num_host_pages, *leaf.shape[2:]), np.dtype(leaf.dtype))
            for leaf in leaves
        ]
        self.bytes_per_page = pool_bytes_per_page(pool)
        self._shardings = [leaf.sharding for leaf in leaves]  # axis 1 is never split
        pool_shardings = jax.tree.unflatten(self._treedef, self._shardings)
        self._gather = jax.jit(gather_pages)
        self._scatter = jax.jit(scatter_pages, donate_argnums=0, out_shardings=pool_shardings)
        # Saves whose bytes are still on their way: (device arrays, host pages, count), oldest
        # first; and the latest save of each host page, by sequence number.
        self._pending: collections.deque = collections.deque()
        self._seq = 0
        self._landed = 0  # saves numbered below this have landed
        self._last_write: dict[int, int] = {}
        self.host_bytes_per_s: float | None = None  # measured by warm_up

    @property
    def host_bytes(self) -> int:
        return sum(a.nbytes for a in self.host)

    def copy(self, pool, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]):
        """Starts one plan's copies in the module's order: its restores' host reads, then its
        saves; returns the restores staged, for `write` before the next plan's step."""
        staged = [self._stage(chunk) for chunk in _chunks(swap_in, self.group)]
        for chunk in _chunks(swap_out, self.group):
            self._save(pool, chunk)
        return staged

    def write(self, pool, staged):
        """Scatters staged restores into the pool (donated); returns it."""
        for pages, values in staged:
            pool = self._scatter(pool, pages, values)
        return pool

    def poll(self) -> None:
        """Lands the saves whose bytes reached the host, oldest first, without waiting."""
        while self._pending and all(a.is_ready() for a in self._pending[0][0]):
            self._land_one()

    def drain(self) -> None:
        """Lands every save (blocking): before reading the host pool directly."""
        while self._pending:
            self._land_one()

    def _save(self, pool, chunk: Sequence[tuple[int, int]]) -> None:
        dev = np.zeros(self.group, np.int32)  # padding reads page 0, whose bytes go nowhere
        dev[: len(chunk)] = [d for d, _ in chunk]
        arrays = jax.tree.leaves(self._gather(pool, dev))
        for a in arrays:
            a.copy_to_host_async()
        host_pages = np.array([h for _, h in chunk], np.int64)
        self._pending.append((arrays, host_pages, len(chunk)))
        for h in host_pages.tolist():
            self._last_write[h] = self._seq
        self._seq += 1

    def _land_one(self) -> None:
        arrays, host_pages, n = self._pending.popleft()
        for host, a in zip(self.host, arrays, strict=True):
            host[:, host_pages] = np.asarray(a)[:, :n]
        self._landed += 1

    def _stage(self, chunk: Sequence[tuple[int, int]]):
        """The host bytes of a group of restores, put on the device: (pages, values)."""
        host_pages = [h for h, _ in chunk]
        needed = max(self._last_write.get(h, -1) for h in host_pages)
        while self._landed <= needed:  # only a save these pages wait for blocks
            self._land_one()
        take = np.zeros(self.group, np.int64)
        take[: len(chunk)] = host_pages
        dev = np.full(self.group, self.num_pages, np.int32)  # past the end: dropped
        dev[: len(chunk)] = [d for _, d in chunk]
        values = [
            jax.device_put(np.take(host, take, axis=1), sharding)
            for host, sharding in zip(self.host, self._shardings, strict=True)
        ]
        return dev, jax.tree.unflatten(self._treedef, values)

    def warm_up(self, pool):
        """Compiles the gather and the scatter and measures the host copy rate (one group out
        and back, the second time: `host_bytes_per_s`); returns the pool, unchanged in value
        (its first pages are copied out and back to themselves)."""
        n = min(self.group, self.num_pages, self.num_host_pages)
        pairs = [(i, i) for i in range(n)]
        seconds = 0.0
        for _ in range(2):
            start = time.perf_counter()
            self.copy(pool, pairs, [])
            self.drain()
            pool = self.write(pool, self.copy(pool, [], pairs))
            jax.block_until_ready(pool)
            seconds = time.perf_counter() - start
        self.host_bytes_per_s = 2 * n * self.bytes_per_page / max(seconds, 1e-9)
        self._last_write.clear()
        return pool


def copy_pages(pool, src: jax.Array, dst: jax.Array):
    """The pool with every leaf's pages `src` (i32[GROUP]) copied into pages `dst` (i32[GROUP])
    along axis 1; a destination past the pool's end (padding) writes nothing."""
    return jax.tree.map(
        lambda leaf: leaf.at[:, dst].set(jnp.take(leaf, src, axis=1), mode="drop"), pool
    )


class PageCopies:
    """Copies of device pages into other device pages: the partial pages forked for beams and
    n > 1 samples (SchedulerOutput.page_copies, copy on write in kv_cache_manager.py).

    One jitted call of a fixed GROUP pairs, padded, compiled at warm-up and donating the pool,
    so a fork costs a copy of its pages and nothing is compiled while serving. Dispatched in the
    step's order on the device: the step after it reads the copies.
    """

    def __init__(self, pool, group: int = GROUP):
        leaves, treedef = jax.tree.flatten(pool)
        self.group = group
        self.num_pages = leaves[0].shape[1]
        shardings = jax.tree.unflatten(treedef, [leaf.sharding for leaf in leaves])
        self._copy = jax.jit(copy_pages, donate_argnums=0, out_shardings=shardings)

    def warm_up(self, pool):
        """Compiles the copy (a call that copies nothing); returns the pool, unchanged."""
        return self.run(pool, [(0, self.num_pages)])

    def run(self, pool, pairs: Sequence[tuple[int, int]]):
        """The pool with each (source, destination) page pair copied; returns the new pool (the
        one given is donated)."""
        for chunk in _chunks(pairs, self.group):
            src = np.zeros(self.group, np.int32)
            dst = np.full(self.group, self.num_pages, np.int32)  # past the end: dropped
            src[: len(chunk)], dst[: len(chunk)] = zip(*chunk, strict=True)
            pool = self._copy(pool, src, dst)
        return pool


def _chunks(pairs: Sequence[tuple[int, int]], size: int):
    for i in range(0, len(pairs), size):
        yield pairs[i : i + size]


# The host pool when --host-kv-gb is not given: sized from what the engine serves, this many
# times the device pool's bytes (room to swap out every running request and to keep as much
# again of the prefix cache), and never more than a share of the memory free at start-up nor
# the cap, so that replicas sharing a host do not each claim a quarter of it whatever they serve.
DEFAULT_HOST_DEVICE_MULTIPLE = 2
DEFAULT_HOST_SHARE = 0.25
DEFAULT_HOST_CAP_GB = 64.0


def host_pages_for(host_kv_gb: float | None, bytes_per_page: int, num_device_pages: int) -> int:
    """Host pool pages for `host_kv_gb` GB (None: `default_host_bytes` of the device pool's
    `num_device_pages` pages; 0: none). Multi-host meshes get none: followers would not copy."""
    if jax.process_count() > 1:
        return 0
    if host_kv_gb is None:
        return default_host_bytes(num_device_pages * bytes_per_page) // max(bytes_per_page, 1)
    return int(host_kv_gb * 2**30) // max(bytes_per_page, 1)


def default_host_bytes(device_pool_bytes: int, free_bytes: int | None = None) -> int:
    """The default host pool's bytes: DEFAULT_HOST_DEVICE_MULTIPLE device pools, at most
    DEFAULT_HOST_SHARE of `free_bytes` (default: the memory free now) and DEFAULT_HOST_CAP_GB."""
    free = free_host_bytes() if free_bytes is None else free_bytes
    return int(
        min(
            DEFAULT_HOST_DEVICE_MULTIPLE * device_pool_bytes,
            DEFAULT_HOST_SHARE * free,
            DEFAULT_HOST_CAP_GB * 2**30,
        )
    )


def free_host_bytes() -> int:
    """Memory the OS reports available (MemAvailable), else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pool_bytes_per_page(pool) -> int:
    """Bytes of one page over every leaf of the pool pytree (pages on axis 1)."""
    leaves = jax.tree.leaves(pool)
    return sum(leaf.nbytes for leaf in leaves) // leaves[0].shape[1]


def timed_prefill_seconds(runner, repeats: int = 2) -> Callable[[int], float]:
    """Seconds to compute `n` tokens again, when no step-cost model is loaded: full steps of the
    largest token bucket, timed now (an all-padding step runs the bucket's matmuls; attention,
    which a real prefill adds, is left out, so a recompute is priced low, never high)."""
    tokens = runner.config.token_buckets[-1]
    seqs = runner.config.seq_bucket_for(tokens)
    batch = pack_chunks(
        [],
        page_size=runner.config.page_size,
        num_tokens=tokens,
        num_seqs=seqs,
        pages_per_seq=runner.config.pages_per_seq,
        num_pages=runner.config.num_pages,
        num_groups=getattr(runner.config, "num_groups", 1),  # the step's shape: a hybrid pool's
    )
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(runner.execute(batch, SamplingBatch.empty(seqs)).token_ids)
        best = min(best, time.perf_counter() - start)
    return lambda n: -(-n // tokens) * best
