"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against transformers' PyTorch forward.

Each prompt token after the first must carry log_softmax(logits)[next token] of the model given
the tokens before it, and its top-k, however the prompt was split into chunks and whatever else
shared its steps. The reference is transformers' own forward on the embedded stories260k, not
our code.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from transformers import AutoModelForCausalLM

import checkpoints
from jaxserve import LLM, SamplingParams
from jaxserve.runtime.sampling import SamplingBatch, prompt_logprobs
from tests.engine.conftest import drain
from tests.torch_reference import require_torch

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
    "One day, she saw a big red ball in the park. She ran to the ball and kicked it very hard. "
    "The ball flew over the tree and Lily laughed. Her mom came to the park too. They sat on the "
    "grass and ate some cake. Then they walked home, happy and tired, and Lily went to sleep in "
    "her warm bed."
)
TOL = 1e-4  # float32 on both sides; observed differences are ~2e-6


@pytest.fixture(scope="module")
def hf_model():
    torch = require_torch()
    model = AutoModelForCausalLM.from_pretrained(
        checkpoints.DEFAULT_MODEL_DIR, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def hf_log_softmax(model, ids: list[int]) -> np.ndarray:
    """f32[len(ids), V]: row i is the distribution of the token after ids[i]."""
    torch = require_torch()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits, dim=-1).numpy()


def check_against_hf(entries, ids: list[int], ref: np.ndarray, k: int) -> None:
    assert len(entries) == len(ids)
    assert entries[0] is None  # nothing comes before the first token
    for i in range(1, len(ids)):
        e = entries[i]
        assert e.token_id == ids[i]
        assert abs(e.logprob - ref[i - 1, ids[i]]) < TOL, f"prompt token {i}"
        assert len(e.top) == k
        want = np.argsort(-ref[i - 1])[:k]
        got_ids = [t for t, _ in e.top]
        got_lps = np.array([lp for _, lp in e.top])
        np.testing.assert_allclose(got_lps, ref[i - 1, want], atol=TOL)
        # Ids in the same order, except where two values tie within the tolerance.
        for j, (a, b) in enumerate(zip(got_ids, want.tolist(), strict=True)):
            assert a == b or abs(ref[i - 1, a] - ref[i - 1, b]) < TOL, (i, j)


def test_chunked_prompt_beside_other_requests_matches_transformers(stories_engine, hf_model):
    engine = stories_engine
    ids = engine.encode(STORY)
    # Longer than a step's budget (64 tokens), so it is prefilled in several chunks.
    assert len(ids) > 2 * engine.config.max_num_batched_tokens
    llm = LLM(engine=engine)
    others = [engine.encode("The cat sat"), engine.encode("A dog ran to the park and")]
    outs = llm.generate(
        [others[0], ids, others[1]],
        [
            SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=5),
            SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
        ],
    )
    check_against_hf(outs[1].prompt_logprobs, ids, hf_log_softmax(hf_model, ids), 5)
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None
    # The neighbours' tokens are what they are alone: the asking row changed nothing of theirs.
    alone = llm.generate(
        others,
        [
            SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
        ],
    )
    assert [o.token_ids for o in alone] == [outs[0].token_ids, outs[2].token_ids]


def test_short_prompt_k0_and_one_token_prompt(stories_engine, hf_model):
    engine = stories_engine
    ids = engine.encode("Once upon a time")
    llm = LLM(engine=engine)
    # As vLLM's users write it: LLM.generate(..., prompt_logprobs=k).
    short, single = llm.generate(
        [ids, ids[:1]], SamplingParams(max_tokens=2, temperature=0.0), prompt_logprobs=0
    )
    check_against_hf(short.prompt_logprobs, ids, hf_log_softmax(hf_model, ids), 0)
    assert single.prompt_logprobs == [None]


def test_prompt_logprobs_come_once_with_the_first_output(stories_engine):
    engine = stories_engine
    rid = engine.add_request(
        "Once upon a time", SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1)
    )
    outs = [o for o in drain(engine) if o.request_id == rid]
    assert [o.prompt_logprobs is not None for o in outs] == [True] + [False] * (len(outs) - 1)
    assert outs[0].new_token_ids  # delivered with the first token


def test_asking_requests_skip_the_prefix_cache(stories_engine, hf_model):
    engine = stories_engine
    assert engine.config.enable_prefix_caching
    ids = engine.encode(STORY)[:40]
    llm = LLM(engine=engine)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([ids], greedy)  # its full pages are now cached
    rid_plain = engine.add_request(ids, greedy)
    rid_asking = engine.add_request(ids, SamplingParams(max_tokens=1, prompt_logprobs=2))
    outs = {o.request_id: o for o in drain(engine) if o.finished}
    assert outs[rid_plain].num_cached_tokens > 0  # the cache does serve this prompt
    assert outs[rid_asking].num_cached_tokens == 0
    check_against_hf(outs[rid_asking].prompt_logprobs, ids, hf_log_softmax(hf_model, ids), 2)


def test_targets_and_the_batch_flag_on_a_toy_head():
    """Three rows packed in 8 tokens (+ padding to 128, two blocks of the LM head), as a step
    packs them: row 0 a chunk whose next prompt token is 7, row 1 a chunk that ends its prompt
    (-1), row 2 a one-token chunk."""
    rng = np.random.default_rng(0)
    vocab, width = 32, 4
    head = rng.normal(size=(width, vocab)).astype(np.float32)
    hidden = rng.normal(size=(128, width)).astype(np.float32)  # tokens 8.. are padding
    token_ids = np.array([5, 9, 2, 11, 3, 4, 6, 8] + [0] * 120, np.int32)
    last_index = np.array([2, 6, 7, 0], np.int32)  # rows end at 2, 6, 7; row 3 is padding
    sb = SamplingBatch.empty(4)
    sb.next_prompt_token[:3] = [7, -1, 30]

    def run(want: bool):
        params = dataclasses.replace(sb, want_prompt_logprobs=np.bool_(want))
        return jax.jit(prompt_logprobs, static_argnums=0)(
            lambda h: h @ head, hidden, token_ids, last_index, np.int32(3), params
        )

    lp, ids, top = (np.asarray(a) for a in run(True))
    ref = np.asarray(jax.nn.log_softmax(hidden @ head, axis=-1))
    # The token after each one: the next in its chunk, or the row's next prompt token.
    targets = {0: 9, 1: 2, 2: 7, 3: 3, 4: 4, 5: 6, 7: 30}  # 6 ends its prompt: no target
    for t, target in targets.items():
        assert abs(lp[t] - ref[t, target]) < 1e-5, t
    np.testing.assert_allclose(lp[8:], ref[8:, 0], atol=1e-5)  # padding: the next token is 0
    np.testing.assert_array_equal(ids, np.argsort(-ref, axis=-1)[:, :20])
    np.testing.assert_allclose(top, np.sort(ref, axis=-1)[:, ::-1][:, :20], atol=1e-5)
    # Nobody asked: nothing computed, zeros of the same shapes (the step compiles one shape).
    skipped = [np.asarray(a) for a in run(False)]
    assert [a.shape for a in skipped] == [lp.shape, ids.shape, top.shape]
    assert not any(np.any(a) for a in skipped)


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_prompt_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs="):
        SamplingParams(prompt_logprobs=bad)
