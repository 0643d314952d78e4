"""KV beyond the device pool on a real engine: swapped and restored pages give the same tokens.

A device pool too small for the working set forces preemptions; with swap, auto and the host tier
of the prefix cache the outputs (greedy and seeded) must equal those of an ample pool, with no
compile after warm-up while pages move.
"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import TINY

PROMPTS = ["Once upon a time", "Tom had a red ball", "The little dog", "A cat"]
PARAMS = [
    SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=60, temperature=1.0, seed=7, ignore_eos=True),
]


def _short(model, **config) -> Engine:
    """Pages for ~2.5 of 4 long requests, a small host pool."""
    return Engine(
        EngineConfig(num_pages=10, page_size=16, host_kv_gb=0.01, **TINY, **config), model=model
    )


@pytest.fixture(scope="module")
def reference(stories_engine):
    """The outputs of an ample pool: each params set for every prompt."""
    llm = LLM(engine=stories_engine)
    return {p.temperature: [o.token_ids for o in llm.generate(PROMPTS, p)] for p in PARAMS}


@pytest.mark.parametrize("mode", ["swap", "auto", "recompute"])
def test_swapped_requests_finish_with_the_tokens_of_an_ample_pool(stories_engine, reference, mode):
    engine = _short(stories_engine.model, preemption=mode)
    llm = LLM(engine=engine)
    for params in PARAMS:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == reference[params.temperature]
    stats = engine.metrics.stats
    offload = stats.kv_offload
    assert stats.num_preemptions > 0 and stats.compiles_after_warmup == 0
    if mode == "swap":
        assert offload["swap_preemptions"] > 0 == offload["recompute_preemptions"]
        assert offload["pages_swapped_in"] == offload["pages_swapped_out"] > 0
        assert offload["recomputed_tokens"] == 0
    elif mode == "recompute":
        assert offload["swap_preemptions"] == 0 < offload["recomputed_tokens"]
    assert stats.host_kv_pages_swapped == 0 and engine.scheduler.num_pages_used == 0
    text = generate_latest(engine.metrics.registry).decode()
    kind = "recompute_preemptions" if mode == "recompute" else "swap_preemptions"
    assert f'jaxserve_kv_offload_total{{kind="{kind}"}}' in text
    assert "jaxserve_host_kv_pages_used" in text


def test_an_evicted_prefix_returns_from_the_host_tier(stories_engine):
    """A long prompt's pages, evicted from the device by others, are restored on its return."""
    engine = _short(stories_engine.model, preemption="recompute")
    llm = LLM(engine=engine)
    story = "Once upon a time there was a little girl named Lily. She liked to play outside. " * 2
    params = [  # greedy and seeded
        SamplingParams(max_tokens=8, temperature=0),
        SamplingParams(max_tokens=8, temperature=1.0, seed=3),
    ]
    first = [o.token_ids for o in llm.generate([story] * 2, params)]
    llm.generate(["Tom had a red ball and a big dog"] * 1, SamplingParams(max_tokens=100))
    again = [o.token_ids for o in llm.generate([story] * 2, params)]
    offload = engine.metrics.stats.kv_offload
    assert offload["pages_offloaded"] > 0 and offload["host_hits"] >= 16
    ample = [o.token_ids for o in LLM(engine=stories_engine).generate([story] * 2, params)]
    assert again == first == ample
    assert engine.metrics.stats.compiles_after_warmup == 0


def test_host_pool_off_recomputes():
    with pytest.raises(ValueError, match="host_kv_gb=0"):
        EngineConfig(host_kv_gb=0, preemption="swap")
