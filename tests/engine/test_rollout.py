"""The rollout API on the embedded model: weights swapped into a running engine, sleep and wake,
teacher-forced scores, and a toy RL loop whose reward rises (docs/rl.md)."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.integrations.rollout import forward_logprobs, reinforce
from jaxserve.models.loaded import stack_layers, unstack_layers
from jaxserve.runtime import compiles
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import SMALL

PROMPT = list(range(1, 40))  # two full pages of 16 and a partial one: cached pages to reuse
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(engine=Engine(EngineConfig(**SMALL)))


def perturbed(params, scale: float = 0.5, seed: int = 1):
    """Every weight moved by relative noise: any weight not swapped in would show."""
    leaves, treedef = jax.tree.flatten(jax.device_get(params))
    rng = np.random.default_rng(seed)
    moved = [
        np.asarray(a) * (1 + scale * rng.standard_normal(a.shape)).astype(a.dtype) for a in leaves
    ]
    return jax.tree.unflatten(treedef, moved)


def greedy(llm: LLM, prompt=PROMPT) -> list[int]:
    return llm.generate([prompt], GREEDY)[0].token_ids


def test_update_weights_serves_the_new_weights_without_compiling_or_old_pages(llm):
    engine = llm.engine
    old = jax.device_get(engine.runner.params)
    before = greedy(llm)  # publishes the prompt's pages under the old weights
    assert greedy(llm) == before
    hits = engine.scheduler.kv.stats.hits
    assert hits > 0  # the second run reused the first's pages: the cache is on
    new = perturbed(old)
    root = engine.scheduler.prefix.hasher.root()
    mark = compiles.serving()
    llm.update_weights(new)
    # Hashes made after the update can never equal one made before (Decision 9).
    assert engine.scheduler.prefix.hasher.root() != root
    after = greedy(llm)
    assert compiles.serving() - mark == 0, compiles.recent()
    assert engine.scheduler.kv.stats.hits == hits  # the old pages were not reused
    assert after != before  # the perturbation matters, so the comparison below means something
    fresh = LLM(
        engine=Engine(EngineConfig(**SMALL), model=dataclasses.replace(engine.model, params=new))
    )
    assert greedy(fresh) == after
    # Back to the old weights: the old outputs again, still no compile.
    llm.update_weights(old)
    assert greedy(llm) == before
    assert compiles.serving() - mark == 0
    # The new ones in the other layout (stacked layers, as checkpoints hold them, against the
    # unrolled loop's tree the CPU serves, or the reverse): converted, then the same outputs.
    # The conversion's slices may compile; a trainer of the served layout pays none.
    other = jax.device_get(unstack_layers(new) if "layers" in new else stack_layers(new))
    llm.update_weights(other)
    assert greedy(llm) == after
    llm.update_weights(old)


def test_requests_in_flight_finish_on_the_old_weights(llm):
    engine = llm.engine
    old = jax.device_get(engine.runner.params)
    reference = greedy(llm, PROMPT[:20])
    rid = engine.add_request(PROMPT[:20], GREEDY)
    outputs = []
    for _ in range(3):
        outputs += engine.step()
    outputs += engine.update_weights(perturbed(old, seed=2))
    tokens = [t for o in outputs if o.request_id == rid for t in o.new_token_ids]
    assert tokens == reference
    assert any(o.finished for o in outputs if o.request_id == rid)
    assert greedy(llm, PROMPT[:20]) != reference  # the new weights serve the next request
    llm.update_weights(old)


def test_mismatched_weights_are_refused_with_the_path(llm):
    engine = llm.engine
    good = jax.device_get(engine.runner.params)
    leaves = jax.tree_util.tree_flatten_with_path(good)[0]
    name = "/".join(k.key for k in leaves[0][0])
    bad = jax.tree.unflatten(
        jax.tree.structure(good), [np.zeros((3, 3), np.float32)] + [x for _, x in leaves[1:]]
    )
    with pytest.raises(ValueError, match=rf"{name} is float32\[3, 3\]; the model's is"):
        engine.update_weights(bad)
    wrong_dtype = jax.tree.map(lambda a: np.asarray(a, np.float16), good)
    with pytest.raises(ValueError, match="float16"):
        engine.update_weights(wrong_dtype)
    missing = dict(good)
    missing.pop(next(iter(good)))
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights(missing)
    assert greedy(llm) == greedy(llm)  # still serving


def test_sleep_frees_the_pool_and_weights_and_wake_up_serves_the_same(llm):
    engine = llm.engine
    before = greedy(llm)
    pool_bytes = sum(a.nbytes for a in jax.tree.leaves(engine.runner.kv))
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(engine.runner.params))
    live = sum(a.nbytes for a in jax.live_arrays())
    mark = compiles.serving()
    freed = llm.sleep(level=2)
    assert freed >= pool_bytes + weight_bytes
    assert live - sum(a.nbytes for a in jax.live_arrays()) >= pool_bytes + weight_bytes
    with pytest.raises(RuntimeError, match="asleep"):
        engine.update_weights(jax.device_get(engine._host_params))
    llm.wake_up()
    assert greedy(llm) == before
    assert compiles.serving() - mark == 0
    assert llm.sleep(level=1) >= pool_bytes
    llm.wake_up()
    assert greedy(llm) == before
    assert compiles.serving() - mark == 0


def test_score_and_sampled_logprobs_equal_a_teacher_forced_forward(llm):
    engine = llm.engine
    prompts = [PROMPT[:7], PROMPT[:23]]
    completions = [[5, 9, 2, 77, 3], list(range(100, 130))]
    scores = llm.score(prompts, completions)
    params = jax.device_get(engine.runner.params)
    for p, c, s in zip(prompts, completions, scores, strict=True):
        ref = np.asarray(
            forward_logprobs(engine.model.config, engine.model.dtype, params, [p + c])(params)
        )
        assert len(s) == len(c)
        np.testing.assert_allclose(s, ref[len(p) - 1 :], atol=1e-5, rtol=0)
    # Sampled tokens' logprobs (raw: before the temperature) against the same forward.
    done = llm.generate(
        [prompts[0]],
        SamplingParams(max_tokens=10, temperature=1.3, seed=3, logprobs=0, ignore_eos=True),
    )[0]
    seq = prompts[0] + done.token_ids
    ref = np.asarray(
        forward_logprobs(engine.model.config, engine.model.dtype, params, [seq])(params)
    )
    got = [e.logprob for e in done.logprobs]
    np.testing.assert_allclose(got, ref[len(prompts[0]) - 1 :], atol=1e-5, rtol=0)


def test_processed_logprobs_are_of_the_tempered_top_k_distribution(llm):
    # The same seeded request raw and processed draws the same tokens; the processed logprob of
    # each is the raw one re-normalised over the top k after the temperature:
    # (l_c - lse) / T - logsumexp((l_i - lse) / T over the top k) = l_c / T - logsumexp(l_i / T).
    temperature, k = 0.8, 5
    params = dict(max_tokens=10, temperature=temperature, top_k=k, seed=11, logprobs=k)
    raw, processed = (
        llm.generate([PROMPT[:9]], SamplingParams(**params, ignore_eos=True, logprobs_mode=mode))[0]
        for mode in ("raw", "processed_logprobs")
    )
    assert raw.token_ids == processed.token_ids
    for r, p in zip(raw.logprobs, processed.logprobs, strict=True):
        top = np.array([lp for _, lp in r.top], np.float64) / temperature
        norm = np.logaddexp.reduce(top)
        assert [t for t, _ in p.top] == [t for t, _ in r.top]  # the same k, nothing filtered in
        np.testing.assert_allclose(p.logprob, r.logprob / temperature - norm, atol=2e-5)
        np.testing.assert_allclose([lp for _, lp in p.top], top - norm, atol=2e-5)
        np.testing.assert_allclose(np.exp([lp for _, lp in p.top]).sum(), 1.0, rtol=1e-5)


def test_a_toy_reinforce_loop_raises_its_reward(llm):
    engine = llm.engine
    old = jax.device_get(engine.runner.params)

    # Reward: the share of completion tokens with an even id; about half at first, so every
    # batch of rollouts carries a gradient.
    def reward(tokens):
        return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)

    # (The trainer's eager forward compiles its own small programs: no compile count here.)
    rewards = reinforce(
        llm, PROMPT[:5], reward, steps=10, samples=8, max_tokens=8, learning_rate=3e-2
    )
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.1, rewards
    llm.update_weights(old)


def test_update_weights_from_an_orbax_folder(llm, tmp_path):
    from checkpoints import save_orbax

    engine = llm.engine
    old = jax.device_get(engine.runner.params)
    new = perturbed(old, seed=4)
    save_orbax(dataclasses.replace(engine.model, params=new), tmp_path / "ckpt")
    llm.update_weights(new)
    expected = greedy(llm)
    llm.update_weights(old)
    assert greedy(llm) != expected
    llm.update_weights(str(tmp_path / "ckpt"))
    assert greedy(llm) == expected
    llm.update_weights(old)


def hf_perturbed(seed: int) -> dict[str, np.ndarray]:
    """The embedded model's tensors under their Hugging Face names (its own safetensors file,
    as checkpoints reads it), each moved by relative noise."""
    from safetensors.numpy import load_file

    from checkpoints import DEFAULT_MODEL_DIR

    rng = np.random.default_rng(seed)
    return {
        name: (a * (1 + 0.5 * rng.standard_normal(a.shape))).astype(a.dtype)
        for name, a in load_file(DEFAULT_MODEL_DIR / "model.safetensors").items()
    }


def test_update_weights_from_a_safetensors_folder_and_hf_named_arrays(llm, tmp_path):
    import shutil

    from safetensors.numpy import save_file

    from checkpoints import DEFAULT_MODEL_DIR, load_model

    engine = llm.engine
    old = jax.device_get(engine.runner.params)
    before = greedy(llm)
    named = hf_perturbed(seed=5)
    folder = tmp_path / "hf"
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    save_file(named, folder / "model.safetensors")
    fresh = LLM(engine=Engine(EngineConfig(**SMALL), model=load_model(folder)))
    expected = greedy(fresh)
    assert expected != before
    mark = compiles.serving()
    llm.update_weights(str(folder))
    assert greedy(llm) == expected
    llm.update_weights(old)
    assert greedy(llm) == before
    llm.update_weights(named)  # a trainer's state dict under HF names, nothing on disk
    assert greedy(llm) == expected
    assert compiles.serving() - mark == 0, compiles.recent()
    # Arrays that do not fill the model are refused, naming what is missing.
    partial = {k: v for k, v in named.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"lacks weights for \['model.norm.weight'\]"):
        llm.update_weights(partial)
    with pytest.raises(ValueError, match=re.escape("model.layers.0.mlp.up_proj.weight' has shape")):
        llm.update_weights({**named, "model.layers.0.mlp.up_proj.weight": np.zeros((2, 2))})
    llm.update_weights(old)


def test_sampled_logprobs_are_the_same_bits_whatever_batch_they_share():
    """The batch-invariant mode (one token bucket: min_token_bucket = max_num_batched_tokens):
    a seeded request's tokens and raw logprobs alone, beside 7 others and beside 15 others of
    other lengths are the same bits. With several token buckets the tokens are the same but
    the logprobs differ by up to ~6e-6 (other matmul shapes); the price of the mode is that
    every step pads to the whole token budget. Without the prefix cache: a prompt the cache
    serves (its full pages, or its partial page forked) computes only its last tokens, in
    another shape, and differs by a few 1e-6 (test_prefix_cache.py keeps its tokens)."""
    config = {**SMALL, "min_token_bucket": 64, "enable_prefix_caching": False}
    llm = LLM(engine=Engine(EngineConfig(**config)))
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11, logprobs=0, ignore_eos=True)
    target = PROMPT[:9]

    def run(others: int):
        prompts = [target] + [PROMPT[: 3 + (5 * i) % 30] for i in range(others)]
        extra = [
            SamplingParams(max_tokens=4 + i, temperature=0.7, seed=i, ignore_eos=True)
            for i in range(others)
        ]
        out = llm.generate(prompts, [params, *extra])[0]
        return out.token_ids, np.asarray([e.logprob for e in out.logprobs], np.float32)

    alone_ids, alone_lp = run(0)
    for others in (7, 15):
        ids, lp = run(others)
        assert ids == alone_ids
        np.testing.assert_array_equal(lp, alone_lp)
