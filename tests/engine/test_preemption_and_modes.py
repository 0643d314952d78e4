"""Preemption by recompute, batching modes and a random-weight llama shape, on real engines."""

from __future__ import annotations

from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import TINY, short_of_pages


def test_preempted_requests_finish_with_the_tokens_they_would_have_had(stories_engine):
    """Pages for ~2.5 of 4 long requests: preemptions happen, outputs do not change."""
    engine = short_of_pages(stories_engine.model)
    prompts = ["Once upon a time", "Tom had a red ball", "The little dog", "A cat"]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    preempted = LLM(engine=engine).generate(prompts, params)
    assert engine.metrics.stats.num_preemptions > 0
    assert engine.scheduler.num_pages_used == 0
    reference = LLM(engine=stories_engine).generate(prompts, params)
    for a, b in zip(preempted, reference, strict=True):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason == "length"


def test_static_batching_gives_the_same_tokens_as_continuous(stories_engine):
    """Batching modes change only the schedule: greedy outputs are identical."""
    static = Engine(
        EngineConfig(batching="static", batch_size=2, **TINY), model=stories_engine.model
    )
    prompts = ["Once upon a time", "Sam", "The sun was hot", "A cat", "Tom"]
    params = [SamplingParams(max_tokens=4 + 6 * i, temperature=0) for i in range(5)]
    got = LLM(engine=static).generate(prompts, params)
    want = LLM(engine=stories_engine).generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_random_llama_shape_is_batch_invariant():
    """A random-weight llama-tiny: 16 concurrent requests equal their solo runs."""
    engine = Engine(
        EngineConfig(
            model="llama-tiny",
            max_num_seqs=16,
            max_num_batched_tokens=64,
            min_token_bucket=16,
            seq_bucket_factor=4,
            # 17-token prompts + 12 outputs: a short context keeps page tables small, and only
            # the buckets these runs use compile (this test counts no compiles).
            max_model_len=64,
            precompile=False,
            show_progress=False,
        )
    )
    prompts = [[1 + (7 * i + j) % 1000 for j in range(2 + i)] for i in range(16)]
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0 if i % 2 else 1.0, seed=i)
        for i in range(16)
    ]
    llm = LLM(engine=engine)
    together = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        assert out.token_ids == llm.generate([prompt], p)[0].token_ids
