"""Page copies between a device pool and the host pool (jaxserve/runtime/kv_transfer.py).

The default host pool's size comes last: sized from the device pool's bytes, never from the
machine's free memory alone.

Pools of either layout (K and V leaves of [L, pages, page_size, heads, dim], or one leaf of
[L, pages, page_size, lanes]) whose every page holds its own number, so a page that lands in the
wrong place, a padded slot that writes, or a restore that reads a save not landed yet shows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import compiles, kv_transfer
from jaxserve.runtime.kv_transfer import KVTransfer


def _numbered(shape) -> jax.Array:
    """f32 array whose page p (axis 1) holds p + 1 everywhere, layer l adds 1000 * l."""
    layers, pages = shape[:2]
    value = 1 + np.arange(pages)[None, :] + 1000 * np.arange(layers)[:, None]
    return jnp.asarray(
        np.broadcast_to(value.reshape(layers, pages, *[1] * (len(shape) - 2)), shape)
    )


POOLS = {
    "k_and_v": lambda: {"k": _numbered((2, 20, 4, 2, 3)), "v": -_numbered((2, 20, 4, 2, 3))},
    "lanes": lambda: [_numbered((3, 20, 4, 8))],
}


@pytest.mark.parametrize("layout", sorted(POOLS))
def test_pages_go_out_and_come_back_where_the_plan_says(layout):
    pool = POOLS[layout]()
    transfer = KVTransfer(pool, num_host_pages=48, group=4)
    compiles.install()
    with compiles.warming_up():
        pool = transfer.warm_up(pool)
    assert transfer.host_bytes_per_s > 0
    before = jax.tree.map(np.asarray, pool)
    serving = compiles.serving()
    # Six pages out (two groups, one padded), then back into other pages; page 19 untouched.
    out = [(p, 30 + p) for p in (0, 3, 5, 7, 11, 12)]
    assert transfer.copy(pool, out, []) == []
    into = [(30 + 3, 19 - 3), (30 + 11, 1), (30 + 0, 2)]
    ahead = transfer.copy(pool, [], into)  # staged: nothing written yet
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), pool, before)
    pool = transfer.write(pool, ahead)
    after = jax.tree.map(np.asarray, pool)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        want = b.copy()
        for host, dev in into:
            want[:, dev] = b[:, host - 30]
        np.testing.assert_array_equal(a, want)
    # A restore reading a host page written by a save just made.
    transfer.copy(pool, [(19, 39)], [])
    pool = transfer.write(pool, transfer.copy(pool, [], [(39, 0)]))
    for a, b in zip(jax.tree.leaves(pool), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a)[:, 0], b[:, 19])
    assert compiles.serving() == serving, "a copy compiled after warm-up"


def test_saves_land_without_blocking_and_in_order():
    pool = POOLS["lanes"]()
    transfer = KVTransfer(pool, num_host_pages=8, group=4)
    pool = transfer.warm_up(pool)
    transfer.copy(pool, [(5, 1)], [])
    transfer.copy(pool, [(6, 1)], [])  # the same host page again: the later one wins
    transfer.drain()
    np.testing.assert_array_equal(transfer.host[0][:, 1], np.asarray(pool[0])[:, 6])
    transfer.poll()  # nothing pending: returns at once


MiB, GiB = 2**20, 2**30


def test_the_default_host_pool_is_twice_the_device_pool_within_memory_and_the_cap():
    # Twice the device pool, where a quarter of the free memory and the cap allow it.
    assert kv_transfer.default_host_bytes(3 * MiB, free_bytes=24 * GiB) == 6 * MiB
    # A quarter of the free memory bounds it (8 replicas cannot each take a quarter of all).
    assert kv_transfer.default_host_bytes(10 * GiB, free_bytes=8 * GiB) == 2 * GiB
    # And the cap.
    assert kv_transfer.default_host_bytes(100 * GiB, free_bytes=2**40) == 64 * GiB


def test_host_pages_default_from_the_device_pool_or_as_the_flag_says(monkeypatch):
    monkeypatch.setattr(kv_transfer, "free_host_bytes", lambda: 24 * GiB)
    assert kv_transfer.host_pages_for(None, 4096, num_device_pages=500) == 1000
    monkeypatch.setattr(kv_transfer, "free_host_bytes", lambda: 400 * 4096)  # a quarter: 100
    assert kv_transfer.host_pages_for(None, 4096, num_device_pages=500) == 100
    # The flag's size, whatever the device pool; 0 turns the pool off.
    assert kv_transfer.host_pages_for(0.5, 4096, num_device_pages=500) == (GiB // 2) // 4096
    assert kv_transfer.host_pages_for(0, 4096, num_device_pages=500) == 0
    # Whole pages, an int, where the bytes do not divide into pages.
    odd = kv_transfer.host_pages_for(0.5, 3000, num_device_pages=500)
    assert odd == (GiB // 2) // 3000 and isinstance(odd, int)
    monkeypatch.setattr(kv_transfer, "free_host_bytes", lambda: 400 * 4096)
    odd = kv_transfer.host_pages_for(None, 3000, num_device_pages=7)  # 42,000 bytes: 14 pages
    assert odd == 14 and isinstance(odd, int)


def test_a_multi_host_mesh_gets_no_host_pool(monkeypatch):
    """Followers would not run the copies (host_pages_for): 0 pages, whatever the flag."""
    for processes in (2, 3):
        monkeypatch.setattr(kv_transfer.jax, "process_count", lambda n=processes: n)
        assert kv_transfer.host_pages_for(None, 4096, num_device_pages=500) == 0
        assert kv_transfer.host_pages_for(0.5, 4096, num_device_pages=500) == 0


def test_free_memory_is_memavailable_else_the_free_physical_pages(monkeypatch):
    import io
    import os

    pages = {"SC_AVPHYS_PAGES": 300, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])

    def meminfo(text):
        def fake_open(path, *args, **kwargs):
            assert path == "/proc/meminfo"
            return io.StringIO(text)

        return fake_open

    lines = "MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    8192 kB\n"
    monkeypatch.setattr(kv_transfer, "open", meminfo(lines), raising=False)
    assert kv_transfer.free_host_bytes() == 8192 * 1024
    # A kernel without MemAvailable, or no /proc: the free pages.
    monkeypatch.setattr(kv_transfer, "open", meminfo("MemFree: 1024 kB\n"), raising=False)
    assert kv_transfer.free_host_bytes() == 300 * 4096

    def no_proc(*args, **kwargs):
        raise FileNotFoundError("/proc/meminfo")

    monkeypatch.setattr(kv_transfer, "open", no_proc, raising=False)
    assert kv_transfer.free_host_bytes() == 300 * 4096
