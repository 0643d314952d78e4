"""jaxserve behind Tunix's rollout interface (jaxserve.integrations.tunix): what each call returns
equals the engine's own results, a GRPO loop through it learns, and with Tunix installed the
adapter is a real BaseRollout."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.integrations import tunix as adapter
from jaxserve.integrations.rollout import grpo
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import SMALL

PROMPTS = ["Once upon a time", "The little dog ran to the park and"]


@pytest.fixture(scope="module")
def rollout() -> adapter.JaxserveRollout:
    return adapter.JaxserveRollout(LLM(engine=Engine(EngineConfig(**SMALL))))


def config(**fields):
    base = dict(max_tokens_to_generate=12, temperature=0.9, top_k=20, seed=7, max_prompt_length=8)
    return adapter.RolloutConfig(**{**base, **fields})


def test_generate_is_the_engines_generation_with_padded_prompts(rollout):
    engine = rollout.llm.engine
    out = rollout.generate(PROMPTS, config(return_logprobs=True))
    ids = [engine.encode(p)[-8:] for p in PROMPTS]
    assert len(engine.encode(PROMPTS[1])) > 8  # the long prompt is cut to its last 8 tokens
    want = rollout.llm.generate(
        ids,
        [
            SamplingParams(
                max_tokens=12, temperature=0.9, top_k=20, seed=7 + i, logprobs=0,
                logprobs_mode="processed",
            )
            for i in range(2)
        ],
    )  # fmt: skip
    assert [t.tolist() for t in out.tokens] == [w.token_ids for w in want]
    assert out.text == [w.text for w in want]
    assert out.tokens[0].tolist() != out.tokens[1].tolist()
    for lp, w in zip(out.logprobs, want, strict=True):
        # The second generation takes the prompts' pages from the cache (the partial ones
        # forked), so only their last token is computed, in another shape: a few 1e-6 apart.
        np.testing.assert_allclose(lp, [e.logprob for e in w.logprobs], atol=1e-5)
        assert (lp <= 0).all() and len(lp) == len(w.token_ids)
    pad = rollout.pad_id()
    assert out.left_padded_prompt_tokens.shape == (2, 8)
    short = len(ids[0])
    assert (out.left_padded_prompt_tokens[0, : 8 - short] == pad).all()
    assert out.left_padded_prompt_tokens[0, 8 - short :].tolist() == ids[0]
    assert out.left_padded_prompt_tokens[1].tolist() == ids[1]
    # Raw mode is the engine's default logprobs; no logprobs unless asked.
    raw = rollout.generate(PROMPTS, config(return_logprobs=True, rollout_vllm_logprobs_mode="raw"))
    assert [t.tolist() for t in raw.tokens] == [t.tolist() for t in out.tokens]
    assert not np.allclose(raw.logprobs[0], out.logprobs[0])
    assert rollout.generate(PROMPTS, config()).logprobs is None


def test_sampling_knobs_map_as_tunix_means_them(rollout):
    p = rollout.sampling_params(config(top_k=-1, top_p=None, seed=np.array([5]), eos_tokens=[9]), 3)
    assert (p.top_k, p.top_p, p.seed, p.stop_token_ids) == (0, 1.0, 8, (9,))
    assert rollout.sampling_params(config(top_k=None, seed=None)).seed is None
    greedy = rollout.generate(PROMPTS[:1] * 2, config(temperature=0.0, seed=None))
    assert greedy.tokens[0].tolist() == greedy.tokens[1].tolist()
    with pytest.raises(TypeError, match="echo"):
        rollout.generate(PROMPTS, config(), echo=True)
    with pytest.raises(ValueError, match="max_prompt_length=0"):
        rollout.generate(PROMPTS, config(max_prompt_length=0))


def test_per_token_logps_are_the_teacher_forced_scores_zero_at_padding(rollout):
    out = rollout.generate(PROMPTS, config(max_tokens_to_generate=6))
    pad = rollout.pad_id()
    width = 9
    completions = np.full((2, width), pad, np.int32)
    for row, t in enumerate(out.tokens):
        completions[row, : len(t)] = t
    got = rollout.get_per_token_logps(out.left_padded_prompt_tokens, completions)
    assert got.shape == (2, width) and got.dtype == np.float32
    for row, t in enumerate(out.tokens):
        prompt = out.left_padded_prompt_tokens[row]
        prompt = prompt[np.flatnonzero(prompt != pad)[0] :].tolist()
        want = rollout.llm.score([prompt], [t.tolist()])[0]
        np.testing.assert_allclose(got[row, : len(t)], want, atol=1e-5)  # other buckets
        assert (got[row, len(t) :] == 0).all() and (got[row, : len(t)] < 0).all()
    with pytest.raises(ValueError, match="all padding"):
        rollout.get_per_token_logps(np.full((1, 4), pad), completions[:1])
    with pytest.raises(ValueError, match=r"\(2, 8\) and completion_tokens \(1, 9\)"):
        rollout.get_per_token_logps(out.left_padded_prompt_tokens, completions[:1])


def test_update_params_serves_the_new_weights(rollout):
    import jax

    engine = rollout.llm.engine
    before = jax.device_get(engine.runner.params)
    greedy = config(temperature=0.0, seed=None)
    first = rollout.generate(PROMPTS, greedy).tokens
    moved = jax.tree.map(lambda a: a * np.float32(1.3), before)
    mapped = []
    rollout._params_map = lambda p: mapped.append(1) or p
    try:
        rollout.update_params(moved)
        assert mapped == [1]
        assert [t.tolist() for t in rollout.generate(PROMPTS, greedy).tokens] != [
            t.tolist() for t in first
        ]
        with pytest.raises(NotImplementedError, match="filter_types"):
            rollout.update_params(moved, filter_types=(object,))
    finally:
        rollout._params_map = None
        rollout.update_params(before)
    assert [t.tolist() for t in rollout.generate(PROMPTS, greedy).tokens] == [
        t.tolist() for t in first
    ]


def test_ids_and_model(rollout):
    engine = rollout.llm.engine
    assert rollout.eos_id() == engine.tokenizer.eos_token_id
    assert rollout.pad_id() == (engine.tokenizer.pad_token_id or engine.tokenizer.eos_token_id)
    assert adapter.JaxserveRollout(rollout.llm, pad_id=0).pad_id() == 0
    assert rollout.model() is engine.model


def test_a_toy_grpo_loop_through_the_adapter_raises_its_reward(rollout):
    import jax

    before = jax.device_get(rollout.llm.engine.runner.params)
    heard = []
    try:
        rewards = grpo(
            rollout,
            "Once upon a time",
            lambda ids: float(np.mean([t % 2 == 0 for t in ids])) if ids else 0.0,
            steps=8,
            group=8,
            max_tokens=8,
            learning_rate=2e-2,
            on_step=lambda step, reward: heard.append((step, reward)),
        )
    finally:
        rollout.update_params(before)
    assert np.mean(rewards[-2:]) > rewards[0] + 0.2, rewards
    assert heard == list(enumerate(rewards))


@pytest.mark.skipif(not adapter.HAVE_TUNIX, reason="Tunix (the `tunix` extra) is not installed")
def test_with_tunix_the_adapter_is_a_base_rollout_and_returns_its_output(rollout):
    from tunix.rl.rollout import base_rollout

    assert isinstance(rollout, base_rollout.BaseRollout)
    out = rollout.generate(PROMPTS, base_rollout.RolloutConfig(max_tokens_to_generate=4, seed=1))
    assert isinstance(out, base_rollout.RolloutOutput)
    assert dataclasses.is_dataclass(out) and len(out.tokens) == 2
