"""Adapters in device slots, as the scheduler hands them out (plain Python, no model).

A request that names an adapter is admitted only with its adapter in a slot; while every slot
is pinned by running requests of other adapters it waits (never fails), and those behind it that
need no new slot go ahead. Idle adapters leave their slots least recently used first. Pages
cached under one adapter are never matched under another.
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.scheduling.lora_slots import LoraSlots
from jaxserve.scheduling.scheduler import RequestRejected
from tests.unit.helpers import make_request, make_scheduler, step


def lora_request(rid: str, lora: str | None, **kwargs):
    req = make_request(rid, **kwargs)
    return dataclasses.replace(req, lora_name=lora, cache_salt=lora)


def test_slots_are_reused_least_recently_used_first_and_pinned_ones_never():
    slots = LoraSlots(2)
    assert slots.acquire("a") == (1, True)
    assert slots.acquire("b") == (2, True)
    assert slots.acquire("a") == (1, False)  # in its slot already: nothing to load
    assert not slots.can_acquire("c")  # both pinned
    slots.release("b")
    slots.release("a")
    slots.release("a")  # now a was used last: b goes first
    assert slots.acquire("c") == (2, True)
    assert slots.slot_of("b") is None and slots.slot_of("a") == 1
    slots.check_invariants(["c"])
    with pytest.raises(ValueError, match="in use by 1 running"):
        slots.forget("c")
    slots.forget("a")  # idle: its slot is free again
    assert slots.acquire("d") == (1, True)


def test_a_request_waits_while_every_slot_is_pinned_and_others_pass_it():
    sched = make_scheduler(max_loras=1)
    x, y, base = (
        lora_request("x", "ad-x", max_tokens=3),
        lora_request("y", "ad-y", max_tokens=3),
        lora_request("base", None, max_tokens=3),
    )
    for req in (x, y, base):
        sched.add_request(req)
    plan, _ = step(sched)
    # y's adapter has no slot (x pins the only one): y waits, the base request behind it runs.
    assert [s.request_id for s in plan.seqs] == ["x", "base"]
    assert plan.lora_loads == [(1, "ad-x")] and x.lora_slot == 1 and base.lora_slot == 0
    assert y.status.name == "WAITING" and not y.is_finished
    while not x.is_finished:
        plan, _ = step(sched)
        assert "y" not in [s.request_id for s in plan.seqs] or x.is_finished
    while not y.is_finished:  # x's slot went to y: loaded once, then y ran to its end
        plan, _ = step(sched)
        if plan.lora_loads:
            assert plan.lora_loads == [(1, "ad-y")]
    assert sched.lora_slots.num_loads == 2
    assert y.output_token_ids and len(y.output_token_ids) == 3


def test_a_request_for_an_adapter_on_an_engine_without_slots_is_refused():
    sched = make_scheduler()
    with pytest.raises(RequestRejected, match="serves no adapters"):
        sched.add_request(lora_request("x", "ad-x"))


def test_pages_cached_under_one_adapter_are_not_matched_under_another():
    sched = make_scheduler(max_loras=2, enable_prefix_caching=True)
    first = lora_request("first", "ad-1", prompt_len=12, max_tokens=1)
    sched.add_request(first)
    while sched.has_unfinished():
        step(sched)
    other = lora_request("other", "ad-2", prompt_len=12, max_tokens=1)
    same = lora_request("same", "ad-1", prompt_len=12, max_tokens=1)
    for req in (other, same):
        sched.add_request(req)
    while sched.has_unfinished():
        step(sched)
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 8  # two full pages of 4, computed under ad-1


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_the_adapters_of_running_and_waiting_requests_follow_the_queues(batching):
    """What the LoRA info metric lists (engine/metrics.py): each adapter once, by name, as its
    requests are set aside, admitted, aborted and finished, in each queue of the mode."""
    sched = make_scheduler(max_loras=1, batching=batching, batch_size=8)
    requests = [
        lora_request("x1", "ad-x", max_tokens=3),
        lora_request("y", "ad-y", max_tokens=3),
        lora_request("x2", "ad-x", max_tokens=3),
        lora_request("z", "ad-z", max_tokens=3),
        lora_request("base", None, max_tokens=3),
    ]
    for req in requests:
        sched.add_request(req)
    assert sched.lora_adapters() == ([], ["ad-x", "ad-y", "ad-z"])
    step(sched)
    assert sched.lora_adapters() == (["ad-x"], ["ad-y", "ad-z"])  # y and z set aside, back
    sched.abort_request("z")
    step(sched)
    assert sched.lora_adapters() == (["ad-x"], ["ad-y"])
    sched.check_invariants()
    while not requests[1].is_finished:
        step(sched)
        sched.check_invariants()
    assert sched.lora_adapters() == ([], [])
    assert make_scheduler().lora_adapters() == ([], [])  # no adapters served
