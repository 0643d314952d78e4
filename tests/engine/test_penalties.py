"""logit_bias, min_tokens and the penalties, on the device per row, against what they must do on
stories260k.

The expected tokens come from a numpy re-implementation over an unbiased run's returned
logprobs (top 20 per step): the biased greedy token is argmax(logprob + bias) over them, the
penalized one argmax of the penalty formula (jaxserve/runtime/sampling.py) applied to them.
"""

from __future__ import annotations

import numpy as np

from jaxserve import SamplingParams
from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from tests.models.helpers import sequence_logits

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


def test_min_tokens_holds_back_a_forced_eos_for_exactly_that_many_tokens(stories_engine):
    """EOS forced by its logit bias: it comes as output token number min_tokens + 1, never one
    early (the mask must cover output positions 0 .. min_tokens - 1), greedy or sampled, and at
    once with min_tokens=0. A stop token id is held back the same way."""
    llm = LLM(engine=stories_engine)
    eos = stories_engine.model.config.eos_token_ids[0]
    stop = 300
    cases = [
        (min_tokens, temperature, bias_id)
        for min_tokens in (0, 1, 5)
        for temperature in (0.0, 1.0)
        for bias_id in (eos, stop)
    ]
    params = [
        SamplingParams(
            max_tokens=12,
            temperature=temperature,
            seed=11,
            min_tokens=min_tokens,
            logit_bias={bias_id: 100.0},
            stop_token_ids=(stop,),
        )
        for min_tokens, temperature, bias_id in cases
    ]
    outs = llm.generate([PROMPT] * len(cases), params)
    for (min_tokens, temperature, bias_id), out in zip(cases, outs, strict=True):
        case = f"min_tokens={min_tokens} temperature={temperature} forced={bias_id}"
        assert out.finish_reason == "stop", case
        assert len(out.token_ids) == min_tokens + 1, (case, out.token_ids)
        assert out.token_ids[-1] == bias_id, case
        assert not {eos, stop} & set(out.token_ids[:-1]), case


def _penalized(logits, counts, in_prompt, *, presence=0.0, frequency=0.0, repetition=1.0):
    """The penalty formula of jaxserve/runtime/sampling.py in numpy: logits f64[V], counts i64[V] of
    the generated tokens so far, in_prompt bool[V]."""
    seen = (counts > 0) | in_prompt
    out = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
    return out - frequency * counts - presence * (counts > 0)


def _check_against_numpy(engine, prompt, out, **penalties):
    """Each greedy token of `out` is the argmax of the formula over the model's own logits (a
    separate dense forward of prompt + outputs), and its returned logprob that of the
    penalized distribution."""
    logits = sequence_logits(engine.model, prompt + out.token_ids[:-1]).astype(np.float64)
    vocab = logits.shape[-1]
    counts = np.zeros(vocab, np.int64)
    in_prompt = np.zeros(vocab, bool)
    in_prompt[prompt] = True
    for i, token in enumerate(out.token_ids):
        want = _penalized(logits[len(prompt) - 1 + i], counts, in_prompt, **penalties)
        top2 = np.sort(want)[-2:]
        assert top2[1] - top2[0] > 1e-3, f"step {i}: a near tie, pick another prompt"
        assert token == int(np.argmax(want)), f"step {i}"
        logprob = want[token] - np.log(np.sum(np.exp(want - want.max()))) - want.max()
        assert abs(out.logprobs[i].logprob - logprob) < 1e-3, f"step {i}"
        counts[token] += 1


def test_frequency_and_presence_change_greedy_exactly_as_the_formula_says(stories_engine):
    llm = LLM(engine=stories_engine)
    prompt = stories_engine.encode(PROMPT)
    compiles = stories_engine.runner.num_compiles
    greedy = dict(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0)
    pen = dict(frequency=1.5, presence=0.5)
    plain, penalized = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(**greedy),
            SamplingParams(**greedy, frequency_penalty=1.5, presence_penalty=0.5),
        ],
    )
    assert penalized.token_ids != plain.token_ids  # the story repeats itself: the penalty bites
    _check_against_numpy(stories_engine, prompt, penalized, **pen)
    _check_against_numpy(stories_engine, prompt, plain)  # its neighbour row: no penalty at all
    assert stories_engine.runner.num_compiles == compiles  # per-row arrays: nothing recompiles


def test_repetition_penalty_counts_the_prompt_too(stories_engine):
    llm = LLM(engine=stories_engine)
    prompt = stories_engine.encode(PROMPT)
    greedy = dict(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0)
    [plain] = llm.generate([prompt], SamplingParams(**greedy))
    [penalized] = llm.generate([prompt], SamplingParams(**greedy, repetition_penalty=1.8))
    assert penalized.token_ids != plain.token_ids
    _check_against_numpy(stories_engine, prompt, penalized, repetition=1.8)


def test_repetition_penalty_at_its_bounds_is_the_formula(stories_engine):
    """0.1 and 10, the accepted extremes, still compute as the formula says (1e-300 was
    accepted before and is 0 in float32: every token came out as 0)."""
    llm = LLM(engine=stories_engine)
    prompt = stories_engine.encode(PROMPT)
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    for penalty in (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY):
        [out] = llm.generate([prompt], SamplingParams(**greedy, repetition_penalty=penalty))
        _check_against_numpy(stories_engine, prompt, out, repetition=penalty)


def test_a_preempted_request_resumes_with_its_counts(stories_engine):
    """Pages for ~2.5 of 4 long requests: preempted ones refill their slot's counts from their
    prompt and outputs so far, so the penalized tokens do not change."""
    tiny = dict(max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=8, seq_bucket_factor=4)
    short_of_pages = Engine(
        EngineConfig(num_pages=10, page_size=16, show_progress=False, **tiny),
        model=stories_engine.model,
    )
    prompts = ["Once upon a time", "Tom had a red ball", "The little dog", "A cat"]
    params = SamplingParams(
        max_tokens=60, temperature=0, ignore_eos=True, frequency_penalty=1.0, repetition_penalty=1.3
    )
    preempted = LLM(engine=short_of_pages).generate(prompts, params)
    assert short_of_pages.metrics.stats.num_preemptions > 0
    reference = LLM(engine=stories_engine).generate(prompts, params)
    assert [a.token_ids for a in preempted] == [b.token_ids for b in reference]
