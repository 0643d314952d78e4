"""Copy on write of partial pages (issue 47, item 4): the KV manager's partial-page books and the
scheduler's forks for beams and n > 1 samples (no jax).

The scheduler tests run the fake model of tests/unit/helpers.py, which copies the pages a plan
forks and reads every token back through the page tables: a fork from the wrong page, of too many
slots, or one the runner never copied changes the outputs.
"""

from __future__ import annotations

import pytest

from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.kv_cache_manager import PARTIAL_CANDIDATES, KVCacheManager, PageHasher
from jaxserve.scheduling.request import Request
from tests.unit.helpers import EOS, FakeRunner, make_scheduler, reference_output

ROOT = PageHasher(4).root()


def _kv(num_pages: int = 8) -> KVCacheManager:
    return KVCacheManager(num_pages=num_pages, page_size=4, max_pages_per_seq=8)


# ---- the KV manager -----------------------------------------------------------------------


def test_a_partial_page_matches_the_longest_agreeing_tokens_up_to_the_limit():
    kv = _kv()
    assert kv.allocate("a", 3) and kv.allocate("b", 3)
    (pa,), (pb,) = kv.page_table("a"), kv.page_table("b")
    assert kv.publish_partial("a", 0, ROOT, [5, 6, 7])
    assert kv.publish_partial("b", 0, ROOT, [5, 9, 9])
    assert kv.match_partial(ROOT, [5, 6, 7, 8], limit=3) == (pa, 3)
    assert kv.match_partial(ROOT, [5, 6, 7, 8], limit=2) == (pa, 2)  # the last is computed
    assert kv.match_partial(ROOT, [5, 9, 1], limit=3) == (pb, 2)
    assert kv.match_partial(ROOT, [5, 1], limit=3) in {(pa, 1), (pb, 1)}
    assert kv.match_partial(ROOT, [6, 6, 7], limit=3) is None  # another first token
    assert kv.match_partial(PageHasher(4).root("salt"), [5, 6, 7], limit=3) is None
    assert kv.match_partial(ROOT, [5, 6, 7], limit=0) is None
    kv.check_invariants()


def test_a_partial_page_is_published_once_by_its_only_holder():
    kv = _kv()
    assert kv.allocate("a", 3)
    assert not kv.publish_partial("a", 0, ROOT, [])
    assert not kv.publish_partial("a", 0, ROOT, [1, 2, 3, 4])  # a whole page is hashed instead
    assert not kv.publish_partial("a", 1, ROOT, [1])  # no such page
    assert kv.publish_partial("a", 0, ROOT, [1, 2])
    assert not kv.publish_partial("a", 0, ROOT, [1, 2, 3])  # published already
    page = kv.page_table("a")[0]
    assert kv.allocate("b", 4, prefix=[], fork=page)
    assert not kv.publish_partial("nobody", 0, ROOT, [1])
    kv.check_invariants()


def test_a_freed_partial_page_is_cached_then_evicted_and_forgotten():
    kv = _kv(num_pages=2)
    assert kv.allocate("a", 3)
    (page,) = kv.page_table("a")
    kv.publish_partial("a", 0, ROOT, [1, 2, 3])
    kv.free("a")
    assert (kv.num_cached_pages, kv.num_used_pages) == (1, 0)
    assert kv.match_partial(ROOT, [1, 2, 3, 4], 3) == (page, 3)
    assert kv.allocate("b", 8)  # both pages: the free one, then the cached one evicted
    assert kv.stats.evictions == 1 and kv.match_partial(ROOT, [1, 2, 3, 4], 3) is None
    kv.check_invariants()
    kv.free("b")
    assert kv.num_free_pages == 2 and kv.num_cached_pages == 0  # nothing published any more


def test_a_fork_keeps_its_source_from_eviction_and_copies_into_a_fresh_page():
    kv = _kv(num_pages=3)
    assert kv.allocate("a", 3)
    (src,) = kv.page_table("a")
    kv.publish_partial("a", 0, ROOT, [1, 2, 3])
    kv.free("a")  # cached: the only evictable page besides the 2 free ones
    assert not kv.allocate("b", 12, fork=src)  # 3 pages would need the source itself
    assert kv.page_table("b") == [] and kv.num_cached_pages == 1
    assert kv.allocate("b", 8, fork=src)
    table = kv.page_table("b")
    assert src not in table and len(table) == 2
    assert kv.match_partial(ROOT, [1, 2, 3], 3) == (src, 3)  # still there for the next fork
    kv.check_invariants()
    with pytest.raises(ValueError, match="cannot fork page"):
        kv.allocate("c", 4, fork=table[0])  # not a partial page
    with pytest.raises(ValueError, match="cannot fork page"):
        kv.allocate("b", 12, fork=src)  # into a table that holds pages already


def test_dropping_the_cache_forgets_partial_pages():
    kv = _kv()
    assert kv.allocate("a", 3)
    kv.publish_partial("a", 0, ROOT, [1, 2, 3])
    kv.free("a")
    assert kv.drop_published() == 0 and kv.num_cached_pages == 0
    assert kv.match_partial(ROOT, [1, 2, 3, 4], 3) is None
    kv.check_invariants()


def test_only_the_most_recent_partial_pages_of_a_key_are_compared():
    kv = KVCacheManager(num_pages=64, page_size=4, max_pages_per_seq=8)
    for i in range(PARTIAL_CANDIDATES + 1):  # the oldest one agrees longest
        assert kv.allocate(f"s{i}", 3)
        kv.publish_partial(f"s{i}", 0, ROOT, [7, 8, 9] if i == 0 else [7, 100 + i, 0])
    assert kv.match_partial(ROOT, [7, 8, 9, 1], 3)[1] == 1
    kv.free(f"s{PARTIAL_CANDIDATES}")  # cached, still a candidate
    kv.check_invariants()


def test_the_books_catch_a_stray_partial_entry():
    kv = _kv()
    assert kv.allocate("a", 3)
    kv.publish_partial("a", 0, ROOT, [1, 2, 3])
    kv._partials.clear()
    with pytest.raises(AssertionError, match="partial-page index"):
        kv.check_invariants()


# ---- the scheduler ------------------------------------------------------------------------


def _req(rid: str, prompt: list[int], max_tokens: int = 1, **kw) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **kw.pop("params", {})),
        arrival_time=0.0,
        eos_token_ids=(EOS,),
        **kw,
    )


def _run(sched, runner: FakeRunner, plans: list | None = None) -> None:
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
        sched.check_invariants()
        if plans is not None:
            plans.append(plan)


def test_a_beams_child_forks_its_parents_partial_page_and_computes_one_token():
    sched = make_scheduler(enable_prefix_caching=True)
    runner = FakeRunner(4)
    prompt = list(range(1, 11))  # 2 full pages of 4 and 2 tokens on a partial page
    parent = _req("parent", prompt)
    sched.add_request(parent)
    _run(sched, runner)
    src = sched.kv.match_partial(sched.prefix._parent(parent, 2), [9, 10], 2)
    assert src is not None and src[1] == 2
    child = _req("child", [*prompt, *parent.output_token_ids], max_tokens=3)
    sched.add_request(child)
    plan = sched.schedule()
    (seq,) = plan.seqs
    table = sched.kv.page_table("child")
    assert plan.page_copies == [(src[0], table[2])] and src[0] != table[2]
    assert (seq.start_pos, len(seq.token_ids)) == (10, 1)
    assert child.num_cached_tokens == 10
    sched.update(plan, runner.execute(plan))
    _run(sched, runner)
    assert child.output_token_ids == reference_output(child)
    assert (sched.kv.stats.queries, sched.kv.stats.hits) == (10 + 11, 8 + 2)


def test_the_n_samples_of_a_prompt_wait_for_its_partial_page_and_fork_it():
    sched = make_scheduler(enable_prefix_caching=True)
    runner = FakeRunner(4)
    prompt = list(range(1, 8))  # 1 full page and 3 tokens on a partial page
    reqs = [_req(f"n{i}", prompt, max_tokens=4, params={"seed": i}) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    plans: list = []
    _run(sched, runner, plans)
    first = plans[0]
    assert [s.request_id for s in first.seqs] == ["n0"]  # the others wait for its pages
    forks = [
        s for p in plans for s in p.seqs if s.page_table[1] in {dst for _, dst in p.page_copies}
    ]
    assert sorted(s.request_id for s in forks) == ["n1", "n2", "n3"]
    for seq in forks:
        assert (seq.start_pos, len(seq.token_ids)) == (6, 1)  # 4 cached + 2 copied
    # All in one plan: a sibling that forked does not make those behind it wait for it.
    assert [len(p.page_copies) for p in plans if p.page_copies] == [3]
    for r in reqs:
        assert r.output_token_ids == reference_output(r)
    assert [r.num_cached_tokens for r in reqs] == [0, 6, 6, 6]


def test_no_fork_without_forking_for_prompt_logprobs_or_for_another_salt():
    prompt = list(range(1, 11))

    def child_plan(fork: bool, **child_kw):
        sched = make_scheduler(enable_prefix_caching=True, fork_partial_pages=fork)
        runner = FakeRunner(4)
        sched.add_request(_req("parent", prompt))
        _run(sched, runner)
        sched.add_request(_req("child", [*prompt, 3], **child_kw))
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
        _run(sched, runner)
        return plan

    plan = child_plan(True)
    assert plan.page_copies and plan.seqs[0].start_pos == 10
    plan = child_plan(False)
    assert not plan.page_copies and plan.seqs[0].start_pos == 8
    plan = child_plan(True, cache_salt="other")
    assert not plan.page_copies and plan.seqs[0].start_pos == 0
    plan = child_plan(True, params={"prompt_logprobs": 1})
    assert not plan.page_copies and plan.seqs[0].start_pos == 0


def test_a_fork_that_would_need_a_preemption_computes_the_page_instead():
    # 3 pages: the parent's partial page cached, one running request holding another page:
    # a child needing 2 fresh pages beside the kept source does not fit, so it does not fork.
    sched = make_scheduler(enable_prefix_caching=True, num_pages=4, max_num_seqs=2)
    runner = FakeRunner(4)
    parent = _req("parent", [1, 2, 3])
    sched.add_request(parent)
    _run(sched, runner)
    sched.add_request(_req("busy", [50, 51, 52, 53, 54], max_tokens=3))
    plan = sched.schedule()
    sched.update(plan, runner.execute(plan))
    child = _req("child", [1, 2, 3, *parent.output_token_ids, 9, 9, 9, 9], max_tokens=1)
    sched.add_request(child)
    plans: list = []
    _run(sched, runner, plans)
    assert not any(p.page_copies for p in plans)
    assert child.output_token_ids == reference_output(child)


def test_a_fork_must_spare_at_least_two_tokens():
    sched = make_scheduler(enable_prefix_caching=True)
    runner = FakeRunner(4)
    sched.add_request(_req("parent", [1, 2, 3]))
    _run(sched, runner)
    one = _req("one", [1, 9, 9])  # agrees on its first token alone: computes it all
    two = _req("two", [1, 2, 9])  # agrees on two: forks them
    for req in (one, two):
        sched.add_request(req)
        plan = sched.schedule()
        (seq,) = plan.seqs
        sched.update(plan, runner.execute(plan))
        _run(sched, runner)
        assert req.output_token_ids == reference_output(req)
        assert (seq.start_pos, len(plan.page_copies)) == ((0, 0) if req is one else (2, 1))


def test_siblings_do_not_wait_for_a_partial_page_they_could_not_fork():
    # 2 tokens on a partial page: a sibling could fork only 1 of them, below MIN_FORK_TOKENS,
    # so it computes its page beside the first rather than waiting for it.
    sched = make_scheduler(enable_prefix_caching=True)
    runner = FakeRunner(4)
    reqs = [_req(f"n{i}", [1, 2], max_tokens=2, params={"seed": i}) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    plans: list = []
    _run(sched, runner, plans)
    assert sorted(s.request_id for s in plans[0].seqs) == ["n0", "n1"]
    assert not any(p.page_copies for p in plans)
    for r in reqs:
        assert r.output_token_ids == reference_output(r)
