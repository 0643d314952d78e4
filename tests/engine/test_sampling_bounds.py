"""Sampling values the device cannot take are refused through the library too, and the engine
serves on; the extreme values that are accepted sample soundly on the device.

Before the bounds, `SamplingParams(top_k=2**31)` (or a logit bias or min_tokens stop id past
int32) passed `LLM.generate` and raised OverflowError inside the engine's step, which left the
engine unable to step again; a temperature or repetition penalty that float32 reads as 0 or inf
ran with NaN logits; a length penalty of 1000 overflowed the beam ranking.
"""

from __future__ import annotations

import re

import pytest

from jaxserve.engine.llm import LLM
from jaxserve.sampling_params import (
    MAX_ABS_LENGTH_PENALTY,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    SamplingParams,
)

PROMPT = "Once upon a time"


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(top_k=2**31), "top_k=2147483648 must be an integer in"),
        (dict(temperature=1e300), "temperature=1e+300 must be 0 (greedy) or a number in"),
        (dict(temperature=1e-300), "temperature=1e-300 must be 0 (greedy) or a number in"),
        (dict(repetition_penalty=1e-300), "repetition_penalty=1e-300 must be a number in"),
        (dict(logit_bias={2**40: 1.0}), "logit_bias token 1099511627776 must be a token id"),
        (dict(stop_token_ids=[2**40], min_tokens=2), "must hold token ids"),
    ],
)
def test_values_past_the_device_are_refused_and_the_engine_serves_on(
    stories_engine, fields, message
):
    llm = LLM(engine=stories_engine)
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, **fields))
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0))
    assert len(out.token_ids) == 4
    assert not stories_engine.has_unfinished()


def test_ids_past_the_vocabulary_are_refused_by_the_engine(stories_engine):
    """SamplingParams cannot know the model; the engine does: a bias past the vocabulary was
    dropped on the device without a word."""
    llm = LLM(engine=stories_engine)
    vocab = stories_engine.model.config.vocab_size
    for fields, name in (
        (dict(logit_bias={vocab + 5: 5.0}), "logit_bias"),
        (dict(stop_token_ids=[vocab], min_tokens=1), "stop_token_ids"),
    ):
        want = rf"{name} token ids \[{vocab + 5 if name == 'logit_bias' else vocab}\] are outside"
        with pytest.raises(ValueError, match=want):
            llm.generate([PROMPT], SamplingParams(max_tokens=4, **fields))
    assert not stories_engine.has_unfinished()
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=2, logit_bias={vocab - 1: 100.0}))
    assert out.token_ids == [vocab - 1] * 2  # the last id of the vocabulary is fine


def test_the_extreme_accepted_temperatures_sample_soundly(stories_engine):
    """At the smallest temperature the draw is the argmax (1 / temperature keeps the logits
    finite in float32); at the largest, 16 seeds draw mostly different tokens (a flat
    distribution, not NaN's token 0 or the argmax every time)."""
    llm = LLM(engine=stories_engine)
    [greedy] = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    cold = llm.generate(
        [PROMPT] * 4,
        [
            SamplingParams(max_tokens=8, temperature=MIN_TEMPERATURE, seed=s, ignore_eos=True)
            for s in range(4)
        ],
    )
    assert all(c.token_ids == greedy.token_ids for c in cold)
    hot = llm.generate(
        [PROMPT] * 16,
        [SamplingParams(max_tokens=1, temperature=MAX_TEMPERATURE, seed=s) for s in range(16)],
    )
    firsts = [h.token_ids[0] for h in hot]
    vocab = stories_engine.model.config.vocab_size
    assert all(0 <= t < vocab for t in firsts)
    assert len(set(firsts)) >= 10, firsts  # 16 draws of 512 near-equal tokens rarely collide


def test_beam_search_at_the_length_penalty_bounds(stories_engine):
    """+-10 rank the beams without overflow; 1000 (OverflowError in the ranking before) is
    refused before the search starts."""
    llm = LLM(engine=stories_engine)
    for penalty in (MAX_ABS_LENGTH_PENALTY, -MAX_ABS_LENGTH_PENALTY):
        [beams] = llm.beam_search([PROMPT], beam_width=2, max_tokens=6, length_penalty=penalty)
        assert beams and all(b.score is not None and abs(b.score) < float("inf") for b in beams)
    with pytest.raises(ValueError, match=r"length_penalty=1000\.0 must be a number in"):
        llm.beam_search([PROMPT], beam_width=2, max_tokens=6, length_penalty=1000.0)
    assert not stories_engine.has_unfinished()
