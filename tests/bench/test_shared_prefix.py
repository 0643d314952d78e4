"""The bench's shared-prefix profile: its prompts, its cache on/off axis and its hit rate."""

from __future__ import annotations

import pytest

from jaxserve.bench.metrics import SLO, summarize
from jaxserve.bench.runner import prompt_for, run_offline
from jaxserve.bench.suite import build_configs, build_workloads
from jaxserve.bench.workload import shared_prefix_workloads
from jaxserve.cli import build_parser
from jaxserve.engine.core import Engine


def test_prompts_share_exactly_the_prefix_and_rates_share_the_question_lengths():
    slow, fast = shared_prefix_workloads(
        [1.0, 8.0], num_requests=6, prefix_len=40, question_range=(3, 9), max_tokens=5, seed=3
    )
    prompts = [prompt_for(spec, 512, seed=3) for spec in slow.requests]
    prefix = prompts[0][:40]
    assert all(p[:40] == prefix for p in prompts)
    assert len({tuple(p[40:]) for p in prompts}) == 6  # every question its own
    assert all(3 <= len(p) - 40 <= 9 for p in prompts)
    assert [s.prompt_len for s in slow.requests] == [s.prompt_len for s in fast.requests]
    assert slow.requests[-1].arrival_s > fast.requests[-1].arrival_s
    other_seed = shared_prefix_workloads(
        [1.0], num_requests=1, prefix_len=40, question_range=(3, 9), max_tokens=5, seed=4
    )[0]
    assert prompt_for(other_seed.requests[0], 512, seed=4)[:40] != prefix
    with pytest.raises(ValueError, match="question lengths 1 <= 5 <= 2"):
        shared_prefix_workloads(
            [1.0], num_requests=1, prefix_len=8, question_range=(5, 2), max_tokens=1
        )


def test_the_profile_compares_the_cache_on_and_off_unless_told(tmp_path, capsys):
    parse = build_parser().parse_args
    args = parse(["bench", "--profile", "shared-prefix", "--batching", "continuous"])
    labels = [(label, c.enable_prefix_caching) for label, c in build_configs(args, 640)]
    assert labels == [("prefix cache=on", True), ("prefix cache=off", False)]
    (workload, *_) = build_workloads(args)
    assert {r.prompt_len - r.shared_prefix_len for r in workload.requests} <= set(range(8, 33))
    mixed = parse(["bench", "--batching", "continuous", "--prefix-caching", "off"])
    assert [c.enable_prefix_caching for _, c in build_configs(mixed, 640)] == [False]
    with pytest.raises(SystemExit):
        parse(["bench", "--prefix-caching", "maybe"])
    assert "values must be on or off, not 'maybe'" in capsys.readouterr().err


def test_hit_rate_after_the_first_request_with_the_cache_and_none_without(tiny_engine):
    (workload,) = shared_prefix_workloads(
        [50.0], num_requests=5, prefix_len=48, question_range=(2, 6), max_tokens=3, seed=5
    )
    off = Engine(tiny_engine.config.replace(enable_prefix_caching=False), model=tiny_engine.model)
    slo = SLO(30.0, 5.0)
    on_run = summarize(run_offline(tiny_engine, workload, label="on", seed=5), slo)
    off_run = summarize(run_offline(off, workload, label="off", seed=5), slo)
    # 48 of 50-54 prompt tokens are the prefix, 3 whole pages of 16, all cached after the first.
    assert on_run["prefix_cache"]["hit_rate_after_first"] >= 48 / 54
    assert off_run["prefix_cache"] == {"hit_rate": 0.0, "hit_rate_after_first": 0.0}
    assert on_run["num_finished"] == off_run["num_finished"] == 5
