"""SLO-aware scheduling with a fake cost model: decodes keep their TPOT, nothing starves, and
without an SLO the scheduler plans exactly as before (no JAX)."""

from __future__ import annotations

import types

import pytest

from jaxserve.bench.metrics import SLO, summarize
from jaxserve.bench.simulator import build_scheduler, simulate
from jaxserve.bench.workload import LengthMix, Workload, mixed_workloads
from jaxserve.engine.calibration import MIN_SERVED_STEPS, save_served_scale
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.cost_model import CostModel, StepWork
from jaxserve.scheduling.request import FinishReason, Request
from jaxserve.scheduling.scheduler import StepResult
from jaxserve.scheduling.slo_policy import SloPolicy, attach
from tests.unit.helpers import make_request, make_scheduler
from tests.unit.test_simulator import BUCKETS, fake_cost

# A step costs 2 ms + 0.1 ms per token: a full 64-token step 8.4 ms, a 32-token one 5.2 ms.
COST = fake_cost(fixed=2e-3, per_token=1e-4)
TPOT = 6e-3  # with headroom 0.9: 5.4 ms, so steps of at most 32 tokens while decodes run
BASE = EngineConfig(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=256,
    tpot_slo_s=TPOT,
    cost_model="fake.json",
)


class RecordingCost:
    """The fake cost model, remembering every plan it priced (the simulator prices each once)."""

    def __init__(self, cost):
        self.cost, self.priced = cost, []

    def __getattr__(self, name):
        return getattr(self.cost, name)

    def predict_plan(self, plan):
        seconds = self.cost.predict_plan(plan)
        decodes = sum(
            len(s.token_ids) == 1 and s.start_pos >= s.request.num_prompt_tokens for s in plan.seqs
        )
        self.priced.append((plan.num_batched_tokens, decodes, seconds))
        return seconds


def _traffic(rate=400.0, n=60):
    mix = LengthMix(prompt_range=(16, 128), output_range=(4, 48))
    return mixed_workloads([rate], num_requests=n, mix=mix, seed=3)[0]


def _tpot(record) -> float:
    """A finished request's TPOT as the bench scores it: the mean interval between tokens."""
    return (record.finished - record.first_token) / max(1, record.output_len - 1)


def test_every_request_keeps_its_tpot_target():
    w = _traffic()
    today = RecordingCost(COST)
    before = simulate(w, BASE, today)
    # Without the policy, steps beside decodes take the whole 64-token budget: too slow.
    assert max(s for _, d, s in today.priced if d) > TPOT
    assert max(_tpot(r) for r in before.records) > TPOT
    aware = RecordingCost(COST)
    result = simulate(w, BASE.replace(slo_scheduling=True), aware)
    # The target is a mean over each request's tokens, as goodput scores it: a step may spend
    # what the decoding rows saved on earlier steps, never more.
    assert max(_tpot(r) for r in result.records) <= TPOT
    # Prefill still shares steps with decodes (the cap is not "decodes only").
    assert any(t > d for t, d, _ in aware.priced if d)
    assert len(result.records) == len(w.requests)


def test_no_request_starves_and_fcfs_order_holds():
    w = _traffic(rate=2000.0, n=80)  # a burst: the queue is long while decodes run
    result = simulate(w, BASE.replace(slo_scheduling=True, ttft_slo_s=0.05), COST)
    lengths = {s.request_id: s.max_tokens for s in w.requests}
    assert {r.request_id: r.output_len for r in result.records} == lengths
    by_arrival = sorted(result.records, key=lambda r: (r.arrival, int(r.request_id.split("-")[1])))
    starts = [r.first_scheduled for r in by_arrival]
    assert starts == sorted(starts)  # FCFS: nobody overtaken, so nobody starved


def test_without_slo_scheduling_plans_are_unchanged():
    w = _traffic()
    off = RecordingCost(COST)
    simulate(w, BASE, off)
    sched = build_scheduler(BASE, COST, 256)
    assert sched.budget_policy is None and attach(sched, BASE, COST) is None
    # A target so loose that the cap never binds must not change a single plan either.
    loose = RecordingCost(COST)
    simulate(w, BASE.replace(slo_scheduling=True, tpot_slo_s=10.0), loose)
    assert loose.priced == off.priced


def _running_decodes(n: int, context: int) -> list[Request]:
    reqs = []
    for i in range(n):
        r = Request(
            request_id=f"d{i}",
            prompt_token_ids=[5] * context,
            sampling_params=SamplingParams(max_tokens=50, ignore_eos=True),
            arrival_time=0.0,
        )
        r.output_token_ids.append(7)
        r.num_computed_tokens = r.num_tokens - 1  # decoding: one token left to run
        reqs.append(r)
    return reqs


def _policy(**kw) -> SloPolicy:
    args = dict(
        tpot_s=TPOT, ttft_s=None, token_buckets=BUCKETS, max_num_batched_tokens=64, headroom=0.9
    )
    return SloPolicy(COST, **{**args, **kw})


def test_budget_is_the_largest_bucket_within_target():
    assert _policy()(_running_decodes(4, 20), [], now=1.0) == 32
    assert _policy()([], [], now=1.0) == 64  # no decodes: nothing to protect
    # Decodes alone past the target: they still run, but no prefill joins them, not even in
    # their bucket's padding (a prompt let in now would make every later step slower).
    slow = _policy(tpot_s=1e-3)
    assert slow(_running_decodes(5, 20), [], now=1.0) == 5
    # Within the target, the decodes' bucket is the floor and its padding goes to prefill.
    assert _policy(tpot_s=3.3e-3)(_running_decodes(5, 20), [], now=1.0) == 8


def test_ttft_at_risk_gets_the_smallest_budget_that_meets_it():
    # An admitted prompt, 120 tokens still to prefill beside 4 decodes.
    prompt = Request(
        request_id="p",
        prompt_token_ids=[5] * 120,
        sampling_params=SamplingParams(max_tokens=8),
        arrival_time=1.0,
    )
    running = [*_running_decodes(4, 20), prompt]
    # Capped at 32 tokens (28 of prefill), 120 tokens take 5 steps of 5.2 ms = 26 ms; with the
    # whole 64 (60 of prefill), 2 steps of 8.4 ms = 16.8 ms.
    policy = _policy(ttft_s=0.02)
    assert policy(running, [], now=1.0) == 64
    assert policy.num_boosted == 1
    assert _policy(ttft_s=0.05)(running, [], now=1.0) == 32  # in time anyway
    # Already too late for any budget: no boost, the decodes keep their TPOT.
    assert _policy(ttft_s=0.02)(running, [], now=1.01) == 32


def test_a_step_may_spend_the_slack_the_decodes_saved():
    # 4 decodes, each 11 tokens out since its first token at t=0: 10 intervals allowed 54 ms
    # at the 5.4 ms target. At t=0.044 they have taken 44 ms, so the next step may take 5.4 +
    # 10 = 15.4 ms: the whole 64-token budget (8.4 ms) fits. At t=0.053 the slack is 1 ms: up
    # to 6.4 ms, so 32 tokens (5.2 ms).
    decodes = _running_decodes(4, 20)
    for r in decodes:
        r.output_token_ids.extend([7] * 10)
        r.num_computed_tokens = r.num_tokens - 1
        r.first_token_time = 0.0
    assert _policy()(decodes, [], now=0.044) == 64
    assert _policy()(decodes, [], now=0.053) == 32
    # With no first token known yet the decodes have saved nothing: the target alone.
    for r in decodes:
        r.first_token_time = None
    assert _policy()(decodes, [], now=0.044) == 32


def test_the_slack_counts_the_token_in_flight_under_asynchronous_scheduling():
    """Planned ahead (lag 1), each decode has a pending token whose interval has started: 10
    tokens out and 1 in flight since the first at t=0 are 10 intervals, 54 ms at the 5.4 ms
    target. At t=0.048 the slack is 6 ms, so the step may take 11.4 ms: the whole 64-token
    budget (8.4 ms). Without the pending token it would be 9 intervals, 0.6 ms of slack, 32."""
    decodes = _running_decodes(4, 20)
    for r in decodes:
        r.output_token_ids.extend([7] * 9)  # 10 out
        r.num_pending = 1  # the step in flight samples the 11th
        r.num_computed_tokens = r.num_tokens - 1  # the pending token runs next
        r.first_token_time = 0.0
    # A fresh policy's first call: no plan before it, so no step in flight delays this one.
    assert _policy(lag=1)(decodes, [], now=0.048) == 64
    assert _policy(lag=1)(decodes, [], now=0.053) == 32  # 1 ms of slack: up to 6.4 ms
    for r in decodes:  # the pending token taken in: the same 10 intervals, the same budget
        r.output_token_ids.append(7)
        r.num_pending = 0
    assert _policy(lag=1)(decodes, [], now=0.048) == 64


def test_policy_rejects_bad_targets():
    with pytest.raises(ValueError, match="TPOT target"):
        _policy(tpot_s=0.0)
    with pytest.raises(ValueError, match="needs a TPOT target"):
        EngineConfig(slo_scheduling=True, cost_model="x.json")


def test_policy_learns_that_the_machine_runs_slower_than_measured():
    policy = _policy()
    decodes = _running_decodes(4, 20)
    assert policy(decodes, [], now=0.0) == 32
    # Each call after a step in which the 4 decodes advanced by one token. The model says such a
    # step takes 2.4 ms; the machine takes 3x that, so a 32-token step (5.2 ms) no longer fits.
    now = 0.0
    for _ in range(40):
        for r in decodes:
            r.output_token_ids.append(7)
            r.num_computed_tokens += 1
        now += 3 * 2.4e-3
        budget = policy(decodes, [], now=now)
    assert policy.scale == pytest.approx(3.0, rel=0.05)
    assert budget == 4  # the decodes' own bucket: even 8 tokens (5.4 ms) would not fit now
    # An idle gap (50x the step) says nothing about the machine's pace: ignored.
    for r in decodes:
        r.output_token_ids.append(7)
        r.num_computed_tokens += 1
    policy(decodes, [], now=now + 50 * 2.4e-3)
    assert policy.scale == pytest.approx(3.0, rel=0.05)


def _alternating_steps(policy: SloPolicy, read_lag: int) -> float:
    """Plans that alternate the 4 decodes alone (2.4 ms by the model) with the 4 decodes and 60
    tokens of a prompt (8.4 ms), each step taking what the model says; the interval before each
    call is the step `read_lag` plans before the last (1: planned asynchronously, the last plan
    was made while the step before it ran). Returns the pace the policy learned."""
    decodes = _running_decodes(4, 20)
    prompt = Request(
        request_id="p",
        prompt_token_ids=[5] * 4000,
        sampling_params=SamplingParams(max_tokens=5),
        arrival_time=0.0,
    )
    prompt.num_computed_tokens = 100
    running = [*decodes, prompt]
    seconds = [2.4e-3 if k % 2 == 0 else 8.4e-3 for k in range(41)]
    now = 0.0
    policy(running, [], now=now)  # plans step 0
    for k in range(1, 41):
        for r in decodes:  # step k - 1 was planned: its tokens count as computed
            r.output_token_ids.append(7)
            r.num_computed_tokens += 1
        prompt.num_computed_tokens += 60 if (k - 1) % 2 else 0
        timed = k - 1 - read_lag
        now += seconds[timed] if timed >= 0 else 1e-4  # nothing to wait for yet
        policy(running, [], now=now)
    return policy.scale


@pytest.mark.parametrize("lag", [0, 1])
def test_pace_is_measured_against_the_step_that_filled_the_interval(lag):
    assert _alternating_steps(_policy(lag=lag), read_lag=lag) == pytest.approx(1.0)


def test_pace_paired_with_the_wrong_step_drifts():
    # Asynchronous steps read as synchronous ones: each 2.4 ms step is set against an 8.4 ms
    # prediction and the other way round, and the average of those ratios (0.29 and 3.5) is
    # far from the machine's pace of 1. So attach() passes the engine's lag.
    assert _alternating_steps(_policy(lag=0), read_lag=1) > 1.5
    config = BASE.replace(slo_scheduling=True)
    for asynchronous in (False, True):
        sched = build_scheduler(config.replace(async_scheduling=asynchronous), COST, 256)
        assert sched.budget_policy.lag == int(asynchronous)


def test_a_request_that_cannot_meet_its_ttft_is_refused_with_the_reason():
    config = BASE.replace(slo_scheduling=True, shed_late=True, ttft_slo_s=0.05)
    sched = build_scheduler(config, COST, 256)
    # 200 tokens: 4 steps of the whole budget at 8.4 ms = 33.6 ms, after waiting 40 ms or 10 ms.
    params = SamplingParams(max_tokens=4)
    sched.add_request(Request(request_id="late", prompt_token_ids=[5] * 200, arrival_time=0.0,
                              sampling_params=params))  # fmt: skip
    sched.add_request(Request(request_id="soon", prompt_token_ids=[5] * 200, arrival_time=0.03,
                              sampling_params=params))  # fmt: skip
    plan = sched.schedule(now=0.04)
    assert plan.aborted_ids == ["late"] and [s.request_id for s in plan.seqs] == ["soon"]
    late = sched.update(plan, StepResult(sampled_token_ids=[None]), now=0.05)[0]
    assert late.finished and late.request.finish_reason == FinishReason.REFUSED
    message = late.request.status_message
    # Three whole steps of 8.4 ms and a last one of 8 tokens (2.8 ms), after 40 ms waiting.
    assert "predicted time to first token is 0.068 s" in message, message
    assert "4 step(s), 28.0 ms, for its 200 tokens" in message, message
    assert "TTFT target of 0.050 s" in message, message


def test_refused_requests_are_counted_apart_from_failures_and_goodput():
    w = _traffic(rate=2000.0)
    config = BASE.replace(slo_scheduling=True, shed_late=True, ttft_slo_s=0.05)
    result = simulate(w, config, COST)
    refused = [r for r in result.records if r.finish_reason == "refused"]
    assert refused and all(r.first_token is None and r.output_len == 0 for r in refused)
    summary = summarize(result, SLO(ttft_s=0.05, tpot_s=TPOT))
    assert summary["num_refused"] == len(refused) and summary["num_failed"] == 0
    assert summary["num_finished"] + len(refused) == len(w.requests)
    assert 0 < summary["good_requests"] <= summary["num_finished"]


def _prompt(request_id: str, n: int, arrival: float = 0.0) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=[5] * n,
        sampling_params=SamplingParams(max_tokens=4),
        arrival_time=arrival,
    )


@pytest.mark.parametrize("lag", [0, 1])
def test_shedding_counts_the_step_in_flight_when_planning_asynchronously(lag):
    refused = []
    policy = _policy(lag=lag, ttft_s=0.019, shed=lambda r, why: refused.append(r.request_id))
    decodes = _running_decodes(4, 20)
    policy(decodes, [], now=0.0)
    for r in decodes:  # the 4 decodes were planned: 2.4 ms by the model, now in flight
        r.output_token_ids.append(7)
        r.num_computed_tokens += 1
    # 120 tokens at 60 a step: 2 steps of 8.4 ms, TTFT 17.8 ms from now; asynchronously the
    # 2.4 ms step in flight runs first: 20.2 ms, past the 19 ms target.
    policy(decodes, [_prompt("w", 120)], now=1e-3)
    assert refused == (["w"] if lag else [])


def test_shedding_counts_the_prompts_queued_ahead():
    refused = []
    policy = _policy(ttft_s=0.012, shed=lambda r, why: refused.append(r.request_id))
    # Nothing runs: 64 tokens a step of 8.4 ms. "a" needs one step; "b" comes after a's 60
    # tokens, so two (16.8 ms, past the 12 ms target); "c" queues behind "a" alone (a refused
    # request takes nothing), and 60 + 4 tokens fit one step.
    waiting = [_prompt("a", 60), _prompt("b", 60), _prompt("c", 4)]
    assert policy([], waiting, now=0.0) == 64
    assert refused == ["b"]


def test_the_served_pace_is_saved_with_the_cost_model(tmp_path):
    path = tmp_path / "cost.json"
    config = BASE.replace(slo_scheduling=True, cost_model=str(path), async_scheduling=False)
    sched = build_scheduler(config, COST, 256)
    policy = sched.budget_policy
    engine = types.SimpleNamespace(scheduler=sched, config=config, slo_policy=policy)
    decodes = _running_decodes(4, 20)
    now = 0.0
    policy(decodes, [], now=now)
    for k in range(MIN_SERVED_STEPS):
        # Too few steps measured: nothing saved, the file stays as it was (here: none).
        assert save_served_scale(engine) is None and not path.exists()
        for r in decodes:
            r.output_token_ids.append(7)
            r.num_computed_tokens += 1
        now += (1.5 if k % 2 else 1.1) * 2.4e-3  # 1.3x the model's 2.4 ms on average
        policy(decodes, [], now=now)
    assert policy.served_scale() == pytest.approx((1.3, MIN_SERVED_STEPS), rel=0.01)
    saved = save_served_scale(engine)
    assert saved.serving_scale == pytest.approx(1.3, rel=0.01)
    # The next start plans served steps: 1.3x the calibrated time.
    loaded = CostModel.load(path)
    work = StepWork(4, 84)
    assert loaded.predict(work) == pytest.approx(1.3 * COST.predict(work), rel=0.01)


# The row cap (admission). A step costs 2 ms + 0.1 ms a token + 1 us an attended pair: a decode
# row costs more as its context grows. The target is 2.565 ms (0.9 x 2.85 ms): 4 rows at a short
# context fit, 5 do not; at 120 tokens each, only 3 fit.
CAP_COST = fake_cost(fixed=2e-3, per_token=1e-4, per_pair=1e-6)
CAP_TPOT = 2.85e-3


class RowCounter(RecordingCost):
    """Also remembers how many requests each plan ran (prefills and decodes: each one a row)."""

    def __init__(self, cost):
        super().__init__(cost)
        self.rows = []

    def predict_plan(self, plan):
        self.rows.append(len(plan.seqs))
        return super().predict_plan(plan)


def _long_outputs(n: int) -> Workload:
    """A burst of short prompts with long outputs: rows admitted at short contexts grow."""
    mix = LengthMix(prompt_range=(16, 128), output_range=(32, 120))
    return mixed_workloads([2000.0], num_requests=n, mix=mix, seed=3)[0]


def _decode_only_steps(recording: RecordingCost) -> list[float]:
    return [seconds for tokens, decodes, seconds in recording.priced if decodes == tokens]


def test_admission_keeps_the_decode_rows_within_the_tpot_target():
    w = _long_outputs(40)
    capped = RowCounter(CAP_COST)
    result = simulate(w, BASE.replace(slo_scheduling=True, tpot_slo_s=CAP_TPOT), capped)
    # Every decode step, however long its rows' contexts grew, within the target. Before the
    # row cap, 58 of 816 such steps went past it: rows let in while their contexts were short.
    assert max(_decode_only_steps(capped)) <= 0.9 * CAP_TPOT
    assert 1 < max(capped.rows) < BASE.max_num_seqs  # the cap binds, and more than one runs
    assert len(result.records) == len(w.requests)


def _two_rows_with_slack_and_a_prompt(max_tokens: int) -> tuple[list[Request], Request]:
    """Two rows decoding at context 20 (final 70) that ran 40 intervals in 50 ms, 52.6 ms under
    their target, so a prompt's step fits their slack; and a waiting 100-token prompt."""
    decodes = _running_decodes(2, 20)
    for r in decodes:
        r.output_token_ids.extend([7] * 40)
        r.num_computed_tokens = r.num_tokens - 1
        r.first_token_time = 0.0
    waiting = Request(
        request_id="w",
        prompt_token_ids=[5] * 100,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        arrival_time=0.01,
    )
    return decodes, waiting


def test_admission_counts_each_row_at_its_final_context():
    # 0.2 us per attended pair: 3 decode rows cost 2.3 ms + 0.2 us a pair, within the 2.565 ms
    # target up to 1325 pairs. 2 decodes of a 20-token prompt and 50 outputs (final contexts
    # 70 + 70) and a 100-token prompt with 1200 outputs: 1440 pairs at the end (2.588 ms),
    # though only 222 now. With 1000 outputs, 1240 pairs (2.548 ms): it may start.
    cost = fake_cost(fixed=2e-3, per_token=1e-4, per_pair=2e-7)
    policy = SloPolicy(
        cost, tpot_s=CAP_TPOT, ttft_s=None, token_buckets=BUCKETS, max_num_batched_tokens=64
    )
    decodes, waiting = _two_rows_with_slack_and_a_prompt(max_tokens=1200)
    # Held: the step is the decodes' 2 tokens, no prefill token left over for the prompt.
    assert policy(decodes, [waiting], now=0.05) == 2
    assert policy.num_held == 1
    waiting.sampling_params = SamplingParams(max_tokens=1000)
    # Admitted: the prompt runs whole, as far as the 64-token budget allows (62 tokens).
    assert policy(decodes, [waiting], now=0.05) == 64


def test_admission_checks_the_requests_in_the_order_the_scheduler_starts_them():
    # Under the priority policy a later arrival may start first. Both prompts are 100 tokens
    # beside the two decoding rows: "a" (1000 outputs) would fit the row cap, "b" (1200) would
    # not. The scheduler starts "b" first, so nobody may start: had the policy checked "a" (the
    # earlier arrival), its budget would have let the scheduler start "b" past the cap.
    cost = fake_cost(fixed=2e-3, per_token=1e-4, per_pair=2e-7)
    policy = SloPolicy(
        cost, tpot_s=CAP_TPOT, ttft_s=None, token_buckets=BUCKETS, max_num_batched_tokens=64
    )
    decodes, a = _two_rows_with_slack_and_a_prompt(max_tokens=1000)
    _, b = _two_rows_with_slack_and_a_prompt(max_tokens=1200)
    b.request_id, b.arrival_time = "b", 0.02
    assert policy(decodes, [b, a], now=0.05) == 2  # the decodes only
    assert policy(decodes, [a, b], now=0.05) == 64  # "a" first: it runs whole, "b" waits


def test_the_policy_sees_the_queue_in_the_order_the_scheduler_starts_it():
    sched = make_scheduler(policy="priority")
    seen = []

    def budget(running, waiting, now):
        seen.append([r.request_id for r in waiting])
        return 64

    sched.budget_policy = budget
    for i, priority in enumerate([1, 2, 3, 0]):  # the queue's heap holds them as r3 r0 r2 r1
        sched.add_request(make_request(f"r{i}", arrival_time=float(i), priority=priority))
    plan = sched.schedule(now=10.0)
    assert seen == [["r3", "r0", "r1", "r2"]]
    assert [s.request_id for s in plan.seqs] == seen[0]  # four 8-token prompts fit 64


def test_admission_prices_the_cpu_decode_loop_by_its_longest_row():
    # The CPU attention runs every slot to the longest decoding context (cost_model "tiles"):
    # 2 ms + 0.1 ms a token + 1 us a decode key, keys in blocks of 32. Three rows fit the
    # 2.565 ms target while the longest final context rounds up to at most 256 keys, whatever
    # the others' contexts: by attended pairs the sum (70 + 70 + 256) would be priced instead.
    cost = fake_cost(fixed=2e-3, per_token=1e-4, per_decode_key=1e-6)
    policy = SloPolicy(
        cost, tpot_s=CAP_TPOT, ttft_s=None, token_buckets=BUCKETS, max_num_batched_tokens=64
    )
    decodes, waiting = _two_rows_with_slack_and_a_prompt(max_tokens=157)  # final 257: 288 keys
    assert policy(decodes, [waiting], now=0.05) == 2
    assert policy.num_held == 1
    waiting.sampling_params = SamplingParams(max_tokens=156)  # 256: 256 keys, 2.556 ms
    assert policy(decodes, [waiting], now=0.05) == 64


def test_a_held_request_starts_when_a_row_frees_and_nobody_starves():
    # A burst, the row cap binding and no shedding: every request still runs to its length, in
    # FCFS order, and the decode steps stay within the target.
    w = _long_outputs(30)
    rows = RowCounter(CAP_COST)
    config = BASE.replace(slo_scheduling=True, tpot_slo_s=CAP_TPOT, ttft_slo_s=0.05)
    result = simulate(w, config, rows)
    assert max(_decode_only_steps(rows)) <= 0.9 * CAP_TPOT
    lengths = {s.request_id: s.max_tokens for s in w.requests}
    assert {r.request_id: r.output_len for r in result.records} == lengths
    by_arrival = sorted(result.records, key=lambda r: (r.arrival, int(r.request_id.split("-")[1])))
    starts = [r.first_scheduled for r in by_arrival]
    assert starts == sorted(starts)


def test_one_row_at_a_time_when_one_row_alone_misses_the_target():
    # Not even one row's decode step (2.1 ms) fits a 1 ms target: requests run one at a time
    # (the best that can be done for TPOT), and all of them finish.
    w = _traffic(rate=2000.0, n=12)
    rows = RowCounter(COST)
    result = simulate(w, BASE.replace(slo_scheduling=True, tpot_slo_s=1e-3), rows)
    assert max(rows.rows) == 1
    assert len(result.records) == len(w.requests)
    outputs = {r.request_id: r.output_len for r in result.records}
    assert outputs == {s.request_id: s.max_tokens for s in w.requests}
