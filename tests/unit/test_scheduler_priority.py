"""Priority policy: urgent requests preempt less important running work; aging bounds waiting."""

from __future__ import annotations

import pytest

from jaxserve.scheduling.request import FinishReason, RequestStatus
from jaxserve.scheduling.scheduler import Scheduler
from tests.unit.helpers import FakeRunner, make_request, make_scheduler, reference_output


def _step(sched: Scheduler, runner: FakeRunner, now: float):
    plan = sched.schedule(now)
    sched.update(plan, runner.execute(plan), now)
    sched.check_invariants()
    return plan


def _run_to_completion(sched: Scheduler, runner: FakeRunner, now: float) -> None:
    for i in range(1000):
        if not sched.has_unfinished():
            return
        _step(sched, runner, now + i)
    raise AssertionError("the scheduler made no progress")


@pytest.mark.parametrize(
    ("policy", "aging", "low_priority", "preempts"),
    [
        ("priority", 10.0, 5, True),
        ("priority", None, 5, True),  # strict priority preempts too
        ("priority", 10.0, 0, False),  # equal priority, earlier arrival: it stays
        ("priority", 0.5, 5, False),  # the running ones have aged past the newcomer
        ("fcfs", 10.0, 5, False),
    ],
)
def test_urgent_request_preempts_the_least_important_running_one_when_slots_are_full(
    policy, aging, low_priority, preempts
):
    sched = make_scheduler(max_num_seqs=2, policy=policy, priority_aging_s=aging)
    runner = FakeRunner(page_size=4)
    low = [
        make_request(f"low{i}", 6, max_tokens=8, priority=low_priority, arrival_time=float(i))
        for i in range(2)
    ]
    for req in low:
        sched.add_request(req)
    _step(sched, runner, now=1.0)
    urgent = make_request("urgent", 5, max_tokens=3, priority=0, arrival_time=4.0)
    sched.add_request(urgent)
    plan = _step(sched, runner, now=4.0)
    if not preempts:
        assert plan.preempted_ids == [] and urgent.status == RequestStatus.WAITING
        assert [s.request_id for s in plan.seqs] == ["low0", "low1"]
        return
    # low1 arrived last, so of two equal priorities it is the less important.
    assert plan.preempted_ids == ["low1"]
    assert [(s.request_id, s.start_pos) for s in plan.seqs] == [("low0", 6), ("urgent", 0)]
    assert low[1].status == RequestStatus.PREEMPTED and low[1].num_output_tokens == 1
    assert sched.kv.num_pages_of("low1") == 0 and sched.num_preemptions == 1

    _run_to_completion(sched, runner, now=5.0)
    for req in [*low, urgent]:
        assert req.finish_reason == FinishReason.LENGTH
        assert req.output_token_ids == reference_output(req)  # recompute lost no token
    assert low[1].num_preemptions == 1 and urgent.finished_time < low[1].finished_time


@pytest.mark.parametrize(("urgent_prompt", "preempts"), [(12, True), (16, False)])
def test_urgent_request_preempts_for_pages_only_when_the_victims_free_enough(
    urgent_prompt, preempts
):
    # 8 pages of 4 tokens. After one step M (priority 0) holds 5 pages and L (priority 5) 2, and
    # neither needs another in the next step. U (priority 1) may take L's pages, not M's: a
    # 12-token prompt fits in the free page and L's two, a 16-token one does not, and then
    # preempting L would be waste.
    sched = make_scheduler(
        max_num_seqs=4, num_pages=8, page_size=4, max_model_len=32, policy="priority"
    )
    runner = FakeRunner(page_size=4)
    m = make_request("M", 19, max_tokens=8, priority=0)
    low = make_request("L", 7, max_tokens=8, priority=5)
    sched.add_request(m)
    sched.add_request(low)
    _step(sched, runner, now=0.0)
    assert (sched.kv.num_pages_of("M"), sched.kv.num_pages_of("L")) == (5, 2)
    urgent = make_request("U", urgent_prompt, max_tokens=2, priority=1, arrival_time=1.0)
    sched.add_request(urgent)
    plan = _step(sched, runner, now=1.0)
    if preempts:
        assert plan.preempted_ids == ["L"]
        assert [s.request_id for s in plan.seqs] == ["M", "U"]
        assert sched.kv.num_free_pages == 0
    else:
        assert plan.preempted_ids == [] and [s.request_id for s in plan.seqs] == ["M", "L"]
        assert urgent.status == RequestStatus.WAITING and sched.kv.num_free_pages == 1
    _run_to_completion(sched, runner, now=2.0)
    for req in (m, low, urgent):
        assert req.output_token_ids == reference_output(req)


@pytest.mark.parametrize("aging", [2.0, None])
def test_low_priority_request_is_admitted_within_the_aging_bound_under_steady_urgent_load(aging):
    # Two slots; an urgent request (priority 0, two steps of work) arrives every step of 0.5 s,
    # which keeps both slots busy and one request waiting for ever. The priority-3 request
    # arriving at t=1 is ordered before every urgent one arriving after 1 + 3 * aging = 7, so
    # it must start by then plus the one step it waits behind those already queued. Strict
    # priority (aging None) starves it.
    dt, low_arrival, low_priority = 0.5, 1.0, 3
    sched = make_scheduler(max_num_seqs=2, policy="priority", priority_aging_s=aging)
    runner = FakeRunner(page_size=4)
    low = make_request("low", 4, max_tokens=3, priority=low_priority, arrival_time=low_arrival)
    started_before_low = []  # arrival times of urgent requests admitted before low
    for k in range(60):
        now = k * dt
        if now == low_arrival:
            sched.add_request(low)
        sched.add_request(make_request(f"u{k}", 4, max_tokens=2, arrival_time=now))
        plan = _step(sched, runner, now)
        if low.first_scheduled_time is None:
            started_before_low += [
                float(s.request_id[1:]) * dt for s in plan.seqs if s.start_pos == 0
            ]
    if aging is None:
        assert low.first_scheduled_time is None and low.status == RequestStatus.WAITING
        return
    bound = low_arrival + low_priority * aging
    assert bound < low.first_scheduled_time <= bound + dt  # not admitted early either
    assert max(started_before_low) <= bound
    assert low.num_preemptions == 0 and low.finish_reason == FinishReason.LENGTH
    assert low.output_token_ids == reference_output(low)


def test_fcfs_ignores_priority_for_admission_and_never_preempts_to_admit():
    sched = make_scheduler(max_num_seqs=1, policy="fcfs")
    runner = FakeRunner(page_size=4)
    first = make_request("first", 4, max_tokens=3, priority=9, arrival_time=0.0)
    sched.add_request(first)
    _step(sched, runner, now=0.0)
    sched.add_request(make_request("urgent", 4, max_tokens=1, priority=-5, arrival_time=0.5))
    sched.add_request(make_request("later", 4, max_tokens=1, priority=0, arrival_time=0.2))
    admitted = []
    for i in range(6):
        plan = _step(sched, runner, now=1.0 + i)
        assert plan.preempted_ids == []
        admitted += [s.request_id for s in plan.seqs if s.start_pos == 0]
    assert admitted == ["later", "urgent"] and first.output_token_ids == reference_output(first)


@pytest.mark.parametrize("aging", [0, -1.0, float("inf"), float("nan"), "10", True])
def test_bad_priority_aging_is_refused(aging):
    with pytest.raises(ValueError, match=r"priority_aging_s=.* must be a finite number of seconds"):
        make_scheduler(priority_aging_s=aging)


@pytest.mark.parametrize("aging", [0, float("inf")])
def test_engine_config_refuses_bad_priority_aging_too(aging):
    from jaxserve.engine_config import EngineConfig

    assert EngineConfig(priority_aging_s=None).priority_aging_s is None
    with pytest.raises(ValueError, match=r"priority_aging_s=.* must be a finite number of seconds"):
        EngineConfig(priority_aging_s=aging)
