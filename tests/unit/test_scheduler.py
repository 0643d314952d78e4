"""Continuous-batching scheduler: budget, chunking, pages, preemption, admission, aborts, stops."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxserve.scheduling.request import PENDING_TOKEN, FinishReason, RequestStatus
from jaxserve.scheduling.scheduler import QueueFull, RequestRejected, SchedulerConfig, StepResult
from tests.unit.helpers import (
    EOS,
    FakeRunner,
    add_all,
    make_request,
    make_requests,
    make_scheduler,
    reference_output,
    run_to_completion,
    step,
)


def test_scheduler_modules_do_not_import_jax():
    code = (
        "import sys, jaxserve.scheduling.scheduler, jaxserve.scheduling.request, "
        "jaxserve.scheduling.kv_cache_manager, "
        "jaxserve.sampling_params; assert 'jax' not in sys.modules, 'jax was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_first_step_prefills_then_each_request_decodes_one_token():
    sched = make_scheduler()
    add_all(sched, make_requests(3, prompt_len=5, max_tokens=3))
    plan, updates = step(sched)
    assert [(s.request_id, s.slot, s.start_pos, len(s.token_ids), s.sample) for s in plan.seqs] == [
        ("r0", 0, 0, 5, True),
        ("r1", 1, 0, 5, True),
        ("r2", 2, 0, 5, True),
    ]
    assert plan.seqs[0].token_ids == [1, 2, 3, 4, 5] and plan.seqs[0].page_table == [0, 1]
    assert plan.num_batched_tokens == 15 and [u.new_token_ids for u in updates] == [[7]] * 3
    plan, _ = step(sched)
    assert [(s.start_pos, s.token_ids, s.sample) for s in plan.seqs] == [(5, [7], True)] * 3
    assert plan.num_batched_tokens == 3


def test_budget_of_4096_with_32_decoding_requests_leaves_4064_for_a_prefill_chunk():
    sched = make_scheduler(
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        num_pages=2048,
        page_size=16,
        max_model_len=8192,
    )
    add_all(sched, make_requests(32, prompt_len=16, max_tokens=64))
    step(sched)  # all 32 prefilled; each now decodes one token per step
    sched.add_request(make_request("long", 6000, max_tokens=16, arrival_time=99.0))
    plan, _ = step(sched)
    decodes = [s for s in plan.seqs if s.request_id != "long"]
    (chunk,) = [s for s in plan.seqs if s.request_id == "long"]
    assert len(decodes) == 32 and all(len(s.token_ids) == 1 for s in decodes)
    assert (chunk.start_pos, len(chunk.token_ids), chunk.sample) == (0, 4064, False)
    assert plan.num_batched_tokens == 4096
    plan, updates = step(sched)
    (chunk,) = [s for s in plan.seqs if s.request_id == "long"]
    assert (chunk.start_pos, len(chunk.token_ids), chunk.sample) == (4064, 6000 - 4064, True)
    assert plan.num_batched_tokens == 32 + 1936
    assert "long" in [u.request.request_id for u in updates]


def test_pages_running_out_preempt_the_latest_arrival_which_resumes_and_recomputes():
    # Pool of 6 pages of 4 tokens; A and B (prompt 8, 8 outputs) need up to 4 pages each.
    sched = make_scheduler(max_num_seqs=4, num_pages=6, page_size=4, max_model_len=32)
    a, b = make_requests(2, prompt_len=8, max_tokens=8)
    add_all(sched, [a, b])
    runner = FakeRunner(page_size=4)
    plans = []
    for _ in range(5):  # both reach 13 tokens: 3 pages each, all 6 used
        plans.append(sched.schedule())
        sched.update(plans[-1], runner.execute(plans[-1]))
    assert sched.num_pages_used == 6 and not any(p.preempted_ids for p in plans)

    plan = sched.schedule()  # A's 13th token needs a 4th page: B is the victim
    assert plan.preempted_ids == ["r1"] and [s.request_id for s in plan.seqs] == ["r0"]
    assert b.status == RequestStatus.PREEMPTED and b.slot is None
    assert b.num_computed_tokens == 0 and b.num_output_tokens == 5  # outputs kept
    assert sched.kv.num_pages_of("r1") == 0 and sched.num_pages_used == 4
    assert (sched.num_running, sched.num_waiting, sched.num_preemptions) == (1, 1, 1)
    assert b.num_preemptions == 1
    sched.update(plan, runner.execute(plan))
    sched.check_invariants()

    plans = run_to_completion(sched, runner)
    first_b = next(i for i, p in enumerate(plans) if any(s.request_id == "r1" for s in p.seqs))
    # A finishes two steps later; B waits for its pages, then recomputes prompt + 5 outputs.
    assert a.finish_reason == FinishReason.LENGTH and first_b == 2
    (resumed,) = plans[first_b].seqs
    assert resumed.start_pos == 0 and resumed.sample
    assert resumed.token_ids == b.prompt_token_ids + b.output_token_ids[:5]
    assert a.output_token_ids == reference_output(a)
    assert b.output_token_ids == reference_output(b)  # recompute changed nothing
    assert sched.num_pages_used == 0 and sched.num_slots_used == 0


@pytest.mark.parametrize(
    ("policy", "priorities", "victim"),
    [("priority", [0, 5, 1], "r1"), ("fcfs", [0, 5, 1], "r2"), ("priority", [2, 2, 1], "r1")],
)
def test_victim_is_the_least_important_running_request(policy, priorities, victim):
    # Three requests of one page each fill 4 pages but one; their next tokens need one more each.
    sched = make_scheduler(num_pages=4, page_size=4, max_model_len=16, policy=policy)
    for i, priority in enumerate(priorities):
        sched.add_request(make_request(f"r{i}", 4, max_tokens=4, arrival_time=i, priority=priority))
    step(sched)
    plan, _ = step(sched)
    assert plan.preempted_ids == [victim]
    assert victim not in [s.request_id for s in plan.seqs] and len(plan.seqs) == 2


def test_a_victim_already_planned_in_this_step_is_taken_out_of_the_plan():
    # Budget 8: low-priority L decodes first; high-priority H's next prefill chunk needs pages.
    sched = make_scheduler(
        max_num_seqs=2,
        max_num_batched_tokens=8,
        num_pages=5,
        page_size=4,
        max_model_len=32,
        policy="priority",
    )
    sched.add_request(make_request("L", 4, max_tokens=8, priority=9))
    step(sched)
    sched.add_request(make_request("H", 16, max_tokens=2, arrival_time=1.0, priority=0))
    plan, _ = step(sched)  # L decodes (2 pages), H prefills 7 tokens (2 pages)
    assert [(s.request_id, len(s.token_ids)) for s in plan.seqs] == [("L", 1), ("H", 7)]
    plan, _ = step(sched)  # H's next 7 tokens need 2 more pages, 1 is free: L gives way
    assert plan.preempted_ids == ["L"]
    assert [(s.request_id, len(s.token_ids)) for s in plan.seqs] == [("H", 7)]
    assert plan.num_batched_tokens == 7


def test_no_admission_in_an_iteration_that_preempted():
    # Two slots. r0 holds one page and r1 two, of four. X (more important than r1) waits for a
    # slot. r0's next token takes the last page, so r1 preempts itself, freeing a slot and two
    # pages: X would fit, yet joins only in the next iteration.
    sched = make_scheduler(
        max_num_seqs=2, num_pages=4, page_size=4, max_model_len=16, policy="priority"
    )
    sched.add_request(make_request("r0", 4, max_tokens=4, priority=0))
    sched.add_request(make_request("r1", 8, max_tokens=4, priority=5, arrival_time=1.0))
    step(sched)
    sched.add_request(make_request("X", 1, max_tokens=1, priority=1, arrival_time=2.0))
    plan, _ = step(sched)
    assert plan.preempted_ids == ["r1"] and [s.request_id for s in plan.seqs] == ["r0"]
    assert sched.kv.num_free_pages == 2 and sched.num_slots_used == 1
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["r0", "X"]


def test_requests_that_can_never_fit_are_refused_at_submission():
    sched = make_scheduler(num_pages=8, page_size=4, max_model_len=64)
    with pytest.raises(RequestRejected, match=r"60 prompt \+ 8 output tokens = 68, more than max"):
        sched.add_request(make_request("too-long", 60, max_tokens=8))
    with pytest.raises(RequestRejected, match="10 KV pages of 4 tokens, more than the whole pool"):
        sched.add_request(make_request("too-big", 30, max_tokens=8))
    assert sched.num_waiting == 0 and not sched.has_unfinished()
    sched.add_request(make_request("just-fits", 30, max_tokens=3))  # 32 slots = the whole pool
    sched.add_request(
        make_request("just-fits-2", 61, max_tokens=3, num_pages=None)
        if False
        else make_request("exact-len", 28, max_tokens=4)
    )
    with pytest.raises(RequestRejected, match="already in use"):
        sched.add_request(make_request("just-fits", 1))


def test_queue_overflow_is_refused_until_requests_leave_the_queue():
    sched = make_scheduler(max_num_seqs=2, max_waiting_requests=2)
    add_all(sched, make_requests(4, max_tokens=2))  # two for the free slots, two waiting
    with pytest.raises(
        QueueFull,
        match=r"2 requests are waiting beyond the 2 free slots \(max_waiting_requests=2\)",
    ):
        sched.add_request(make_request("late"))
    assert issubclass(QueueFull, RequestRejected) and issubclass(RequestRejected, ValueError)
    step(sched)  # two admitted, two still wait, no slot is free: the queue is full
    assert (sched.num_waiting, sched.num_queued_beyond_free_slots) == (2, 2)
    with pytest.raises(QueueFull, match="2 requests are waiting beyond the 0 free slots"):
        sched.add_request(make_request("late"))
    step(sched)  # r0 and r1 finish: their slots are free for r2 and r3, so one more may queue
    assert sched.num_queued_beyond_free_slots == 0
    sched.add_request(make_request("late"))


def test_a_burst_on_free_slots_does_not_count_against_the_waiting_limit():
    # Issue 15, defect 3: four requests at once on four idle slots were refused with a limit
    # of 2, as every new request counted as waiting until the next schedule().
    sched = make_scheduler(max_num_seqs=4, max_waiting_requests=2)
    add_all(sched, make_requests(6, max_tokens=8))  # 4 for the slots + 2 that really wait
    assert (sched.num_waiting, sched.num_queued_beyond_free_slots) == (6, 2)
    with pytest.raises(QueueFull, match="2 requests are waiting beyond the 4 free slots"):
        sched.add_request(make_request("seventh"))
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["r0", "r1", "r2", "r3"]
    assert (sched.num_slots_used, sched.num_waiting) == (4, 2)
    with pytest.raises(QueueFull, match="2 requests are waiting beyond the 0 free slots"):
        sched.add_request(make_request("seventh"))
    sched.abort_request("r4")  # one leaves the queue: one place opens, and only one
    step(sched)
    sched.add_request(make_request("seventh"))
    with pytest.raises(QueueFull):
        sched.add_request(make_request("eighth"))


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_group_batching_credits_free_slots_only_to_the_next_group(batching):
    sched = make_scheduler(max_num_seqs=4, batching=batching, max_waiting_requests=1)
    add_all(sched, make_requests(5, max_tokens=8))  # the next group takes 4; one waits
    with pytest.raises(QueueFull, match="1 requests are waiting beyond the 4 free slots"):
        sched.add_request(make_request("late"))
    step(sched, now=10.0)
    sched.abort_request("r0")
    step(sched, now=10.0)  # r0's slot is free, but the group runs on without it
    assert sched.num_slots_used == 3
    with pytest.raises(QueueFull, match="1 requests are waiting beyond the 0 free slots"):
        sched.add_request(make_request("late"))


def test_aborting_100_in_flight_requests_frees_every_slot_and_page():
    sched = make_scheduler(
        max_num_seqs=128, max_num_batched_tokens=1024, num_pages=1024, max_model_len=64
    )
    add_all(sched, make_requests(100, prompt_len=20, max_tokens=30))
    step(sched)
    step(sched)
    assert sched.num_running == 100 and sched.num_pages_used > 0
    assert sched.get_request("r99").num_computed_tokens == 17  # one is still mid-prefill
    add_all(sched, [make_request(f"w{i}", arrival_time=200.0 + i) for i in range(10)])
    plan = sched.schedule()  # a step in flight while the clients cancel
    for i in range(100):
        assert sched.abort_request(f"r{i}")
    assert not sched.abort_request("unknown")
    sched.update(plan, StepResult(sampled_token_ids=[7 if s.sample else None for s in plan.seqs]))
    assert sched.num_running == 110  # takes effect at the next schedule boundary

    plan, updates = step(sched)
    assert plan.aborted_ids == [f"r{i}" for i in range(100)]
    assert {s.request_id for s in plan.seqs} == {f"w{i}" for i in range(10)}
    aborted = [u for u in updates if u.finish_reason == FinishReason.ABORT]
    assert len(aborted) == 100 and all(u.finished and u.new_token_ids == [] for u in aborted)
    assert sched.num_running == 10 and sched.num_slots_used == 10
    for i in range(10):
        sched.abort_request(f"w{i}")
    step(sched)
    assert (sched.num_slots_used, sched.num_pages_used, sched.num_running) == (0, 0, 0)
    assert not sched.has_unfinished()


def test_aborting_a_waiting_request_reports_it_and_keeps_the_queue_in_order():
    sched = make_scheduler(max_num_seqs=1)
    add_all(sched, make_requests(3, max_tokens=1))
    sched.abort_request("r1")
    plan, updates = step(sched)
    assert [s.request_id for s in plan.seqs] == ["r0"]
    assert [(u.request.request_id, u.finish_reason) for u in updates] == [
        ("r1", FinishReason.ABORT),
        ("r0", FinishReason.LENGTH),
    ]
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["r2"]


@pytest.mark.parametrize(
    ("policy", "order"), [("fcfs", ["a", "b", "c", "d"]), ("priority", ["b", "d", "c", "a"])]
)
def test_policy_decides_admission_order(policy, order):
    sched = make_scheduler(max_num_seqs=1, policy=policy)
    for i, (name, priority) in enumerate(zip("abcd", [3, 1, 2, 1], strict=True)):
        sched.add_request(make_request(name, 4, max_tokens=1, arrival_time=i, priority=priority))
    admitted = [step(sched)[0].seqs[0].request_id for _ in range(4)]
    assert admitted == order


@pytest.mark.parametrize("chunked", [True, False])
def test_chunked_prefill_off_runs_a_prompt_only_when_it_fits_whole(chunked):
    sched = make_scheduler(
        max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=chunked
    )
    add_all(sched, make_requests(3, prompt_len=4, max_tokens=3))
    step(sched)
    sched.add_request(make_request("long", 30, max_tokens=2, arrival_time=5.0))
    sched.add_request(make_request("short", 2, max_tokens=2, arrival_time=6.0))
    plan, _ = step(sched)  # 3 decodes leave 29 tokens
    ids = [s.request_id for s in plan.seqs]
    if chunked:
        assert ids == ["r0", "r1", "r2", "long"] and len(plan.seqs[3].token_ids) == 29
        return
    assert ids == ["r0", "r1", "r2"]  # and "short" waits behind "long": no overtaking
    step(sched)  # the three finish
    plan, _ = step(sched)
    assert [(s.request_id, len(s.token_ids), s.sample) for s in plan.seqs] == [
        ("long", 30, True),
        ("short", 2, True),
    ]


def test_stop_token_eos_ignore_eos_and_max_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("eos", max_tokens=8))
    sched.add_request(make_request("ignore", max_tokens=8, ignore_eos=True))
    sched.add_request(make_request("stop-id", max_tokens=8, ignore_eos=True, stop_token_ids=(5,)))
    sched.add_request(make_request("length", max_tokens=2))
    step(sched)
    _, updates = step(sched, tokens={"eos": EOS, "ignore": EOS, "stop-id": 5})
    got = {u.request.request_id: (u.finished, u.finish_reason) for u in updates}
    assert got == {
        "eos": (True, FinishReason.STOP),
        "ignore": (False, None),
        "stop-id": (True, FinishReason.STOP),
        "length": (True, FinishReason.LENGTH),
    }
    assert sched.num_running == 1 and sched.kv.num_pages_of("eos") == 0
    assert updates[0].request.stop_reason == EOS and updates[2].request.stop_reason == 5


def test_finish_request_frees_at_once_and_its_row_in_the_step_in_flight_is_ignored():
    sched = make_scheduler()
    add_all(sched, make_requests(2, max_tokens=8))
    step(sched)
    plan = sched.schedule()
    assert sched.finish_request("r0", FinishReason.STOP, now=3.0)
    assert sched.kv.num_pages_of("r0") == 0 and sched.num_running == 1
    updates = sched.update(plan, StepResult(sampled_token_ids=[7, 7]))
    assert [u.request.request_id for u in updates] == ["r1"]  # r0's row was dropped
    assert sched.get_request("r0") is None and plan.seqs[0].request_id == "r0"
    assert not sched.finish_request("r0", FinishReason.STOP)
    sched.check_invariants()


def test_logprobs_and_numpy_like_ints_pass_through():
    class Int64(int):  # what a runner's array might hand back
        pass

    sched = make_scheduler()
    sched.add_request(make_request("a", max_tokens=2, logprobs=2))
    plan = sched.schedule()
    (update,) = sched.update(plan, StepResult(sampled_token_ids=[Int64(9)], logprobs=["row"]))
    assert update.new_token_ids == [9] and type(update.new_token_ids[0]) is int
    assert update.logprobs == ["row"]


def test_updates_follow_the_plans_in_order_and_bad_results_change_nothing():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    first = sched.schedule()
    second = sched.schedule()  # planned ahead: the first step's token is still pending
    req = sched.get_request("a")
    assert [(s.start_pos, s.token_ids) for s in second.seqs] == [(4, [PENDING_TOKEN])]
    assert req.num_pending == 2 and req.num_computed_tokens == 5
    with pytest.raises(RuntimeError, match="got plan 2; the oldest plan awaiting its update is 1"):
        sched.update(second, StepResult(sampled_token_ids=[3]))
    with pytest.raises(ValueError, match="do not match the plan's 1 sequences"):
        sched.update(first, StepResult(sampled_token_ids=[]))
    with pytest.raises(ValueError, match="needed a sampled token, got None"):
        sched.update(first, StepResult(sampled_token_ids=[None]))
    assert req.num_pending == 2 and req.output_token_ids == []
    sched.update(first, StepResult(sampled_token_ids=[3]))
    sched.update(second, StepResult(sampled_token_ids=[5]))
    assert req.output_token_ids == [3, 5] and req.num_pending == 0
    with pytest.raises(RuntimeError, match="oldest plan awaiting its update is None"):
        sched.update(second, StepResult(sampled_token_ids=[3]))


def test_empty_plans_are_fine_and_slots_are_reused_lowest_first():
    sched = make_scheduler()
    plan, updates = step(sched)
    assert plan.is_empty and plan.num_batched_tokens == 0 and updates == []
    add_all(sched, make_requests(3, max_tokens=1))
    step(sched)
    sched.add_request(make_request("x", max_tokens=2))
    plan, _ = step(sched)
    assert [(s.request_id, s.slot) for s in plan.seqs] == [("x", 0)]


def test_timing_fields_follow_the_clock_passed_in():
    sched = make_scheduler()
    req = make_request("a", 4, max_tokens=2, arrival_time=1.0)
    sched.add_request(req)
    step(sched, now=2.0)
    step(sched, now=3.0)
    assert (req.first_scheduled_time, req.first_token_time, req.finished_time) == (2.0, 2.0, 3.0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(max_num_batched_tokens=4), "max_num_batched_tokens=4 must be >= max_num_seqs=8"),
        (dict(enable_chunked_prefill=False), "max_num_batched_tokens=64 must be >= max_model_len"),
        (dict(policy="lifo"), "policy='lifo' must be one of"),
        (dict(batching="eager"), "batching='eager' must be one of"),
        (dict(batch_size=9), "batch_size=9 must be <= max_num_seqs=8"),
        (dict(dynamic_timeout_s=-1), "dynamic_timeout_s=-1 must be"),
        (dict(num_pages=0), "SchedulerConfig.num_pages=0 must be an integer >= 1"),
        (dict(max_waiting_requests=0), "max_waiting_requests=0"),
    ],
)
def test_bad_configs_are_refused(overrides, message):
    config = dict(max_num_seqs=8, max_num_batched_tokens=64, num_pages=8, max_model_len=128)
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**{**config, **overrides})
    assert SchedulerConfig(**config).batch_size == 8 and hash(SchedulerConfig(**config))
