"""Requests that arrive together with one prompt compute it once: the rest wait for its pages.

Without this, n samples of one prompt (or a burst sharing a system prompt) admitted in the same
step all miss the prefix cache, since nothing is published yet, and each computes the whole
prompt. The scheduler instead holds a request whose next uncached full page another running
request is computing, and admits it from the cache once that page is published.
"""

from __future__ import annotations

import collections

import pytest

from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.request import Request
from tests.unit.helpers import EOS, FakeRunner, make_scheduler, reference_output


def _req(rid: str, prompt: list[int], arrival: float) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=6),
        arrival_time=arrival,
        eos_token_ids=(EOS,),
    )


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("budget", [64, 16], ids=["whole-prompt", "chunked"])
def test_four_requests_with_one_prompt_compute_it_once(ahead, budget):
    sched = make_scheduler(enable_prefix_caching=True, max_num_batched_tokens=budget)
    runner = FakeRunner(sched.config.page_size)
    prompt = [3 + i % 17 for i in range(40)]  # 10 full pages of 4
    same = [_req(f"s{i}", prompt, arrival=float(i)) for i in range(4)]
    other = _req("other", [50 + i for i in range(10)], arrival=9.0)
    for req in [*same, other]:
        sched.add_request(req)
    computed = 0
    in_flight: collections.deque = collections.deque()
    while sched.has_unfinished() or in_flight:
        plan = sched.schedule()
        computed += sum(len(s.token_ids) for s in plan.seqs if s.start_pos < 40)
        in_flight.append((plan, runner.execute(plan)))
        while len(in_flight) > (1 if ahead and not plan.is_empty else 0):
            sched.update(*in_flight.popleft())
        sched.check_invariants()
        assert len(sched.prefix.computing) <= 10 + 2  # the prompt's pages once; other's 2
    for req in [*same, other]:
        assert req.output_token_ids == reference_output(req)
    # s0 computes all 40; each other sample takes 9 pages from the cache and computes the last
    # 4 tokens (a match leaves the last prompt token to compute); `other` its own 10, plus the
    # decode tokens, which start at position >= 40 only for the 40-token prompts.
    assert [r.num_cached_tokens for r in same] == [0, 36, 36, 36]
    assert computed == 40 + 3 * 4 + 10 + 5  # other's 5 decodes run at positions 10..14
    assert not sched.prefix.computing and not sched.prefix.claims


def test_a_request_computing_the_pages_that_is_preempted_releases_the_waiters():
    # Two pages of room beyond the first request: the second request cannot wait forever for a
    # first one that was preempted (its registrations go with it).
    sched = make_scheduler(enable_prefix_caching=True, num_pages=16, max_num_batched_tokens=8)
    runner = FakeRunner(sched.config.page_size)
    prompt = list(range(1, 41))
    first, second = _req("a", prompt, 0.0), _req("b", prompt, 1.0)
    sched.add_request(first)
    sched.add_request(second)
    sched.update(plan := sched.schedule(), runner.execute(plan))
    assert [s.request_id for s in plan.seqs] == ["a"]  # b waits for a's pages
    assert sched.prefix.computing and all(r is first for r in sched.prefix.computing.values())
    sched.abort_request("a")
    sched.update(plan := sched.schedule(), runner.execute(plan))
    assert [s.request_id for s in plan.seqs] == ["b"] and not sched.prefix.claims.get("a")
    while sched.has_unfinished():
        sched.update(plan := sched.schedule(), runner.execute(plan))
        sched.check_invariants()
    assert second.output_token_ids == reference_output(second)


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_a_request_waiting_for_shared_pages_does_not_hold_back_those_behind_it(ahead):
    """Head-of-line blocking: `b` waits for the pages `a` computes now, and `c`, unrelated and
    queued behind `b`, is admitted around it in the same step; `b` keeps its place and starts
    from the cache once `a` publishes."""
    sched = make_scheduler(enable_prefix_caching=True, max_num_batched_tokens=64)
    runner = FakeRunner(sched.config.page_size)
    prompt = [3 + i % 17 for i in range(40)]
    a, b = _req("a", prompt, arrival=0.0), _req("b", prompt, arrival=1.0)
    c = _req("c", [50 + i for i in range(10)], arrival=2.0)
    for req in (a, b, c):
        sched.add_request(req)
    first = sched.schedule()
    assert [s.request_id for s in first.seqs] == ["a", "c"]
    assert [r.request_id for r in sched.batching.waiting.in_order()] == ["b"]
    in_flight = collections.deque([(first, runner.execute(first))])
    admitted_b = None
    while sched.has_unfinished() or in_flight:
        if not ahead:
            while in_flight:
                sched.update(*in_flight.popleft())
        plan = sched.schedule()
        if admitted_b is None and any(s.request_id == "b" for s in plan.seqs):
            admitted_b = plan.step
        in_flight.append((plan, runner.execute(plan)))
        while len(in_flight) > (1 if ahead and not plan.is_empty else 0):
            sched.update(*in_flight.popleft())
        sched.check_invariants()
    # The first step planned once a's pages are published (ahead: one plan later).
    assert admitted_b == (3 if ahead else 2)
    assert b.num_cached_tokens == 36  # a's 9 full pages before its last prompt token
    for req in (a, b, c):
        assert req.output_token_ids == reference_output(req)
