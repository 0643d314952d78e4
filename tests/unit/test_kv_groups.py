"""The KV manager's groups (the hybrid pool of Gemma's local and global layers): windowed
groups release the pages their window has left, prefix hits need each group's window, and no
page a sequence still reads is ever handed to another."""

from __future__ import annotations

import random

import pytest

from jaxserve.scheduling.kv_cache_manager import KVCacheManager, PageHasher

PS = 4


def test_slide_releases_only_pages_wholly_before_the_window():
    """Window 6, pages of 4: a query at position c reads keys from c - 5 on, so page j is dead
    once 4(j + 1) <= c - 5; group 0 keeps everything."""
    kv = KVCacheManager(64, PS, 16, windows=(None, 6))
    assert kv.allocate("a", 20)
    assert kv.num_used_pages == 10  # 5 pages in each group
    assert kv.slide("a", 8) == 0  # reads from 3: page 0 still live
    assert kv.slide("a", 9) == 1  # reads from 4: page 0 dead
    assert kv.live_start(1, 9) == 1 and kv.live_start(0, 9) == 0
    assert kv.slide("a", 9) == 0  # idempotent
    assert kv.slide("a", 20) == 2  # reads from 15: pages 1 and 2 dead, page 3 live
    assert kv.num_used_pages == 10 - 3
    kv.check_invariants()
    assert kv.free("a") == 5
    assert kv.num_used_pages == 0 and kv.num_free_pages == 64
    kv.check_invariants()


def test_a_released_page_is_reused_and_the_table_keeps_its_length():
    kv = KVCacheManager(6, PS, 8, windows=(None, 4))
    assert kv.allocate("a", 12)  # 3 pages a group: all 6
    assert not kv.allocate("b", 4)
    released = kv.group_tables["a"][0][:2]
    assert kv.slide("a", 12) == 2  # reads from 9: pages 0 and 1 dead
    assert kv.allocate("b", 4)  # one page per group, from the released ones
    assert set(kv.table_of("b") + kv.group_tables["b"][0]) == set(released)
    assert len(kv.group_tables["a"][0]) == len(kv.table_of("a")) == 3
    kv.check_invariants()


def test_a_prefix_hit_needs_the_window_of_every_group():
    """A finished prompt's window pages stay cached; with one evicted the hit shrinks to where
    the window's pages are all there, and the table starts with the window, not the prefix."""
    hasher = PageHasher(PS)
    tokens = list(range(100, 124))  # 6 full pages
    hashes: list[bytes] = []
    hasher.extend(hashes, tokens)
    kv = KVCacheManager(40, PS, 8, windows=(None, 6))
    assert kv.allocate("a", 24)
    kv.publish("a", hashes, 24)
    kv.slide("a", 24)
    kv.free("a")
    kv.check_invariants()
    hit = kv.match(hashes, 25)
    assert len(hit) == 6
    # Window 6 at position 24: keys from 19, pages 4 and 5.
    assert kv.prefix_pages(hit)[6:] == [kv._group_index[0][h] for h in hashes[4:6]]
    assert kv.allocate("b", 28, prefix=hit)
    group = kv.group_tables["b"][0]
    assert len(group) == 7 and group[4:6] == kv.prefix_pages(hit)[6:]
    kv.check_invariants()
    kv.free("b")
    kv.check_invariants()


def test_a_hit_is_cut_where_a_window_page_is_missing():
    """Local pages released before they were published hold nothing: a prompt that shares
    only the first 5 pages finds group 0's five cached, but no window of them complete."""
    hasher = PageHasher(PS)
    tokens = list(range(100, 124))
    hashes: list[bytes] = []
    hasher.extend(hashes, tokens)
    kv = KVCacheManager(40, PS, 8, windows=(None, 6))
    assert kv.allocate("a", 24)
    kv.slide("a", 24)  # pages 0-3 of the local group released unpublished: free, not cached
    kv.publish("a", hashes, 24)
    kv.free("a")
    assert len(kv.match(hashes, 25)) == 6  # the window at 24 (pages 4, 5) was published
    other: list[bytes] = []
    hasher.extend(other, tokens[:20] + [7] * 4)
    assert other[:5] == hashes[:5] and other[5] != hashes[5]
    assert kv.match(other, 25) == []
    kv.check_invariants()


def test_fresh_and_held_pages_count_every_group():
    kv = KVCacheManager(100, 16, 512, windows=(None, 512, 512))
    assert kv.fresh_pages(40, 1) == 3 * 2
    assert kv.fresh_pages(10, 3) == 0
    # 8k tokens, chunks of 256: group 0 holds 512 pages, each window group its 511 + 256 keys.
    assert kv.max_pages_held(8192, 256) == 512 + 2 * (-(-(511 + 256) // 16) + 1)
    assert kv.max_pages_held(100, 256) == 3 * 7


def test_trim_cuts_every_group_and_partial_pages_are_not_forked():
    kv = KVCacheManager(32, PS, 8, windows=(None, 8))
    assert kv.allocate("a", 24)
    assert kv.trim("a", 9) == 3 * 2
    assert len(kv.table_of("a")) == len(kv.group_tables["a"][0]) == 3
    kv.check_invariants()
    assert not kv.publish_partial("a", 2, PageHasher(PS).root(), [1, 2])
    with pytest.raises(ValueError, match="window"):
        KVCacheManager(8, PS, 4, windows=(4, None))


@pytest.mark.parametrize("seed", range(12))
def test_no_page_a_sequence_reads_is_written_by_another(seed):
    """Random admissions with prefix hits, chunked steps, slides and frees over a small pool
    of two windowed groups: each page's content is tracked as (group, the tokens of that page
    its writer computed), and every page a sequence may still read holds its own tokens."""
    rng = random.Random(seed)
    windows = (None, 5, 9)
    kv = KVCacheManager(48, PS, 12, windows=windows)
    hasher = PageHasher(PS)
    content: dict[int, tuple] = {}
    live: dict[str, dict] = {}

    def tables(sid):
        return [kv.table_of(sid), *kv.group_tables[sid]]

    def write(sid, start, end):
        s = live[sid]
        for g, table in enumerate(tables(sid)):
            for i in range(start // PS, -(-end // PS)):
                if i >= kv.live_start(g, start):
                    content[table[i]] = (g, tuple(s["tokens"][i * PS : min((i + 1) * PS, end)]))

    def check():
        kv.check_invariants()
        for sid, s in live.items():
            c = s["computed"]
            for g, table in enumerate(tables(sid)):
                for i in range(kv.live_start(g, c), kv.pages_for(c)):
                    expect = (g, tuple(s["tokens"][i * PS : min((i + 1) * PS, c)]))
                    assert content.get(table[i]) == expect, (sid, g, i)

    for n in range(300):
        op = rng.random()
        if op < 0.35 and len(live) < 5:
            sid = f"s{n}"
            prefix = rng.choice([[], [1] * 8, [2, 1] * 6, [2, 1] * 6 + [0] * 4])
            tokens = prefix + [rng.randrange(3) for _ in range(rng.randrange(2, 30))]
            hashes: list[bytes] = []
            hasher.extend(hashes, tokens)
            hit = kv.match(hashes, len(tokens))
            chunk = min(len(tokens) - len(hit) * PS, rng.randrange(1, 9))
            if kv.allocate(sid, len(hit) * PS + chunk, prefix=hit):
                live[sid] = dict(tokens=tokens, hashes=hashes, computed=len(hit) * PS)
                kv.record_query(len(tokens), len(hit) * PS)
                live[sid]["next"] = len(hit) * PS + chunk
        elif op < 0.85 and live:
            sid = rng.choice(list(live))
            s = live[sid]
            start, end = s["computed"], s["next"]
            write(sid, start, end)
            s["computed"] = end
            kv.publish(sid, s["hashes"], end)
            kv.slide(sid, end)
            if end < len(s["tokens"]):
                nxt = min(len(s["tokens"]), end + rng.randrange(1, 7))
                if kv.allocate(sid, nxt):
                    s["next"] = nxt
                else:
                    s["next"] = end  # waits (no pages): nothing to run
        elif live:
            sid = rng.choice(list(live))
            kv.free(sid)
            del live[sid]
        check()
    assert kv.stats.hits > 0  # the prefixes were shared at least once
