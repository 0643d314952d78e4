"""SLO-aware scheduling in a real engine: the policy is attached from the cost model file, caps
the steps beside decodes, changes no output, and refuses a cost model of another device."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.cost_model import BucketFit, CostKey, CostModel, CostModelError
from jaxserve.engine import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import SMALL


def _cost_file(engine: Engine, path, device_kind: str | None = None) -> str:
    """A cost model of `engine`'s key: 1 ms + 0.1 ms per token in every bucket."""
    key = CostKey(
        model=engine.model.source,
        dtype=str(np.dtype(engine.model.dtype)),
        device_kind=device_kind or jax.devices()[0].device_kind,
        token_buckets=tuple(engine.runner.config.token_buckets),
    )
    fits = [
        BucketFit(bucket=b, coef=(1e-3, 1e-4, 0.0), samples=0, shared_slopes=True, rel_rms=None)
        for b in key.token_buckets
    ]
    return str(CostModel(key, fits).save(path))


def test_policy_caps_steps_beside_decodes_and_keeps_outputs(stories_engine, tmp_path):
    # Buckets 16/32/64 cost 2.6/4.2/7.4 ms; a 3.5 ms target (3.15 ms with headroom) allows 16.
    cost = _cost_file(stories_engine, tmp_path / "cost.json")
    engine = Engine(EngineConfig(**SMALL, slo_scheduling=True, tpot_slo_s=3.5e-3, cost_model=cost))
    assert engine.metrics.stats.cost_model["model"] == stories_engine.model.source
    steps = []
    schedule = engine.scheduler.schedule

    def recording(now=None):
        decoding = sum(r.num_tokens - r.num_computed_tokens == 1 for r in engine.scheduler._running)
        plan = schedule(now)
        steps.append((decoding, plan.num_batched_tokens))
        return plan

    engine.scheduler.schedule = recording
    prompts = ["Once upon a time there was a little girl named Lily. She", "Tom", "A big dog"]
    prompts += [" ".join(["The sun was hot and the sky was blue."] * 3)] * 3
    params = SamplingParams(max_tokens=12, temperature=0.0)
    got = LLM(engine=engine).generate(prompts, params)
    want = LLM(engine=stories_engine).generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert engine.slo_policy.num_capped > 0
    assert all(tokens <= 16 for decoding, tokens in steps if decoding)
    assert any(tokens > 16 for decoding, tokens in steps if not decoding)  # no decodes: whole


def test_cost_model_of_another_device_is_refused(stories_engine, tmp_path):
    cost = _cost_file(stories_engine, tmp_path / "cost.json", device_kind="TPU v9")
    with pytest.raises(CostModelError, match="device_kind='TPU v9'"):
        Engine(EngineConfig(**SMALL, slo_scheduling=True, tpot_slo_s=0.01, cost_model=cost))
