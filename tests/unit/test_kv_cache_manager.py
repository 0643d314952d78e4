"""The page allocator: all-or-nothing growth, exact accounting, detected corruption."""

from __future__ import annotations

import pytest

from jaxserve.scheduling.kv_cache_manager import KVCacheManager


def test_allocate_grows_the_table_to_cover_the_tokens():
    kv = KVCacheManager(num_pages=8, page_size=4, max_pages_per_seq=4)
    assert kv.allocate("a", 5) and kv.page_table("a") == [0, 1]
    assert kv.allocate("a", 8) and kv.page_table("a") == [0, 1]  # still covered: no new page
    assert kv.allocate("b", 1) and kv.page_table("b") == [2]
    assert kv.allocate("a", 9) and kv.page_table("a") == [0, 1, 3]
    assert (kv.num_used_pages, kv.num_free_pages) == (4, 4)
    kv.check_invariants()


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(num_pages=4, page_size=4, max_pages_per_seq=4)
    assert kv.allocate("a", 8)
    assert kv.num_free_pages == 2
    assert not kv.allocate("b", 12)  # needs 3 pages, 2 free
    assert kv.page_table("b") == [] and kv.num_free_pages == 2
    assert kv.allocate("a", 16) and kv.num_free_pages == 0  # 2 more pages, 2 free: fits
    kv.check_invariants()


def test_allocate_is_all_or_nothing_when_growing():
    kv = KVCacheManager(num_pages=4, page_size=4, max_pages_per_seq=4)
    assert kv.allocate("a", 4) and kv.allocate("b", 8)
    assert not kv.allocate("a", 16)  # needs 3 more, 1 free
    assert kv.page_table("a") == [0] and kv.num_free_pages == 1


def test_free_returns_pages_for_reuse():
    kv = KVCacheManager(num_pages=4, page_size=2, max_pages_per_seq=4)
    kv.allocate("a", 4)
    kv.allocate("b", 2)
    assert kv.free("a") == 2 and kv.free("a") == 0
    assert kv.num_used_pages == 1
    assert kv.allocate("c", 6) and sorted(kv.page_table("c")) == [0, 1, 3]
    assert kv.page_table("c")[:2] == [0, 1]  # freed pages come back first, in order
    kv.check_invariants()


def test_more_pages_than_one_sequence_may_hold_is_a_bug():
    kv = KVCacheManager(num_pages=16, page_size=4, max_pages_per_seq=2)
    with pytest.raises(ValueError, match="needs 3 pages for 9 tokens"):
        kv.allocate("a", 9)


def test_check_invariants_detects_a_page_owned_twice():
    kv = KVCacheManager(num_pages=4, page_size=4, max_pages_per_seq=4)
    kv.allocate("a", 4)
    kv.allocate("b", 4)
    kv._tables["b"][0] = kv._tables["a"][0]  # corrupt on purpose
    with pytest.raises(AssertionError, match="leaked or doubled"):
        kv.check_invariants()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_pages=0"):
        KVCacheManager(num_pages=0, page_size=4, max_pages_per_seq=1)


def test_drop_published_frees_cached_pages_and_forgets_every_hash():
    """Engine.update_weights: pages of the old weights must never match again."""
    kv = KVCacheManager(num_pages=4, page_size=2, max_pages_per_seq=4)
    hashes = [b"a", b"b"]
    assert kv.allocate("s", 4)
    kv.publish("s", hashes, 4)
    with pytest.raises(RuntimeError, match="1 sequences hold pages"):
        kv.drop_published()  # a live table: refused
    kv.free("s")
    assert kv.num_cached_pages == 2 and len(kv.match(hashes, 5)) == 2
    assert kv.drop_published() == 2
    assert kv.num_cached_pages == 0 and kv.num_free_pages == 4
    assert kv.match(hashes, 5) == []
    kv.check_invariants()


def test_the_host_tier_drops_its_cached_pages_and_keeps_swapped_ones():
    """Engine.update_weights: the host tier's pages came from the old weights too."""
    from jaxserve.scheduling.host_pool import HostPagePool

    host = HostPagePool(4)
    assert host.hold("r", 1) is not None  # a swapped request's page stays
    pages = [host.offer(h) for h in (b"a", b"b")]
    assert None not in pages and host.match([b"a", b"b"]) == pages
    assert host.drop_cached() == 2
    assert host.match([b"a", b"b"]) == []
    assert host.num_swapped_pages == 1 and host.num_available == 3
    host.check_invariants()
