"""The simulator: the real scheduler on a virtual clock, reported as the bench reports (no JAX)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxserve.bench.metrics import SLO, summarize
from jaxserve.bench.simulator import simulate
from jaxserve.bench.workload import LengthMix, RequestSpec, Workload, mixed_workloads
from jaxserve.engine_config import EngineConfig
from jaxserve.runtime.buckets import bucket_ladder
from jaxserve.scheduling.cost_model import BucketFit, CostKey, CostModel

BUCKETS = bucket_ladder(1, 64)


def fake_cost(fixed=1e-3, per_token=1e-4, per_pair=0.0, per_decode_key=None) -> CostModel:
    """Every bucket the same line: a step of t tokens costs fixed + per_token * t seconds, plus
    per_pair an attended pair ("pairs" features) or, given per_decode_key, that per key of the
    CPU attention's decode loop ("tiles")."""
    key = CostKey(model="fake", dtype="float32", device_kind="cpu", token_buckets=BUCKETS)
    tiles = per_decode_key is not None
    coef = (fixed, per_token, per_decode_key, 0.0) if tiles else (fixed, per_token, per_pair)
    fits = [
        BucketFit(bucket=b, coef=coef, samples=0, shared_slopes=True, rel_rms=None) for b in BUCKETS
    ]
    return CostModel(key, fits, features="tiles" if tiles else "pairs")


CONFIG = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)


def _mixed(rate=50.0, n=40, seed=0) -> Workload:
    mix = LengthMix(prompt_range=(8, 64), output_range=(4, 32))
    return mixed_workloads([rate], num_requests=n, mix=mix, seed=seed)[0]


def test_one_request_timed_step_by_step():
    # An 8-token prompt (a whole bucket) and 3 outputs on an idle engine: one prefill step
    # (1 + 0.8 ms, which samples the first token), then two 1-token decode steps (1.1 ms each).
    w = Workload(
        name="one",
        load=1.0,
        load_kind="rate",
        requests=(RequestSpec(request_id="a", arrival_s=0.5, prompt_len=8, max_tokens=3),),
    )
    result = simulate(w, CONFIG, fake_cost())
    (r,) = result.records
    assert r.finish_reason == "length" and r.output_len == 3
    assert r.arrival == pytest.approx(0.5)
    assert r.ttft == pytest.approx(1.8e-3)
    assert r.tpot == pytest.approx(1.1e-3)
    assert result.engine["steps"] == 3


def test_asynchronous_scheduling_plans_one_step_ahead():
    # As the engine runs it: step t+1 is planned while step t runs, from the requests admitted
    # before step t started. "b" arrives during "a"'s prefill (0 to 1.8 ms), after a's next
    # step (its first decode, 1.1 ms) was planned, so it starts one such step later than it
    # would if every plan waited for the last step's tokens. Synchronously: steps of 8 tokens
    # (a's decode + 7 of b's prompt, 1.8 ms) and 2 tokens (1.2 ms) give b its first token at
    # 1.8 + 1.8 + 1.2 = 4.8 ms, 4.3 ms after its arrival.
    w = Workload(
        name="two",
        load=1.0,
        load_kind="rate",
        requests=(
            RequestSpec(request_id="a", arrival_s=0.0, prompt_len=8, max_tokens=20),
            RequestSpec(request_id="b", arrival_s=5e-4, prompt_len=8, max_tokens=4),
        ),
    )

    def ttfts(async_scheduling: bool) -> dict[str, float]:
        config = CONFIG.replace(async_scheduling=async_scheduling)
        return {r.request_id: r.ttft for r in simulate(w, config, fake_cost()).records}

    sync, ahead = ttfts(False), ttfts(True)
    assert sync["b"] == pytest.approx(4.3e-3)
    assert ahead["b"] == pytest.approx(sync["b"] + 1.1e-3)
    assert ahead["a"] == sync["a"] == pytest.approx(1.8e-3)  # nothing was in flight for "a"


def test_same_seed_same_result_and_other_seed_differs():
    def run(seed):
        result = simulate(_mixed(seed=seed), CONFIG, fake_cost(), seed=seed)
        return [(r.request_id, r.first_token, r.finished) for r in result.records]

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_every_request_finishes_at_its_length_and_metrics_follow():
    w = _mixed()
    result = simulate(w, CONFIG, fake_cost())
    lengths = {s.request_id: s.max_tokens for s in w.requests}
    assert sorted(r.request_id for r in result.records) == sorted(lengths)
    assert all(r.output_len == lengths[r.request_id] for r in result.records)
    summary = summarize(result, SLO(ttft_s=10.0, tpot_s=1.0))
    assert summary["num_finished"] == len(lengths)
    assert summary["good_requests"] == len(lengths)  # nothing misses such loose targets
    tight = summarize(result, SLO(ttft_s=1e-3, tpot_s=1e-3))
    assert tight["good_requests"] < len(lengths)


def test_slower_steps_slow_every_latency():
    w = _mixed()
    fast = summarize(simulate(w, CONFIG, fake_cost(fixed=1e-3)), SLO(1.0, 0.1))
    slow = summarize(simulate(w, CONFIG, fake_cost(fixed=5e-3)), SLO(1.0, 0.1))
    assert slow["ttft"]["p50"] > fast["ttft"]["p50"]
    assert slow["tpot"]["p50"] > 3 * fast["tpot"]["p50"]


def test_step_cost_times_the_steps_and_cost_plans_them():
    # Steps take step_cost's time: without an SLO policy (nothing plans with `cost`) the run is
    # the one simulated with that model alone.
    w = _mixed()
    fast, slow = fake_cost(fixed=1e-3), fake_cost(fixed=5e-3)

    def times(result):
        return sorted((r.request_id, r.first_token, r.finished) for r in result.records)

    assert times(simulate(w, CONFIG, fast, step_cost=slow)) == times(simulate(w, CONFIG, slow))
    # With one, the policy plans by `cost` while the steps run slower: its budget then differs
    # from a policy that knew the slow steps (it learns their pace only step by step).
    aware = CONFIG.replace(slo_scheduling=True, ttft_slo_s=0.05, tpot_slo_s=0.008)
    planned_fast = simulate(w, aware, fast, step_cost=slow)
    assert times(planned_fast) != times(simulate(w, aware, slow))


def test_static_batching_waits_for_the_whole_group():
    w = _mixed(rate=1000.0, n=16)
    cont = summarize(simulate(w, CONFIG, fake_cost()), SLO(1.0, 0.1))
    static = summarize(simulate(w, CONFIG.replace(batching="static"), fake_cost()), SLO(1.0, 0.1))
    assert static["ttft"]["p99"] > cont["ttft"]["p99"]


def test_simulator_path_imports_no_jax():
    code = (
        "import sys; import jaxserve.bench.simulator, jaxserve.cli.simulate, jaxserve.bench.tuner; "
        "print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
