"""The prefix cache and page sharing of the KV manager, and the scheduler's use of them (no jax).

The scheduler tests run the fake model of tests/unit/helpers.py, which reads every token back
through the page tables: a cached page holding the wrong tokens, or handed out while another
request still writes it, changes the outputs. `CheckedRunner` also fails on any write into a
page that is shared or published, which identical tokens would otherwise hide.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.kv_cache_manager import KVCacheManager, PageHasher
from jaxserve.scheduling.request import Request, RequestStatus
from jaxserve.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, StepResult
from tests.unit.helpers import EOS, FakeRunner, make_scheduler, reference_output


def _hashes(hasher: PageHasher, tokens: list[int], salt: str | None = None) -> list[bytes]:
    out: list[bytes] = []
    hasher.extend(out, tokens, salt)
    return out


def _admit(kv: KVCacheManager, hasher: PageHasher, seq_id: str, tokens: list[int]) -> int:
    """Admits a sequence as the scheduler does and computes all its tokens; returns the hits."""
    hashes = _hashes(hasher, tokens)
    hit = kv.match(hashes, len(tokens))
    assert kv.allocate(seq_id, len(tokens), prefix=hit)
    kv.publish(seq_id, hashes, len(tokens))
    return len(hit)


# ---- hashes -------------------------------------------------------------------------------


def test_page_hash_chains_over_every_earlier_token_and_the_salts():
    h = PageHasher(page_size=2)
    a = _hashes(h, [1, 2, 3, 4, 5])
    assert len(a) == 2  # full pages only: token 5 is on a partial page
    assert _hashes(h, [1, 2, 3, 4]) == a
    b = _hashes(h, [9, 2, 3, 4])
    assert b[0] != a[0] and b[1] != a[1]  # page 1 has the same tokens but another parent
    assert _hashes(h, [3, 4, 1, 2]) != a  # the same pages in another order
    assert _hashes(h, [1, 2, 3, 4], salt="lora-7") != a
    assert _hashes(PageHasher(page_size=2, model_key="other-model"), [1, 2, 3, 4]) != a


def test_page_hashes_grow_from_the_tail_alone():
    h = PageHasher(page_size=3)
    tokens = list(range(10, 30))
    grown: list[bytes] = []
    h.extend(grown, tokens[:4])  # 1 full page; token 13 waits for its page to fill
    assert len(grown) == 1
    h.extend(grown, tokens[3:11])  # from position len(grown) * 3 = 3 on
    h.extend(grown, tokens[9:])
    assert grown == _hashes(h, tokens)


# ---- the manager --------------------------------------------------------------------------


def test_match_takes_whole_pages_and_leaves_the_last_token_to_compute():
    kv, h = KVCacheManager(num_pages=8, page_size=4, max_pages_per_seq=4), PageHasher(4)
    prompt = list(range(1, 13))  # 3 full pages
    assert _admit(kv, h, "a", prompt) == 0
    kv.free("a")
    assert kv.num_cached_pages == 3 and kv.num_used_pages == 0
    hashes = _hashes(h, prompt)
    assert len(kv.match(hashes, 12)) == 2  # all 12 cached, but token 12's logits are needed
    assert len(kv.match(hashes, 13)) == 3
    assert len(kv.match(_hashes(h, prompt[:6] + [99] * 6), 12)) == 1  # diverges in page 1
    assert kv.match(_hashes(h, [99, *prompt[1:]]), 12) == []


def test_shared_pages_are_counted_and_stay_used_until_the_last_holder_frees_them():
    kv, h = KVCacheManager(num_pages=8, page_size=4, max_pages_per_seq=4), PageHasher(4)
    _admit(kv, h, "a", list(range(1, 11)))  # pages: 2 full (published) + 1 partial
    assert _admit(kv, h, "b", [*range(1, 9), 50, 51]) == 2
    a, b = kv.page_table("a"), kv.page_table("b")
    assert a[:2] == b[:2] and a[2] != b[2]
    assert [kv.ref_count(p) for p in a] == [2, 2, 1]
    assert kv.num_used_pages == 4 and kv.num_private_pages("a") == 1
    kv.free("a")
    assert kv.num_used_pages == 3 and kv.num_cached_pages == 0  # b still holds the shared two
    kv.free("b")
    assert (kv.num_used_pages, kv.num_cached_pages, kv.num_free_pages) == (0, 2, 8)
    kv.check_invariants()


def test_cached_pages_are_evicted_least_recently_freed_first_and_tails_before_heads():
    kv, h = KVCacheManager(num_pages=6, page_size=2, max_pages_per_seq=4), PageHasher(2)
    _admit(kv, h, "old", [1, 2, 3, 4, 5])  # pages 0, 1 published, 2 partial
    _admit(kv, h, "new", [7, 8, 9, 10, 11])  # pages 3, 4 published, 5 partial
    kv.free("old")
    kv.free("new")
    assert kv.num_cached_pages == 4 and kv.stats.evictions == 0
    assert kv.allocate("x", 2) and kv.page_table("x") == [5]  # the free list comes first
    assert kv.allocate("y", 4) and kv.page_table("y") == [2, 1]  # then old's tail, then head
    assert kv.stats.evictions == 1
    assert kv.match(_hashes(h, [1, 2, 3, 4, 5]), 5) == [0]  # old lost its tail, not its head
    assert kv.match(_hashes(h, [7, 8, 9, 10, 11]), 5) == [3, 4]  # new's, freed later, survives
    kv.check_invariants()


def test_a_page_held_by_a_running_sequence_is_never_evicted():
    kv, h = KVCacheManager(num_pages=4, page_size=2, max_pages_per_seq=4), PageHasher(2)
    _admit(kv, h, "a", [1, 2, 3, 4, 5])
    assert _admit(kv, h, "b", [1, 2, 3, 4, 6]) == 2  # shares a's two published pages
    kv.free("a")
    shared = kv.page_table("b")[:2]
    assert kv.num_cached_pages == 0 and kv.num_free_pages == 1  # only a's partial page
    assert not kv.allocate("c", 4)  # 2 pages wanted, 1 free: the shared ones are not evictable
    assert kv.allocate("c", 2) and kv.page_table("b")[:2] == shared
    assert len(kv.match(_hashes(h, [1, 2, 3, 4, 9]), 5)) == 2
    kv.check_invariants()


def test_a_cached_prefix_is_not_double_counted_as_free_when_it_is_reused():
    kv, h = KVCacheManager(num_pages=3, page_size=2, max_pages_per_seq=4), PageHasher(2)
    _admit(kv, h, "a", [1, 2, 3, 4])
    kv.free("a")
    assert kv.num_free_pages == 3 and kv.num_cached_pages == 2
    hashes = _hashes(h, [1, 2, 3, 4, 5, 6])
    hit = kv.match(hashes, 6)
    assert len(hit) == 2
    # 2 cached pages reused + 2 fresh = 4 > 3: the cached two are not also free for the fresh.
    assert not kv.allocate("b", 8, prefix=hit)
    assert kv.num_cached_pages == 2 and kv.page_table("b") == []
    assert kv.allocate("b", 6, prefix=hit) and kv.page_table("b")[:2] == hit
    kv.check_invariants()


def test_two_sequences_computing_the_same_page_publish_it_once():
    kv, h = KVCacheManager(num_pages=4, page_size=2, max_pages_per_seq=2), PageHasher(2)
    hashes = _hashes(h, [1, 2, 3])
    assert kv.allocate("a", 3) and kv.allocate("b", 3)  # both admitted before either finished
    kv.publish("a", hashes, 3)
    kv.publish("b", hashes, 3)
    kv.free("a")
    kv.free("b")
    assert kv.num_cached_pages == 1  # b's copy went to the free list
    kv.check_invariants()


def test_a_corrupted_ref_count_is_detected():
    kv = KVCacheManager(num_pages=4, page_size=4, max_pages_per_seq=4)
    kv.allocate("a", 4)
    kv._refs[kv.page_table("a")[0]] += 1
    with pytest.raises(AssertionError, match="ref counts disagree"):
        kv.check_invariants()


@st.composite
def _manager_ops(draw):
    return draw(
        st.lists(
            st.tuples(
                st.sampled_from(["admit", "grow", "finish", "abort"]),
                st.integers(0, 5),  # which sequence
                st.integers(0, 3),  # which prefix family
                st.integers(1, 12),  # a length
            ),
            min_size=1,
            max_size=60,
        )
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_manager_ops(), page_size=st.integers(1, 4), num_pages=st.integers(3, 16))
def test_random_admits_grows_finishes_and_aborts_keep_the_books(ops, page_size, num_pages):
    """used + cached + free == total after every step, ref counts match the tables, no page is
    freed twice, and a matched page always holds the tokens its hash names."""
    kv, h = KVCacheManager(num_pages, page_size, max_pages_per_seq=8), PageHasher(page_size)
    families = [[f * 100 + i for i in range(40)] for f in range(4)]
    tokens: dict[str, list[int]] = {}  # live sequences: their computed tokens
    content: dict[int, tuple[int, ...]] = {}  # page -> tokens last written there
    cap = 8 * page_size
    for op, i, fam, n in ops:
        sid = f"s{i}"
        if op == "admit" and sid not in tokens:
            want = families[fam][: min(n + fam, cap)]
            hashes = _hashes(h, want)
            hit = kv.match(hashes, len(want))
            for j, page in enumerate(hit):  # what the cache serves is what its hash names
                assert content[page] == tuple(want[j * page_size : (j + 1) * page_size])
            if kv.allocate(sid, len(want), prefix=hit):
                table = kv.page_table(sid)
                for j in range(len(hit), len(table)):
                    assert kv.ref_count(table[j]) == 1  # written pages are private
                    content[table[j]] = tuple(want[j * page_size : (j + 1) * page_size])
                kv.publish(sid, hashes, len(want))
                tokens[sid] = want
        elif op == "grow" and sid in tokens and len(tokens[sid]) < cap:
            new = tokens[sid] + [7000 + n] * min(n, cap - len(tokens[sid]))
            pos = len(tokens[sid])
            if kv.allocate(sid, len(new)):
                table = kv.page_table(sid)
                for j in range(pos // page_size, len(table)):
                    assert kv.ref_count(table[j]) == 1, "a write into a shared page"
                    content[table[j]] = tuple(new[j * page_size : (j + 1) * page_size])
                kv.publish(sid, _hashes(h, new), len(new))
                tokens[sid] = new
        elif op in ("finish", "abort") and sid in tokens:
            held = kv.num_pages_of(sid)
            assert kv.free(sid) == held and kv.free(sid) == 0  # a second free frees nothing
            del tokens[sid]
        kv.check_invariants()
        assert kv.num_used_pages + kv.num_cached_pages + len(kv._free) == num_pages
    for sid in list(tokens):
        kv.free(sid)
    assert kv.num_used_pages == 0 and kv.num_free_pages == num_pages
    kv.check_invariants()


# ---- the scheduler ------------------------------------------------------------------------


class CheckedRunner(FakeRunner):
    """The fake model, failing on a write into a page another table lists or the cache holds."""

    def __init__(self, sched: Scheduler):
        super().__init__(sched.config.page_size)
        self.kv = sched.kv

    def execute(self, plan: SchedulerOutput) -> StepResult:
        for seq in plan.seqs:
            for pos in range(seq.start_pos, seq.end_pos):
                page = seq.page_table[pos // self.page_size]
                assert self.kv.ref_count(page) == 1, f"{seq.request_id} writes shared page {page}"
                assert self.kv._hash_of[page] is None, f"{seq.request_id} writes cached {page}"
        return super().execute(plan)


def _req(rid: str, prompt: list[int], max_tokens: int = 4, arrival: float = 0.0, **kw) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        arrival_time=arrival,
        eos_token_ids=(EOS,),
        **kw,
    )


def _serve(sched: Scheduler, runner: FakeRunner) -> list[SchedulerOutput]:
    plans = []
    while sched.has_unfinished():
        assert len(plans) < 1000
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
        sched.check_invariants()
        plans.append(plan)
    return plans


def test_a_repeated_prefix_is_served_from_the_cache_and_only_the_rest_is_computed():
    sched = make_scheduler(enable_prefix_caching=True)
    runner = CheckedRunner(sched)
    system = list(range(1, 21))  # 5 full pages of 4
    first = _req("first", [*system, 30, 31])
    sched.add_request(first)
    _serve(sched, runner)
    assert first.num_cached_tokens == 0
    second = _req("second", [*system, 40, 41, 42])
    sched.add_request(second)
    plan = sched.schedule()
    (seq,) = plan.seqs
    assert (seq.start_pos, len(seq.token_ids), plan.num_batched_tokens) == (20, 3, 3)
    assert seq.page_table[:5] == sched.kv.page_table("second")[:5]
    assert second.num_cached_tokens == 20
    sched.update(plan, runner.execute(plan))
    _serve(sched, runner)
    assert second.output_token_ids == reference_output(second)
    stats = sched.kv.stats
    assert (stats.queries, stats.hits) == (22 + 23, 20)


def test_a_prompt_of_whole_pages_recomputes_its_last_page():
    sched = make_scheduler(enable_prefix_caching=True)
    runner = CheckedRunner(sched)
    prompt = list(range(1, 17))  # exactly 4 pages
    sched.add_request(_req("a", prompt))
    _serve(sched, runner)
    again = _req("b", prompt)
    sched.add_request(again)
    plan = sched.schedule()
    assert (plan.seqs[0].start_pos, len(plan.seqs[0].token_ids)) == (12, 4)
    sched.update(plan, runner.execute(plan))
    _serve(sched, runner)
    assert again.output_token_ids == reference_output(again) and again.num_cached_tokens == 12


def test_the_token_budget_counts_only_the_tokens_left_to_compute():
    # 36 of late's 40 prompt tokens are cached: it takes 4 of the 16-token budget, and the
    # request behind it gets the other 12 in the same step.
    sched = make_scheduler(enable_prefix_caching=True, max_num_batched_tokens=16)
    runner = CheckedRunner(sched)
    prompt = list(range(1, 41))
    sched.add_request(_req("warm", prompt, max_tokens=1))
    _serve(sched, runner)
    sched.add_request(_req("late", prompt, arrival=1.0))
    sched.add_request(_req("other", list(range(300, 320)), arrival=2.0))
    plan = sched.schedule()
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in plan.seqs] == [
        ("late", 36, 4),
        ("other", 0, 12),
    ]
    assert plan.num_batched_tokens == 16


def test_different_salts_never_share_pages():
    sched = make_scheduler(enable_prefix_caching=True)
    runner = CheckedRunner(sched)
    prompt = list(range(1, 14))
    sched.add_request(_req("a", prompt, cache_salt="tenant-a"))
    _serve(sched, runner)
    b = _req("b", prompt, cache_salt="tenant-b")
    c = _req("c", prompt, cache_salt="tenant-a")
    sched.add_request(b)
    sched.add_request(c)
    _serve(sched, runner)
    assert (b.num_cached_tokens, c.num_cached_tokens) == (0, 12)


def test_a_preempted_request_resumes_from_its_own_cached_pages():
    # 7 pages of 4: two requests of 12-token prompts growing to 16 tokens cannot both fit.
    sched = make_scheduler(enable_prefix_caching=True, num_pages=7, max_num_seqs=2)
    runner = CheckedRunner(sched)
    a = _req("a", list(range(1, 13)), max_tokens=8, arrival=0.0)
    b = _req("b", list(range(100, 112)), max_tokens=8, arrival=1.0)
    sched.add_request(a)
    sched.add_request(b)
    plans = _serve(sched, runner)
    preempted = [p for p in plans if p.preempted_ids]
    assert preempted and b.num_preemptions >= 1
    resumed = next(
        s for p in plans[plans.index(preempted[0]) + 1 :] for s in p.seqs if s.request_id == "b"
    )
    assert resumed.start_pos > 0  # not from scratch: its full pages were still cached
    assert a.output_token_ids == reference_output(a)
    assert b.output_token_ids == reference_output(b)
    assert sched.kv.num_used_pages == 0 and sched.kv.num_cached_pages > 0


def test_priority_preemption_counts_only_the_pages_a_victim_frees():
    # The low-priority victim shares its 3 prompt pages with a running peer more important than
    # the urgent request: preempting the victim frees only its private page, too few for the
    # urgent request's 6, so nothing is preempted.
    sched = make_scheduler(
        enable_prefix_caching=True, policy="priority", num_pages=9, max_num_seqs=4
    )
    runner = CheckedRunner(sched)
    shared = list(range(1, 13))
    peer = _req("peer", [*shared, 50], max_tokens=20, arrival=0.0, priority=-10)
    sched.add_request(peer)
    for _ in range(2):
        plan = sched.schedule(now=0.0)
        sched.update(plan, runner.execute(plan), now=0.0)
    low = Request(
        request_id="low",
        prompt_token_ids=[*shared, 60],
        sampling_params=SamplingParams(max_tokens=20),
        arrival_time=0.0,
        priority=5,
        eos_token_ids=(EOS,),
    )
    sched.add_request(low)
    plan = sched.schedule(now=0.0)
    sched.update(plan, runner.execute(plan), now=0.0)
    assert low.status == RequestStatus.RUNNING and low.num_cached_tokens == 12
    assert sched.kv.num_private_pages("low") == 1
    urgent = Request(
        request_id="urgent",
        prompt_token_ids=list(range(200, 224)),  # 6 pages
        sampling_params=SamplingParams(max_tokens=4),
        arrival_time=0.0,
        priority=-5,
        eos_token_ids=(EOS,),
    )
    free = sched.kv.num_free_pages
    assert free < 6 <= free + sched.kv.num_pages_of("low")  # counting shared pages would fit
    sched.add_request(urgent)
    plan = sched.schedule(now=0.0)
    assert plan.preempted_ids == [] and urgent.status == RequestStatus.WAITING
    sched.update(plan, runner.execute(plan), now=0.0)
    sched.check_invariants()


@st.composite
def _shared_workloads(draw):
    page_size = draw(st.integers(1, 6))
    max_model_len = draw(st.integers(8, 48))
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 5))
    low = max_num_seqs if chunked else max(max_num_seqs, max_model_len)
    pages_for_one = -(-max_model_len // page_size)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(low, low + 32)),
        num_pages=draw(st.integers(pages_for_one, 3 * pages_for_one)),
        page_size=page_size,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_prefix_caching=True,
    )
    prefixes = [[p * 50 + i + 1 for i in range(max_model_len)] for p in range(3)]
    specs = []
    for i in range(draw(st.integers(1, 12))):
        plen = draw(st.integers(1, max_model_len - 1))
        shared = draw(st.integers(0, plen))
        fam = draw(st.integers(0, 2))
        tail = draw(st.lists(st.integers(1, 400), min_size=plen - shared, max_size=plen - shared))
        specs.append(
            dict(
                id=f"r{i}",
                arrive=draw(st.integers(0, 10)),
                prompt=prefixes[fam][:shared] + tail,
                max_tokens=draw(st.integers(1, max_model_len - plen)),
                priority=draw(st.integers(0, 2)),
                abort_at=draw(st.none() | st.integers(0, 30)),
            )
        )
    return config, specs


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(work=_shared_workloads())
def test_random_shared_prefix_workloads_give_the_uncached_outputs(work):
    """Admissions, preemptions and aborts over prompts that share prefixes: the books balance
    after every step, no step writes a shared or cached page, and every output is the one the
    fake model gives the request alone."""
    config, specs = work
    sched = Scheduler(config)
    runner = CheckedRunner(sched)
    accepted = {}
    for now in range(600):
        for spec in (s for s in specs if s["arrive"] == now):
            req = Request(
                request_id=spec["id"],
                prompt_token_ids=spec["prompt"],
                sampling_params=SamplingParams(max_tokens=spec["max_tokens"]),
                arrival_time=float(now),
                priority=spec["priority"],
                eos_token_ids=(EOS,),
            )
            sched.add_request(req)
            accepted[spec["id"]] = (spec, req)
        for spec, _ in accepted.values():
            if spec["abort_at"] == now:
                sched.abort_request(spec["id"])
        plan = sched.schedule(now=float(now))
        sched.update(plan, runner.execute(plan), now=float(now))
        sched.check_invariants()
        kv = sched.kv
        assert kv.num_used_pages + kv.num_cached_pages + len(kv._free) == config.num_pages
        if now > 10 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert sched.kv.num_used_pages == 0
    for spec, req in accepted.values():
        ref = reference_output(req)
        if spec["abort_at"] is not None and req.finish_reason == "abort":
            assert req.output_token_ids == ref[: len(req.output_token_ids)]
        else:
            assert req.output_token_ids == ref
