"""The host benchmark's fake runner: the real engine's decisions, and honest per-phase times."""

from __future__ import annotations

import json
import time

import numpy as np

from jaxserve.bench.host import HostSpec, host_engine, run_host
from jaxserve.cli import main
from jaxserve.engine.metrics import HOST_PHASES
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams
from tests.bench.conftest import TINY


def _workload(rng) -> list[tuple[str, list[int], SamplingParams]]:
    """Prompts longer than the 16-token budget (chunked prefill), greedy and seeded rows, stop
    strings and max_tokens: more requests than the 4 rows, so some wait to be admitted."""
    out = []
    for i, (prompt_len, max_tokens) in enumerate([(5, 6), (20, 9), (33, 4), (7, 12), (12, 7)]):
        ids = rng.integers(3, 512, size=prompt_len).tolist()  # random: no cached prefix helps
        stop = ("e",) if i % 2 else ()  # common in stories260k's text: ends these early
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.8 * (i % 3 != 0), seed=1000 + i, stop=stop
        )
        out.append((f"host-{i}", ids, params))
    return out


def _run(engine, workload) -> tuple[list, dict]:
    """Runs the workload to the end; returns every step's plan and each request's result."""
    plans, schedule = [], engine.scheduler.schedule

    def recording_schedule(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        plans.append([(s.request_id, s.start_pos, len(s.token_ids)) for s in plan.seqs])
        return plan

    engine.scheduler.schedule = recording_schedule
    try:
        for rid, ids, params in workload:
            engine.add_request(ids, params, request_id=rid)
        results = {rid: [[], None] for rid, _, _ in workload}
        while engine.has_unfinished():
            for out in engine.step():
                results[out.request_id][0] += out.new_token_ids
                results[out.request_id][1] = out.finish_reason
    finally:
        del engine.scheduler.schedule  # back to the class's method
    return plans, results


def test_fake_runner_makes_the_real_engines_scheduling_decisions(tiny_engine):
    """Fed the tokens the real model sampled (replayed by seed and position), the engine over
    the fake runner must schedule every step the same and finish every request the same."""
    workload = _workload(np.random.default_rng(7))
    real_plans, real = _run(tiny_engine, workload)
    assert {reason for _, reason in real.values()} >= {"stop", "length"}  # both paths exercised

    prompt_lens = {rid: len(ids) for rid, ids, _ in workload}
    replay = {
        (params.seed, prompt_lens[rid] + k): token
        for rid, _, params in workload
        for k, token in enumerate(real[rid][0])
    }

    def next_tokens(batch, sampling):
        keys = zip(sampling.seeds.tolist(), sampling.positions.tolist(), strict=True)
        return np.array([replay.get(key, 0) for key in keys], np.int32)

    config = EngineConfig(max_model_len=128, num_pages=tiny_engine.runner.config.num_pages, **TINY)
    fake = host_engine(config, tiny_engine.model, next_tokens=next_tokens)
    fake_plans, fake_results = _run(fake, workload)
    assert fake_plans == real_plans
    assert fake_results == real
    assert fake.metrics.stats.kv_pages_used == 0 and fake.runner.num_compiles == 0


def test_phases_sum_to_at_most_the_step_and_each_step_is_timed(tiny_engine):
    config = EngineConfig(max_model_len=128, num_pages=64, **TINY)
    engine = host_engine(config, tiny_engine.model)  # the jitted echo: real dispatch and copies
    for i in range(6):
        engine.add_request([3 + i] * (4 + 5 * i), SamplingParams(max_tokens=5, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        steps += 1
        phases = engine.metrics.last_host_phases
        assert set(phases) == set(HOST_PHASES)
        assert min(phases.values()) >= 0
        assert 0 < sum(phases.values()) <= wall
    stats = engine.metrics.stats
    assert stats.host_steps == steps
    # Every dispatched step was scheduled, packed and dispatched: those phases took time.
    assert min(stats.host_phase_s[p] for p in ("schedule", "pack", "dispatch")) > 0
    assert stats.num_steps > 0 and stats.generation_tokens == 30


def test_the_fake_device_clocks_the_time_it_waits_on_the_host(tiny_engine):
    """A 10 ms device behind a host that spends 30 ms between steps waits ~20 ms a step: its own
    clock says so, and the engine's timeline (a lower bound: it sees a step done only when it
    looks) sees part of it."""
    config = EngineConfig(max_model_len=128, num_pages=64, **TINY)
    engine = host_engine(config, tiny_engine.model, step_time_s=0.01)
    for i in range(2):
        engine.add_request([3 + i] * 6, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(4):  # past the prefill, the echo compiled
        engine.step()
    fake, timeline = engine.runner.device_idle_s, engine.metrics.stats.device_idle_s
    steps = 5
    for _ in range(steps):
        engine.step()
        time.sleep(0.03)  # the caller's time: the device has nothing queued
    fake = (engine.runner.device_idle_s - fake) / steps
    timeline = (engine.metrics.stats.device_idle_s - timeline) / steps
    assert fake >= 0.015, f"the fake device waited {fake * 1e3:.1f} ms a step, not ~20"
    assert timeline > 0


def test_run_host_reports_every_point_with_a_slow_fake_device():
    """A fake device of 20 ms a step: no step is shorter, and the host's share sums up."""
    report = run_host(HostSpec(running=(1, 3), context=20, steps=3, warmup=1, step_time_s=0.02))
    assert [p["running"] for p in report["points"]] == [1, 3]
    for p in report["points"]:
        # Each dispatch comes at least 20 ms after the one before: 3 steps span 2 such gaps.
        assert p["step_us"] * 3 >= 2 * 20_000
        assert set(p["phases_us"]) == set(HOST_PHASES)
        assert p["critical_us"] <= p["host_us"] <= p["step_us"]
        assert 0 <= p["device_idle_share"] < 1
        assert p["fake_device_idle_us"] >= 0
        assert p["context"] > 20


def test_cli_host_profile_writes_host_json(tmp_path, capsys):
    out = tmp_path / "host"
    argv = ["bench", "--profile", "host", "--prompt-len", "10", "--out", str(out)]
    assert main([*argv, "--running", "2", "--output-len", "2"]) == 0
    report = json.loads((out / "host.json").read_text())
    assert [p["running"] for p in report["points"]] == [2]
    assert "| running |" in capsys.readouterr().out
    assert main([*argv, "--running", "0"]) == 2
    assert "--running '0' must list counts >= 1" in capsys.readouterr().err


def test_cli_host_profile_detokenize_streams_text(tmp_path, capsys, monkeypatch):
    """`--detokenize` keeps the model's tokenizer: the engine's outputs then carry text."""
    import jaxserve.bench.host as host

    texts = []
    make = host.host_engine

    def spying_engine(*args, **kwargs):
        engine = make(*args, **kwargs)
        process = engine.outputs.process
        engine.outputs.process = lambda updates: [
            texts.append(out.text_delta) or out for out in process(updates)
        ]
        return engine

    monkeypatch.setattr(host, "host_engine", spying_engine)
    out = tmp_path / "host"
    argv = ["bench", "--profile", "host", "--prompt-len", "10", "--out", str(out)]
    assert main([*argv, "--running", "2", "--output-len", "2", "--detokenize"]) == 0
    assert json.loads((out / "host.json").read_text())["detokenize"] is True
    assert "text out" in capsys.readouterr().out
    assert "".join(texts)  # text came out, not only token ids
