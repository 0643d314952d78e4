"""Continuous against static and dynamic batching, on the textbook example and group rules."""

from __future__ import annotations

import pytest

from jaxserve.scheduling.scheduler import StepResult
from tests.unit.helpers import add_all, make_request, make_requests, make_scheduler, step

# The batch is full with A, B and C either because they hold every slot, or (docs/architecture.md,
# Decision 2: admission also checks pages) because they hold every KV page while a fourth slot is
# free.
FULL_BY = {
    "slots": dict(max_num_seqs=3, num_pages=64, page_size=4),
    "pages": dict(max_num_seqs=4, num_pages=3, page_size=8),
}


def _first_step_of(plans, request_id: str) -> int:
    return next(i for i, plan in enumerate(plans, 1) if request_id in plan)


@pytest.mark.parametrize("full_by", FULL_BY)
@pytest.mark.parametrize(("batching", "d_joins_at"), [("continuous", 3), ("static", 6)])
def test_textbook_d_joins_after_a_when_continuous_and_after_all_when_static(
    batching, d_joins_at, full_by
):
    """Capacity full with A, B, C; A needs 2 output tokens, B 5, C 3; D arrives in step 1.

    The issue says "capacity 4", but with only A, B and C in a batch of 4 a free row would let
    D join at once in both modes and prove nothing. So the batch is made full: either three
    slots, or four slots over a KV pool of three pages, one page per request's whole life
    (prompt 4 + up to 5 outputs fit a page of 8). Step 1 prefills A, B and C and samples their
    first tokens; A samples its second and finishes in step 2, C in step 3, B in step 5.
    Continuous: D takes A's place in step 3, the iteration after A finished. Static: the group
    A, B, C runs until all are done, so D starts in step 6, idle row and free page regardless.
    """
    sched = make_scheduler(batching=batching, **FULL_BY[full_by])
    for name, outputs in [("A", 2), ("B", 5), ("C", 3)]:
        sched.add_request(make_request(name, 4, max_tokens=outputs))
    plan = sched.schedule(now=0.0)
    sched.add_request(make_request("D", 4, max_tokens=2, arrival_time=0.5))
    sched.update(plan, _tokens(plan), now=1.0)
    plans = [{s.request_id for s in plan.seqs}]
    while sched.has_unfinished():
        plans.append({s.request_id for s in step(sched)[0].seqs})
    assert plans[0] == {"A", "B", "C"}
    assert {name: max(i for i, p in enumerate(plans, 1) if name in p) for name in "ABC"} == {
        "A": 2,
        "B": 5,
        "C": 3,
    }
    assert _first_step_of(plans, "D") == d_joins_at
    assert max(i for i, p in enumerate(plans, 1) if "D" in p) == d_joins_at + 1  # 2 outputs


def _tokens(plan):
    return StepResult(sampled_token_ids=[7 if s.sample else None for s in plan.seqs])


def test_static_groups_take_batch_size_requests_in_order_and_run_them_to_the_end():
    sched = make_scheduler(batching="static", batch_size=2, max_num_seqs=4)
    add_all(sched, make_requests(5, max_tokens=2))
    seen = [[s.request_id for s in step(sched)[0].seqs] for _ in range(6)]
    assert seen == [["r0", "r1"], ["r0", "r1"], ["r2", "r3"], ["r2", "r3"], ["r4"], ["r4"]]


def test_static_group_members_finishing_early_leave_their_rows_idle():
    sched = make_scheduler(batching="static", max_num_seqs=2)
    sched.add_request(make_request("short", max_tokens=1))
    sched.add_request(make_request("long", max_tokens=4, arrival_time=1.0))
    sched.add_request(make_request("next", max_tokens=1, arrival_time=2.0))
    seen = [[s.request_id for s in step(sched)[0].seqs] for _ in range(5)]
    assert seen == [["short", "long"], ["long"], ["long"], ["long"], ["next"]]


def test_dynamic_group_forms_when_full_or_when_its_oldest_waited_the_timeout():
    sched = make_scheduler(batching="dynamic", batch_size=2, dynamic_timeout_s=1.0)
    sched.add_request(make_request("a", max_tokens=2, arrival_time=0.0))
    plan, _ = step(sched, now=0.5)
    assert plan.is_empty  # one waiting, timeout not reached
    plan, _ = step(sched, now=1.0)
    assert [s.request_id for s in plan.seqs] == ["a"]  # the timeout formed a group of one
    add_all(sched, [make_request(n, max_tokens=2, arrival_time=1.2) for n in ("b", "c", "d")])
    plan, _ = step(sched, now=1.3)
    assert [s.request_id for s in plan.seqs] == ["a"]  # the group is fixed while it runs
    plan, _ = step(sched, now=1.4)
    assert [s.request_id for s in plan.seqs] == ["b", "c"]  # two waiting: full, no timeout
    step(sched, now=1.5)
    plan, _ = step(sched, now=1.6)
    assert plan.is_empty  # d alone, waited 0.4 s
    plan, _ = step(sched, now=2.2)
    assert [s.request_id for s in plan.seqs] == ["d"]


def test_aborting_every_member_of_a_static_group_lets_the_next_group_form():
    sched = make_scheduler(batching="static", batch_size=2)
    add_all(sched, make_requests(3, max_tokens=8))
    step(sched)
    sched.abort_request("r0")
    sched.abort_request("r1")
    plan, _ = step(sched)
    assert plan.aborted_ids == ["r0", "r1"] and [s.request_id for s in plan.seqs] == ["r2"]
