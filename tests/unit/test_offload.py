"""Swap preemption and the host tier of the prefix cache, on the fake model: no jax.

`CopyingRunner` makes the page copies each plan asks for (swap_out, swap_in) between the fake
model's device cache and a fake host cache, in the engine's order, before running the step. A
request restored from the wrong host pages, a page reused while its copy is still to be made, or
a swapped request continuing without its pages, reads other tokens back and changes the outputs,
which `reference_output` tells.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.host_pool import HostPagePool
from jaxserve.scheduling.offload import SwapPricer
from jaxserve.scheduling.request import FinishReason, Request, RequestStatus
from jaxserve.scheduling.scheduler import RequestRejected, Scheduler, SchedulerConfig
from tests.unit.helpers import EOS, FakeRunner, reference_output


class CopyingRunner(FakeRunner):
    """The fake model plus a host cache: copies pages as the plan says, then runs the step."""

    def __init__(self, page_size: int):
        super().__init__(page_size)
        self.host: dict[int, int] = {}  # host slot -> token id
        self.copies = collections.Counter()
        self.ahead: list = []  # the last plan's swap_in, staged: written before this step

    def _copy(self, src: dict, src_page: int, dst: dict, dst_page: int, values=None) -> None:
        ps = self.page_size
        for i in range(ps):
            value = src.get(src_page * ps + i) if values is None else values[i]
            dst.pop(dst_page * ps + i, None)
            if value is not None:
                dst[dst_page * ps + i] = value

    def execute(self, plan):
        ps = self.page_size
        # The engine's order: the last plan's restores are written; then this plan's host
        # reads (staged for the next plan), device reads and host writes; then its forked
        # pages are copied.
        for dev, values in self.ahead:
            self._copy({}, 0, self.cache, dev, values)

        def stage(pairs):
            return [(d, [self.host.get(h * ps + i) for i in range(ps)]) for h, d in pairs]

        self.ahead = stage(plan.swap_in)
        for dev, host in plan.swap_out:
            self._copy(self.cache, dev, self.host, host)
        self.fork_pages(plan)  # forked partial pages: after the saves read what they evict
        self.copies.update(out=len(plan.swap_out), into=len(plan.swap_in))
        return self.run_step(plan)


def _config(**overrides) -> SchedulerConfig:
    base = dict(
        max_num_seqs=4,
        max_num_batched_tokens=16,
        num_pages=12,
        page_size=4,
        max_model_len=40,
        num_host_pages=64,
        preemption="swap",
    )
    return SchedulerConfig(**{**base, **overrides})


def _run(sched: Scheduler, runner: CopyingRunner, ahead: bool = True, max_steps: int = 2000):
    """Steps to the end, the next plan made before the last one's update when `ahead`."""
    in_flight = collections.deque()
    for _ in range(max_steps):
        if not sched.has_unfinished() and not in_flight:
            return
        plan = sched.schedule()
        in_flight.append((plan, runner.execute(plan)))
        while len(in_flight) > (1 if ahead and not plan.is_empty else 0):
            sched.update(*in_flight.popleft())
            sched.check_invariants()
    raise AssertionError("the scheduler made no progress")


def _requests(n: int, prompt_len: int, max_tokens: int, shared: int = 0) -> list[Request]:
    """Requests whose prompts share their first `shared` tokens, then differ."""
    return [
        Request(
            request_id=f"r{i}",
            prompt_token_ids=[7] * shared + [1 + (5 * i + j) % 40 for j in range(prompt_len)],
            sampling_params=SamplingParams(max_tokens=max_tokens),
            arrival_time=float(i),
            eos_token_ids=(EOS,),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_swapped_requests_continue_exactly_and_recompute_nothing(mode):
    """Four requests on pages for ~2: victims swap (or recompute) and outputs do not change."""
    sched = Scheduler(_config(preemption=mode, enable_prefix_caching=False))
    runner = CopyingRunner(4)
    reqs = _requests(4, prompt_len=10, max_tokens=16)
    for req in reqs:
        sched.add_request(req)
    _run(sched, runner)
    stats = sched.offload.stats
    for req in reqs:
        assert req.output_token_ids == reference_output(req)
    assert stats.swap_preemptions + stats.recompute_preemptions == sched.num_preemptions > 0
    if mode == "swap":
        assert stats.recompute_preemptions == 0 and stats.recomputed_tokens == 0
        assert stats.pages_swapped_in == stats.pages_swapped_out == runner.copies["into"] > 0
    else:
        assert stats.swap_preemptions == 0 and stats.recomputed_tokens > 0
        assert not +runner.copies  # no page copied
    assert sched.offload.host.num_swapped_pages == 0


def test_auto_swaps_only_where_the_copy_is_cheaper_than_the_prefill():
    """The pricer decides per victim: a slow host link recomputes, a fast one swaps."""
    for bandwidth, want_swaps in ((1.0, False), (1e12, True)):
        sched = Scheduler(_config(preemption="auto", enable_prefix_caching=False))
        sched.offload.pricer = SwapPricer(
            bytes_per_page=1024, host_bytes_per_s=bandwidth, prefill_seconds=lambda n: 1e-3 * n
        )
        reqs = _requests(4, prompt_len=10, max_tokens=16)
        for req in reqs:
            sched.add_request(req)
        _run(sched, CopyingRunner(4))
        stats = sched.offload.stats
        assert (stats.swap_preemptions > 0) == want_swaps
        assert (stats.recompute_preemptions > 0) != want_swaps
        assert [r.output_token_ids for r in reqs] == [reference_output(r) for r in reqs]


def test_a_kept_page_offered_again_becomes_the_most_recently_used():
    """The host tier evicts its least recently used page first. Offering a hash it keeps
    already copies nothing (None) but refreshes it: the next fresh page evicts the oldest
    other page, not the one just offered."""
    pool = HostPagePool(3)
    a, b, c, d, e = (bytes([i]) * 8 for i in range(5))
    pages = {h: pool.offer(h) for h in (a, b, c)}
    assert sorted(pages.values()) == [0, 1, 2] and pool.num_cached_pages == 3
    assert pool.offer(a) is None  # kept already: no copy, now the newest
    assert pool.offer(d) == pages[b]  # b, not a, is the least recently used: c, a, d
    assert pool.match([b]) == [] and pool.stats.host_evictions == 1
    # A prefix hit refreshes too: once c is read, a is the oldest (a, d, c).
    assert pool.match([c]) == [pages[c]]
    assert pool.offer(e) == pages[a]
    assert pool.match([a]) == [] and pool.match([d, c, e]) == [pages[b], pages[c], pages[a]]
    pool.check_invariants()


def test_a_full_host_pool_makes_victims_recompute():
    """A victim whose pages the host pool cannot hold recomputes; nothing is half swapped."""
    sched = Scheduler(_config(num_host_pages=1, enable_prefix_caching=False))
    reqs = _requests(4, prompt_len=10, max_tokens=16)
    for req in reqs:
        sched.add_request(req)
    _run(sched, CopyingRunner(4))
    assert sched.offload.stats.swap_preemptions == 0 < sched.offload.stats.recompute_preemptions
    assert [r.output_token_ids for r in reqs] == [reference_output(r) for r in reqs]


def test_evicted_prefix_pages_are_restored_from_the_host_tier():
    """A prompt's pages evicted from the device are served from the host on its return."""
    sched = Scheduler(_config(preemption="recompute", num_pages=10))
    runner = CopyingRunner(4)
    first = _requests(1, prompt_len=4, max_tokens=2, shared=28)[0]  # 8 pages, 7 full of prompt
    sched.add_request(first)
    _run(sched, runner)
    for req in _requests(3, prompt_len=24, max_tokens=8):  # fill the device: evicts first's
        sched.add_request(Request(**{**_fields(req), "request_id": "other-" + req.request_id}))
    _run(sched, runner)
    again = Request(**{**_fields(first), "request_id": "again"})
    sched.add_request(again)
    _run(sched, runner)
    stats = sched.offload.stats
    assert stats.pages_offloaded > 0 and stats.host_hits >= 4 * 4
    assert again.num_cached_tokens >= stats.host_hits
    assert again.output_token_ids == reference_output(again) == first.output_token_ids
    assert runner.copies["into"] >= stats.host_hits // 4


def test_aborting_a_swapped_request_frees_its_host_pages():
    sched = Scheduler(_config(enable_prefix_caching=False))
    reqs = _requests(4, prompt_len=10, max_tokens=16)
    for req in reqs:
        sched.add_request(req)
    runner = CopyingRunner(4)
    for _ in range(200):
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
        swapped = sched.offload.host.swapped_ids()
        if swapped:
            break
    assert swapped, "no request was swapped"
    assert sched.abort_request(swapped[0])
    plan = sched.schedule()
    sched.update(plan, runner.execute(plan))
    sched.check_invariants()
    assert not sched.offload.host.is_swapped(swapped[0])
    assert sched.get_request(swapped[0]) is None
    _run(sched, runner)
    assert sched.offload.host.num_used_pages == sched.offload.host.num_cached_pages


def _fields(req: Request) -> dict:
    return dict(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling_params=req.sampling_params,
        arrival_time=req.arrival_time,
        eos_token_ids=req.eos_token_ids,
    )


@st.composite
def _setups(draw):
    page_size = draw(st.integers(1, 4))
    max_model_len = draw(st.integers(8, 32))
    max_num_seqs = draw(st.integers(1, 4))
    pages_for_one = -(-max_model_len // page_size)
    mode = draw(st.sampled_from(["swap", "auto"]))
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, max_num_seqs + 16)),
        num_pages=draw(st.integers(pages_for_one, pages_for_one + 4)),
        page_size=page_size,
        max_model_len=max_model_len,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        num_host_pages=draw(st.integers(1, 3 * pages_for_one)),
        preemption=mode,
    )
    # Prompts over a tiny alphabet with common starts: the prefix caches of both tiers hit.
    stems = draw(st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=12), min_size=1))
    specs = []
    for i in range(draw(st.integers(1, 12))):
        stem = draw(st.sampled_from(stems))
        prompt = (stem + draw(st.lists(st.integers(1, 3), max_size=6)))[: max_model_len // 2]
        specs.append(
            dict(
                id=f"r{i}",
                arrive=draw(st.integers(0, 20)),
                prompt=prompt,
                max_tokens=draw(st.integers(1, max_model_len - len(prompt) + 1)),
                priority=draw(st.integers(0, 2)),
                abort_at=draw(st.none() | st.integers(0, 40)),
            )
        )
    bandwidth = draw(st.sampled_from([1e2, 1e4, 1e6]))
    return config, specs, bandwidth


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=_setups())
def test_random_workloads_with_swaps_keep_the_books_and_the_outputs(ahead, setup):
    """Admissions, preemptions (swapped or recomputed), aborts and prefix hits of both tiers:
    the device and host books balance after every step, and every output is exact."""
    config, specs, bandwidth = setup
    sched, runner = Scheduler(config), CopyingRunner(config.page_size)
    sched.offload.pricer = SwapPricer(
        bytes_per_page=100, host_bytes_per_s=bandwidth, prefill_seconds=lambda n: 1e-3 * n
    )
    accepted: dict[str, tuple[dict, Request]] = {}
    in_flight = collections.deque()
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
            try:
                sched.add_request(req)
            except RequestRejected:
                assert req.max_num_tokens > config.max_model_len
                continue
            accepted[spec["id"]] = (spec, req)
        for spec, _ in accepted.values():
            if spec["abort_at"] == now:
                sched.abort_request(spec["id"])
        plan = sched.schedule(now=float(now))
        for seq in plan.seqs:
            assert seq.request.status == RequestStatus.RUNNING
        in_flight.append((plan, runner.execute(plan), float(now)))
        while len(in_flight) > (1 if ahead and not plan.is_empty else 0):
            sched.update(*in_flight.popleft())
            sched.check_invariants()
        if now > 20 and not sched.has_unfinished() and not in_flight:
            break
    assert not sched.has_unfinished(), "requests left unfinished"
    host = sched.offload.host
    assert host.num_swapped_pages == 0 and host.num_used_pages == host.num_cached_pages
    assert sched.num_pages_used == 0
    for _, req in accepted.values():
        ref = reference_output(req)
        if req.finish_reason == FinishReason.ABORT:
            assert req.output_token_ids == ref[: req.num_output_tokens]
        else:
            assert req.output_token_ids == ref


def test_a_fork_into_a_page_the_host_tier_saves_copies_after_the_save():
    """Three device pages: a fork's fresh page is the evicted last page of a cached prompt,
    which the host tier saves in the same plan. The save must read the old content before the
    copy writes the new, or the prompt's later host hit restores the forked tokens."""
    sched = Scheduler(_config(num_pages=3, preemption="recompute"))
    runner = CopyingRunner(4)

    def req(rid: str, prompt: list[int], max_tokens: int = 1) -> Request:
        return Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=max_tokens),
            arrival_time=0.0,
            eos_token_ids=(EOS,),
        )

    for r in (req("a", list(range(10, 18))), req("p", [1, 2, 3])):
        sched.add_request(r)
        _run(sched, runner)
    child = req("child", [1, 2, 3, 9, 5, 5, 5, 5])
    sched.add_request(child)
    plan = sched.schedule()
    assert plan.page_copies and plan.swap_out  # forked into a page whose save is this plan's
    assert plan.page_copies[0][1] in {dev for dev, _ in plan.swap_out}
    sched.update(plan, runner.execute(plan))
    _run(sched, runner)
    again = req("again", [*range(10, 18), 4], max_tokens=3)
    sched.add_request(again)
    _run(sched, runner)
    assert sched.offload.stats.host_hits > 0
    assert child.output_token_ids == reference_output(child)
    assert again.output_token_ids == reference_output(again)
