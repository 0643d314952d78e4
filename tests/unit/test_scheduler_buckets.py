"""Steps that land on the runner's token buckets: the last prefill chunk trimmed, within limits."""

from __future__ import annotations

import pytest

from jaxserve.scheduling.scheduler import Scheduler, SchedulerConfig
from tests.unit.helpers import (
    FakeRunner,
    make_request,
    make_scheduler,
    reference_output,
    run_to_completion,
)

POW2 = (1, 2, 4, 8, 16, 32, 64)


def _decoding(num_decodes: int, **overrides) -> tuple[Scheduler, FakeRunner]:
    """A scheduler whose `num_decodes` requests are past their one-token prompts, decoding."""
    sched = make_scheduler(max_num_seqs=32, **overrides)
    runner = FakeRunner(page_size=4)
    for i in range(num_decodes):
        sched.add_request(make_request(f"d{i}", 1, max_tokens=20, arrival_time=float(i)))
    plan = sched.schedule()
    sched.update(plan, runner.execute(plan))
    return sched, runner


def _chunks(plan) -> dict[str, tuple[int, bool]]:
    return {s.request_id: (len(s.token_ids), s.sample) for s in plan.seqs if len(s.token_ids) > 1}


def test_a_step_just_past_a_bucket_trims_its_prefill_to_land_on_it():
    # 4 decodes + a 32-token prompt = 36 tokens, padded to 64. Running 28 of the prompt lands on
    # 32; its last 4 tokens join the next step's 4 decodes: 8, a bucket again.
    sched, runner = _decoding(4, token_buckets=POW2)
    prompt = make_request("p", 32, max_tokens=3, arrival_time=10.0)
    sched.add_request(prompt)
    plan = sched.schedule()
    assert _chunks(plan) == {"p": (28, False)} and plan.num_batched_tokens == 32
    sched.update(plan, runner.execute(plan))
    plan = sched.schedule()
    assert _chunks(plan) == {"p": (4, True)} and plan.num_batched_tokens == 8
    sched.update(plan, runner.execute(plan))
    run_to_completion(sched, runner)
    assert prompt.output_token_ids == reference_output(prompt)


@pytest.mark.parametrize(
    ("num_decodes", "prompt_len", "chunk", "why"),
    [
        (4, 44, 28, "48 tokens: 16 over 32, just half the 32 of padding it saves"),
        (4, 46, 46, "50 tokens: 18 over 32 is more than half the padding saved"),
        (14, 4, 2, "18 tokens: 2 over 16, half the 4-token chunk"),
        (15, 3, 3, "18 tokens: 2 over 16 is more than half the 3-token chunk"),
        (5, 8, 8, "13 tokens: 5 over 8 is more than half the padding to 16"),
    ],
)
def test_the_trim_is_at_most_half_the_padding_saved_and_half_the_chunk(
    num_decodes, prompt_len, chunk, why
):
    sched, _ = _decoding(num_decodes, token_buckets=POW2)
    sched.add_request(make_request("p", prompt_len, max_tokens=2, arrival_time=99.0))
    plan = sched.schedule()
    assert _chunks(plan) == {"p": (chunk, chunk == prompt_len)}, why
    assert plan.num_batched_tokens == num_decodes + chunk


def test_only_the_last_planned_chunk_is_trimmed_and_decode_only_steps_are_left_alone():
    sched, runner = _decoding(5, token_buckets=POW2)
    plan = sched.schedule()  # 5 decodes: 5 tokens pad to 8, but a decode cannot be trimmed
    assert plan.num_batched_tokens == 5 and len(plan.seqs) == 5
    sched.update(plan, runner.execute(plan))
    sched.add_request(make_request("a", 10, max_tokens=2, arrival_time=50.0))
    sched.add_request(make_request("b", 20, max_tokens=2, arrival_time=51.0))
    plan = sched.schedule()  # 5 + 10 + 20 = 35: b, admitted last, gives up 3
    assert _chunks(plan) == {"a": (10, True), "b": (17, False)}
    assert [s.request_id for s in plan.seqs][-1] == "b"


@pytest.mark.parametrize("buckets", [None, POW2])
def test_without_buckets_or_when_the_budget_cuts_the_chunk_nothing_is_trimmed(buckets):
    sched, runner = _decoding(4, token_buckets=buckets)
    sched.add_request(make_request("long", 62, max_tokens=2, arrival_time=10.0))
    plan = sched.schedule()  # the budget (64, the top bucket) cuts the prompt at 60 anyway
    assert _chunks(plan) == {"long": (60, False)} and plan.num_batched_tokens == 64
    sched.update(plan, runner.execute(plan))
    sched.add_request(make_request("p", 32, max_tokens=2, arrival_time=11.0))
    plan = sched.schedule()  # 4 decodes + 2 of 'long' + 32 of 'p' = 38, 6 over 32
    expected = 26 if buckets else 32
    assert _chunks(plan) == {"long": (2, True), "p": (expected, not buckets)}


def test_without_chunked_prefill_a_prompt_is_never_trimmed():
    sched, _ = _decoding(4, token_buckets=POW2, enable_chunked_prefill=False)
    sched.add_request(make_request("p", 32, max_tokens=2, arrival_time=10.0))
    plan = sched.schedule()  # 36 tokens, but the prompt must run whole
    assert _chunks(plan) == {"p": (32, True)} and plan.num_batched_tokens == 36


def test_trimmed_plans_keep_every_output_exact_under_a_mixed_load():
    # A finer ladder (step 16 above 16) over a crowd of prompts of many lengths.
    sched = make_scheduler(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_pages=64,
        token_buckets=(1, 2, 4, 8, 16, 32, 48, 64),
    )
    requests = [
        make_request(f"r{i}", 3 + (i * 7) % 40, max_tokens=2 + i % 5, arrival_time=float(i))
        for i in range(24)
    ]
    runner = FakeRunner(page_size=4)
    for req in requests:
        sched.add_request(req)
    plans = run_to_completion(sched, runner)
    for req in requests:
        assert req.output_token_ids == reference_output(req)
    on_bucket = sum(p.num_batched_tokens in sched.config.token_buckets for p in plans)
    assert on_bucket > len(plans) // 2  # the trims happened, not only the budget-cut steps


@pytest.mark.parametrize(
    ("buckets", "message"),
    [((), "must be non-empty"), ((1, 4, 2), "strictly increasing"), ((0, 8), "integers >= 1")],
)
def test_bad_token_buckets_are_refused(buckets, message):
    config = dict(max_num_seqs=8, max_num_batched_tokens=64, num_pages=8, max_model_len=64)
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**config, token_buckets=buckets)
    given = SchedulerConfig(**config, token_buckets=[1, 8, 64])  # a list, as argparse gives
    assert given.token_buckets == (1, 8, 64) and hash(given)
