"""logit_bias and min_tokens, on the device per row, against what they must do on stories260k.

The expected tokens come from a numpy re-implementation over the unbiased run's returned
logprobs (top 20 per step): the biased greedy token is argmax(logprob + bias) over them.
"""

from __future__ import annotations

import numpy as np

from jaxserve import SamplingParams
from jaxserve.llm import LLM

PROMPT = "Once upon a time"


def test_plus_100_forces_a_token_greedy_or_sampled(stories_engine):
    llm = LLM(engine=stories_engine)
    forced = 300
    plain, greedy, sampled = llm.generate(
        [PROMPT] * 3,
        [
            SamplingParams(max_tokens=8, temperature=0.0),
            SamplingParams(max_tokens=8, temperature=0.0, logit_bias={forced: 100.0}),
            SamplingParams(max_tokens=8, temperature=1.0, seed=3, logit_bias={forced: 100.0}),
        ],
    )
    assert forced not in plain.token_ids  # the bias, not the model, chose it
    assert greedy.token_ids == [forced] * 8
    assert sampled.token_ids == [forced] * 8


def test_bias_moves_greedy_as_numpy_says_and_leaves_other_rows_alone(stories_engine):
    llm = LLM(engine=stories_engine)
    compiles = stories_engine.runner.num_compiles
    [plain] = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, logprobs=20))
    top = plain.logprobs[0].top  # [(token id, logprob)] most likely first
    # Ban the two most likely tokens and favour the fifth a little.
    bias = {top[0][0]: -100.0, top[1][0]: -100.0, top[4][0]: 1.5}
    ids = np.array([t for t, _ in top])
    logprobs = np.array([lp for _, lp in top]) + np.array([bias.get(int(t), 0.0) for t in ids])
    want = int(ids[np.argmax(logprobs)])
    assert want != top[0][0]
    biased, unbiased = llm.generate(
        [PROMPT, PROMPT],
        [
            SamplingParams(max_tokens=1, temperature=0.0, logit_bias=bias),
            SamplingParams(max_tokens=1, temperature=0.0),
        ],
    )
    assert biased.token_ids == [want]
    assert unbiased.token_ids == [top[0][0]]  # same batch, its own row unbiased
    assert stories_engine.runner.num_compiles == compiles  # per-row arrays: no retrace


def test_min_tokens_masks_eos_until_reached(stories_engine):
    llm = LLM(engine=stories_engine)
    [free] = llm.generate([PROMPT], SamplingParams(max_tokens=400, temperature=0.0))
    assert free.finish_reason == "stop"  # the story ends with EOS after n tokens
    n = len(free.token_ids)
    eos = set(stories_engine.model.config.eos_token_ids)
    assert free.token_ids[-1] in eos
    [held] = llm.generate(
        [PROMPT], SamplingParams(max_tokens=400, temperature=0.0, min_tokens=n + 10)
    )
    assert len(held.token_ids) >= n + 10
    assert held.token_ids[: n - 1] == free.token_ids[: n - 1]  # unchanged before the EOS
    assert not eos & set(held.token_ids[: n + 10])
