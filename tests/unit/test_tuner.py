"""The tuner: searches the grid in the simulator and ranks by goodput (no JAX)."""

from __future__ import annotations

from jaxserve.bench.metrics import SLO
from jaxserve.bench.tuner import Grid, serve_command, tune
from jaxserve.bench.workload import LengthMix, mixed_workloads
from jaxserve.engine_config import EngineConfig
from tests.unit.test_simulator import fake_cost

BASE = EngineConfig(max_model_len=128, cost_model="cost.json", ttft_slo_s=0.5, tpot_slo_s=0.02)


def _workload():
    # Prompts of 32-64 tokens arriving faster than they are served: a 512-token budget puts
    # several whole prompts into the steps that running requests decode in.
    mix = LengthMix(prompt_range=(32, 64), output_range=(4, 32))
    return mixed_workloads([100.0], num_requests=40, mix=mix, seed=0)


def test_grid_skips_invalid_combinations():
    grid = Grid(max_num_batched_tokens=(16, 64, 128), max_num_seqs=(32,), policy=("fcfs",))
    configs = grid.configs(BASE, max_model_len=128)
    # 16 < 32 seqs is invalid; chunking off needs a budget of a whole 128-token context.
    assert sorted(
        (c.max_num_batched_tokens, c.enable_chunked_prefill, c.slo_scheduling) for c in configs
    ) == sorted((b, ch, s) for b in (64, 128) for ch in (True, False) for s in (False, True)
                if ch or b >= 128)  # fmt: skip


def test_tune_ranks_by_simulated_goodput():
    # Steps cost 1 ms + 0.3 ms per token: a larger budget makes every decode step slower, so
    # under a 20 ms TPOT target the 64-token budget must beat the 512-token one.
    cost = fake_cost(fixed=1e-3, per_token=3e-4)
    grid = Grid(
        max_num_batched_tokens=(64, 512),
        max_num_seqs=(16,),
        enable_chunked_prefill=(True,),
        policy=("fcfs",),
        slo_scheduling=(False,),
    )
    trials = tune(_workload(), BASE, cost, SLO(0.5, 0.02), grid, max_model_len=128)
    assert [t.config.max_num_batched_tokens for t in trials] == [64, 512]
    assert trials[0].goodput > trials[1].goodput
    goodputs = [t.goodput for t in trials]
    assert goodputs == sorted(goodputs, reverse=True)


def test_serve_command_reproduces_the_knobs():
    config = BASE.replace(
        max_num_seqs=16, max_num_batched_tokens=128, enable_chunked_prefill=False,
        slo_scheduling=True, policy="priority",
    )  # fmt: skip
    cmd = serve_command(config, "tiny")
    for part in (
        "--model tiny",
        "--max-num-seqs 16",
        "--max-num-batched-tokens 128",
        "--policy priority",
        "--no-chunked-prefill",
        "--max-model-len 128",
        "--ttft-slo 0.5",
        "--tpot-slo 0.02",
        "--slo-scheduling",
        "--cost-model cost.json",
    ):
        assert part in cmd, (part, cmd)
    assert "--slo-scheduling" not in serve_command(config.replace(slo_scheduling=False))


def test_simulate_and_tune_commands(tmp_path):
    import json
    import subprocess
    import sys

    cost = fake_cost(fixed=1e-3, per_token=3e-4).save(tmp_path / "cost.json")
    traffic = ["--cost-model", str(cost), "--rate", "100", "--num-requests", "40",
               "--prompt-range", "32:64", "--output-range", "4:32", "--ttft-slo", "0.5",
               "--tpot-slo", "0.02"]  # fmt: skip
    out = tmp_path / "sim.json"
    sim = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "simulate", *traffic, "--max-num-seqs", "16",
         "--max-num-batched-tokens", "64", "--out", str(out)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "(simulated)" in sim.stdout and "mixed@100/s" in sim.stdout
    (summary,) = json.loads(out.read_text())["summaries"]
    assert summary["num_finished"] == 40
    tune = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "tune", *traffic, "--budgets", "64,512",
         "--seqs", "16", "--chunked", "on", "--policies", "fcfs", "--slo-aware", "off"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "Best of 2 for goodput" in tune.stdout
    # As test_tune_ranks_by_simulated_goodput: the 64-token budget wins.
    assert "jaxserve serve --max-num-seqs 16 --max-num-batched-tokens 64" in tune.stdout
