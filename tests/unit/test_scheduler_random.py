"""Random workloads against every mode: the books always balance and outputs never change.

Hypothesis draws a scheduler config (tight pools force preemption), a stream of requests with
arrivals, priorities, stop tokens, stop strings and aborts, and runs it on the fake model. After
every step the scheduler's invariants and the plan's limits must hold; at the end nothing is
left allocated, and every request's output equals what the fake model gives it alone, however
it was batched, chunked or preempted (an aborted one: a prefix of it). Each workload runs
synchronously (every plan updated before the next) and asynchronously (the next plan made while
the last one is in flight, as the engine does): the outputs must be the same.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.request import PENDING_TOKEN, FinishReason, Request, RequestStatus
from jaxserve.scheduling.scheduler import (
    RequestRejected,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from tests.unit.helpers import EOS, FakeRunner, reference_output


@st.composite
def configs(draw) -> SchedulerConfig:
    max_num_seqs = draw(st.integers(1, 6))
    page_size = draw(st.integers(1, 8))
    max_model_len = draw(st.integers(4, 40))
    chunked = draw(st.booleans())
    low = max_num_seqs if chunked else max(max_num_seqs, max_model_len)
    pages_for_one = -(-max_model_len // page_size)
    budget = draw(st.integers(low, low + 40))
    # The runner's ladder, which steps may be trimmed to land on: powers of two, or finer.
    buckets = [b for b in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64) if b < budget] + [budget]
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        token_buckets=draw(st.none() | st.sampled_from([buckets, sorted({*buckets[::2], budget})])),
        num_pages=draw(st.integers(pages_for_one, 2 * pages_for_one)),
        page_size=page_size,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        priority_aging_s=draw(st.sampled_from([None, 0.5, 3.0])),  # arrivals are steps 0..8
        batching=draw(st.sampled_from(["continuous", "continuous", "static", "dynamic"])),
        batch_size=draw(st.integers(1, max_num_seqs)),
        dynamic_timeout_s=draw(st.sampled_from([0.0, 2.0, 5.0])),
    )


@st.composite
def workloads(draw, config: SchedulerConfig) -> list[dict]:
    specs = []
    for i in range(draw(st.integers(1, 16))):
        prompt_len = draw(st.integers(1, config.max_model_len // 2 + 1))
        spec = dict(
            id=f"r{i}",
            arrive=draw(st.integers(0, 8)),
            prompt=draw(st.lists(st.integers(1, 50), min_size=prompt_len, max_size=prompt_len)),
            # One more than fits, sometimes: those must be refused.
            max_tokens=draw(st.integers(1, config.max_model_len - prompt_len + 1)),
            priority=draw(st.integers(0, 3)),
            stop_at=draw(st.none() | st.integers(0, 8)),  # a stop token id at this output index
            stop_string_at=draw(st.none() | st.integers(1, 8)),  # engine finishes it here
            abort_at=draw(st.none() | st.integers(0, 30)),
        )
        specs.append(spec)
    return specs


def _request(spec: dict) -> Request:
    req = Request(
        request_id=spec["id"],
        prompt_token_ids=spec["prompt"],
        sampling_params=SamplingParams(max_tokens=spec["max_tokens"]),
        arrival_time=float(spec["arrive"]),
        priority=spec["priority"],
        eos_token_ids=(EOS,),
    )
    if spec["stop_at"] is not None:
        # Stop on whatever the fake model emits at that index; a fresh request keeps it simple.
        ref = reference_output(req)
        if spec["stop_at"] < len(ref):
            stop = SamplingParams(
                max_tokens=spec["max_tokens"], stop_token_ids=(ref[spec["stop_at"]],)
            )
            req = Request(**{**_fields(req), "sampling_params": stop})
    return req


def _fields(req: Request) -> dict:
    return dict(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        arrival_time=req.arrival_time,
        priority=req.priority,
        eos_token_ids=req.eos_token_ids,
    )


def _check_plan(plan: SchedulerOutput, sched: Scheduler, ahead: bool) -> None:
    cfg = sched.config
    assert plan.num_batched_tokens == sum(len(s.token_ids) for s in plan.seqs)
    assert plan.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(plan.seqs) <= cfg.max_num_seqs
    assert (
        len({s.slot for s in plan.seqs}) == len({s.request_id for s in plan.seqs}) == len(plan.seqs)
    )
    for seq in plan.seqs:
        req = sched.get_request(seq.request_id)
        assert req.status == RequestStatus.RUNNING and req.slot == seq.slot
        assert seq.page_table == sched.kv.page_table(req.request_id)
        # A plan counts as computed once made.
        assert seq.end_pos == req.num_computed_tokens and seq.token_ids
        assert seq.sample == (seq.end_pos == req.num_tokens - seq.sample)  # the tokens before
        if ahead:  # at most the one token the step in flight samples, last, is not known yet
            known = req.num_known_tokens
            assert req.num_pending == (known < seq.end_pos) + seq.sample
            k = min(known, seq.end_pos) - seq.start_pos
            assert seq.token_ids[:k] == req.all_token_ids[seq.start_pos : seq.start_pos + k]
            assert seq.token_ids[k:] in ([], [PENDING_TOKEN])
        else:  # nothing pending: planned exactly as before asynchronous scheduling
            assert seq.token_ids == req.all_token_ids[seq.start_pos : seq.end_pos]
            assert req.num_pending == seq.sample
        assert len(seq.page_table) <= cfg.max_pages_per_seq
        if not cfg.enable_chunked_prefill:
            assert seq.sample  # a whole prompt (or one decode token) each time


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_workloads_keep_invariants_and_outputs(ahead, data):
    config = data.draw(configs())
    specs = data.draw(workloads(config))
    sched, runner = Scheduler(config), FakeRunner(config.page_size)
    accepted: dict[str, tuple[dict, Request]] = {}
    in_flight: collections.deque = collections.deque()  # (plan, result, now), oldest first

    def update_oldest() -> None:
        plan, result, at = in_flight.popleft()
        for update in sched.update(plan, result, now=at):
            spec, req = accepted[update.request.request_id]
            if not update.finished and req.num_output_tokens == spec["stop_string_at"]:
                assert sched.finish_request(req.request_id, FinishReason.STOP)
        sched.check_invariants()

    for now in range(400):
        for spec in (s for s in specs if s["arrive"] == now):
            req = _request(spec)
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
        _check_plan(plan, sched, ahead)
        in_flight.append((plan, runner.execute(plan), float(now)))
        # Asynchronous: the newest plan stays in flight while the one before it is updated.
        while len(in_flight) > (1 if ahead and not plan.is_empty else 0):
            update_oldest()
        if now > 15 and not sched.has_unfinished():
            break
    while in_flight:
        update_oldest()
    assert not sched.has_unfinished(), "requests left unfinished after 400 steps"
    assert (sched.num_pages_used, sched.num_slots_used, sched.num_waiting) == (0, 0, 0)
    for spec, req in accepted.values():
        ref = reference_output(req)
        if req.finish_reason == FinishReason.ABORT:
            assert req.output_token_ids == ref[: req.num_output_tokens]
        elif spec["stop_string_at"] is not None and spec["stop_string_at"] < len(ref):
            assert req.output_token_ids == ref[: spec["stop_string_at"]]
        else:
            assert req.output_token_ids == ref
            expected = FinishReason.STOP if ref[-1] in req.stop_ids else FinishReason.LENGTH
            assert req.finish_reason == expected
