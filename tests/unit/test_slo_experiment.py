"""The measurement script's pure parts: whether the machine's step can meet an SLO, and the
table it prints (no JAX: simulated runs stand in for the real ones)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxserve.bench import slo_experiment
from jaxserve.bench.metrics import SLO, summarize
from jaxserve.bench.simulator import simulate
from jaxserve.bench.workload import LengthMix, mixed_workloads
from jaxserve.engine_config import EngineConfig
from tests.unit.test_simulator import fake_cost

# 2 ms + 0.1 ms per token: a 64-row decode step 8.4 ms, a 512-token prefill 53.2 ms.
COST = fake_cost(fixed=2e-3, per_token=1e-4)
MIX = LengthMix(prompt_range=(16, 512), output_range=(8, 256))


def test_feasibility_compares_the_step_alone_with_the_targets():
    ok, why = slo_experiment.slo_feasible(COST, SLO(0.25, 0.02), 64, MIX)
    assert ok and "can meet" in why and "8.4 ms" in why and "53.2 ms" in why, why
    ok, why = slo_experiment.slo_feasible(COST, SLO(0.25, 0.008), 64, MIX)
    assert not ok and "cannot meet" in why, why
    ok, _ = slo_experiment.slo_feasible(COST, SLO(0.05, 0.02), 64, MIX)
    assert not ok  # the longest prompt's prefill alone misses the TTFT target


def test_table_sets_each_run_beside_the_simulator_with_its_error():
    mix = LengthMix(prompt_range=(16, 128), output_range=(4, 32))
    w = mixed_workloads([200.0], num_requests=40, mix=mix, seed=1)[0]
    slo = SLO(0.2, 0.02)
    base = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                        ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s)  # fmt: skip
    configs = {
        "continuous, today": base,
        "static": base.replace(batching="static"),
        "SLO-aware + shed late": base.replace(slo_scheduling=True, shed_late=True),
    }
    rows = []
    for label, config in configs.items():
        real = summarize(simulate(w, config, COST), slo)
        # A "simulator" that runs every step twice as slow: its TTFT p50 reads far above.
        sim = summarize(simulate(w, config, fake_cost(fixed=4e-3, per_token=2e-4)), slo)
        rows.append((label, slo, real, sim))
    plan = slo_experiment.Plan(
        model=None, out=Path("."), rate=200.0, num_requests=40, full_calibration=False,
        slo=slo, loose=slo, tune=False,
    )  # fmt: skip
    lines = slo_experiment.format_table(rows, plan, "why", 1.0).splitlines()
    for label, _, real, sim in rows:
        cells = next(x for x in lines if f"| {label} |" in x).split("|")
        err = 100 * (sim["ttft"]["p50"] / real["ttft"]["p50"] - 1)
        # (Above by less under shedding, which refuses whatever would start past the target.)
        assert cells[4].strip().endswith(f"({err:+.0f}%)") and err > 25, cells
        assert cells[7].strip() == f"{real['num_refused']} / {sim['num_refused']}"
    good = {label: real["goodput"] for label, _, real, _ in rows}
    assert rows[2][2]["num_refused"] > 0  # the shedding run refused some
    ratio = good["SLO-aware + shed late"] / good["static"]
    assert lines[-1] == (
        f"SLO 0.2 s / 0.02 s: best SLO-aware goodput {good['SLO-aware + shed late']:.2f} req/s "
        f"against today's {good['continuous, today']:.2f} "
        f"({slo_experiment._ratio(good['SLO-aware + shed late'], good['continuous, today'])}) "
        f"and the better of static and dynamic {good['static']:.2f} ({ratio:.1f}x)."
    )


def test_quick_or_full_is_required():
    with pytest.raises(SystemExit):
        slo_experiment.main(["--out", "x"])


def test_goodput_error_is_left_out_when_few_requests_were_good():
    def summary(good: int, seconds: float) -> dict:
        return {"good_requests": good, "goodput": good / seconds}

    # 3 good requests against 2: -33% by the ratio, one request by the count.
    assert slo_experiment._goodput_pair(summary(3, 10), summary(2, 10)) == (
        "0.30 / 0.20 (few: 3 / 2 req)"
    )
    many = slo_experiment.FEW_GOOD * 2
    assert slo_experiment._goodput_pair(summary(many, 10), summary(many, 8)) == (
        f"{many / 10:.2f} / {many / 8:.2f} (+25%; {many} / {many} req)"
    )


def test_step_error_compares_measured_with_predicted_steps():
    from jaxserve.scheduling.cost_model import StepSample, StepWork

    # COST predicts 2 ms + 0.1 ms per token: 2.1 ms for 1 token, 8.4 ms for 64.
    steps = [
        StepSample(StepWork(1, 10), 4.2e-3),
        StepSample(StepWork(64, 640), 8.4e-3),
        StepSample(StepWork(64, 640), 4.2e-3),
    ]
    err = slo_experiment.step_error(COST, steps)
    assert err["steps"] == 3
    assert err["total_ratio"] == pytest.approx(16.8 / 18.9)
    assert err["median_ratio"] == pytest.approx(1.0)
