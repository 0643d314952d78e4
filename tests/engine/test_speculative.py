"""Speculative decoding (n-gram proposals) on the device and through the engine: the verifier
on worked and sampled inputs, and engines with and without speculation side by side."""

from __future__ import annotations

import collections
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.runtime.sampling import SamplingBatch, sample, verify
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import SMALL

# Texts the embedded model's continuations repeat (its own loops), and one it does not.
REPETITIVE = [
    "Lily and Tom went to the park to play on the swings. " * 3,
    "Tom had a red ball",
    "He liked to play with his toys. He liked to play with his toys.",
    "The cat sat on the mat. The cat sat on the mat.",
]


def test_verify_keeps_the_longest_agreeing_prefix():
    # Two sequences over 6 tokens: row 0 runs [7, 1, 2, 3] (last token 7, proposals 1, 2, 3),
    # row 1 decodes one token; the extra rows 2-4 hold row 0's first three queries.
    token_ids = jnp.array([7, 1, 2, 3, 9, 0], jnp.int32)
    logits_indices = jnp.array([3, 4, 0, 1, 2, 0], jnp.int32)
    num_proposals = jnp.array([3, 0, 0, 0, 0, 0], jnp.int32)
    extra_start = jnp.array([2, 0, 0, 0, 0, 0], jnp.int32)
    # Samples: after 7 came 1 (= proposal 1), after 1 came 2 (= proposal 2), after 2 came 8
    # (proposal 3 was 3: rejected), so 2 accepted and the token after them is 8.
    sampled = jnp.array([5, 4, 1, 2, 8, 0], jnp.int32)
    accepted, after = verify(sampled, token_ids, logits_indices, num_proposals, extra_start)
    assert accepted[:2].tolist() == [2, 0]
    assert after[:2].tolist() == [8, 4]  # row 1: its own sample
    # All accepted: the token after them is the one row 0 sampled after its last proposal.
    sampled = sampled.at[4].set(3)
    accepted, after = verify(sampled, token_ids, logits_indices, num_proposals, extra_start)
    assert (int(accepted[0]), int(after[0])) == (3, 5)


def test_all_accepted_proposals_that_fill_every_sampling_row_keep_their_bonus_token():
    """The proposals' extra rows end at the last sampling row (no padding row after them): all
    accepted, the count is all of them and the token after them is the sequence's own sample
    (the bonus). Outputs cannot tell a lost bonus (the token it adds comes one step later
    instead), so the counts are what is checked."""
    # 4 rows, all used: row 0 runs [7, 1, 2] (proposals 1, 2), row 1 decodes 9, and rows 2-3
    # are row 0's extra rows (its first two queries). Tokens: 7 1 2 | 9.
    token_ids = jnp.array([7, 1, 2, 9], jnp.int32)
    logits_indices = jnp.array([2, 3, 0, 1], jnp.int32)
    num_proposals = jnp.array([2, 0, 0, 0], jnp.int32)
    extra_start = jnp.array([2, 0, 0, 0], jnp.int32)
    # After 7 came 1 (= proposal 1), after 1 came 2 (= proposal 2), after 2 came 8: both
    # accepted, and 8, sampled by row 0 itself after its last proposal, is the bonus.
    sampled = jnp.array([8, 4, 1, 2], jnp.int32)
    accepted, after = verify(sampled, token_ids, logits_indices, num_proposals, extra_start)
    assert accepted.tolist()[:2] == [2, 0]
    assert after.tolist()[:2] == [8, 4]
    # The last row disagrees (5, not 2): one accepted, and 5 is the token after it.
    accepted, after = verify(
        sampled.at[3].set(5), token_ids, logits_indices, num_proposals, extra_start
    )
    assert (int(accepted[0]), int(after[0])) == (1, 5)
    # One sequence, proposals filling every row after it: 3 proposals on 4 rows.
    accepted, after = verify(
        jnp.array([6, 1, 2, 3], jnp.int32),
        jnp.array([7, 1, 2, 3], jnp.int32),
        jnp.array([3, 0, 1, 2], jnp.int32),
        jnp.array([3, 0, 0, 0], jnp.int32),
        jnp.array([1, 0, 0, 0], jnp.int32),
    )
    assert (int(accepted[0]), int(after[0])) == (3, 6)


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square statistic a fair sample exceeds with probability ~0.001 (z = 3.09), by
    Wilson and Hilferty's cube-root normal approximation (no scipy needed)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_fit(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs`, cells expecting < 5 pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def test_sampled_verification_draws_from_the_target_and_a_biased_one_is_caught():
    """At temperature 0.8 over 6 tokens, 6000 seeded rows verify the proposal d = 2: the token
    at the first position is distributed as the target p (chi-square), d is accepted p(d) of
    the time; the usual mistake of resampling from p itself after a rejection fails the test."""
    logits = np.log(np.array([0.05, 0.10, 0.35, 0.30, 0.15, 0.05], np.float32))
    probs = np.exp(logits / 0.8) / np.exp(logits / 0.8).sum()
    n, d = 6000, 2
    rows = SamplingBatch.empty(n)
    rows = SamplingBatch(
        **{
            **rows.__dict__,
            "temperature": np.full(n, 0.8, np.float32),
            "seeds": np.arange(n, dtype=np.uint32),
            "positions": np.full(n, 11, np.int32),
        }
    )
    sampled = sample(jnp.tile(jnp.asarray(logits), (n, 1)), rows).token_ids
    # Each row is a sequence [last, d] whose first query's sample is `sampled`; the sequence's
    # own row (after d) is another draw, never reached when d is rejected.
    # Layout per pair of rows (2i: the sequence, 2i + 1: its extra row), 2n tokens.
    seq_rows = 2 * n
    token_ids = jnp.tile(jnp.array([0, d], jnp.int32), n)
    idx = jnp.arange(n, dtype=jnp.int32)
    logits_indices = jnp.zeros(seq_rows, jnp.int32).at[:n].set(2 * idx + 1).at[n:].set(2 * idx)
    num_proposals = jnp.zeros(seq_rows, jnp.int32).at[:n].set(1)
    extra_start = jnp.zeros(seq_rows, jnp.int32).at[:n].set(n + idx)
    all_sampled = jnp.concatenate([jnp.full(n, 5, jnp.int32), sampled])
    accepted, after = verify(all_sampled, token_ids, logits_indices, num_proposals, extra_start)
    accepted, after = np.asarray(accepted[:n]), np.asarray(after[:n])
    first = np.where(accepted == 1, d, after)  # the token the verification puts at position 1
    stat, df = chi2_fit(np.bincount(first, minlength=6), probs)
    assert stat < chi2_critical(df), (stat, df)
    # The acceptance rate is p(d), within 4 standard errors.
    assert abs(accepted.mean() - probs[d]) < 4 * math.sqrt(probs[d] * (1 - probs[d]) / n)
    # Biased: on a rejection, draw again from p (d included): d comes out too often.
    again = np.asarray(
        sample(
            jnp.tile(jnp.asarray(logits), (n, 1)),
            SamplingBatch(**{**rows.__dict__, "positions": np.full(n, 12, np.int32)}),
        ).token_ids
    )
    biased = np.where(accepted == 1, d, again)
    stat, df = chi2_fit(np.bincount(biased, minlength=6), probs)
    assert stat > chi2_critical(df), (stat, df)


@pytest.fixture(scope="module")
def spec_engine(stories_engine) -> Engine:
    """Speculation on, the shared engine's buckets, and pages for ~2 long requests: its steps
    verify proposals, chunk prompts, share prefixes and preempt. Steps are priced flat, so
    every proposal is verified: these tests are about exactness (the decision is
    tests/unit/test_speculation.py's)."""
    engine = Engine(
        EngineConfig(speculative="ngram", num_pages=14, page_size=16, **SMALL),
        model=stories_engine.model,
    )
    assert engine.scheduler.spec.step_cost is not None  # priced at warm-up
    engine.scheduler.set_step_cost(lambda spans: 1.0)
    return engine


def test_greedy_with_speculation_is_token_for_token_the_same(stories_engine, spec_engine):
    """Chunked prompts (64-token steps), shared prefixes (the prefix cache), preemptions (14
    pages), stop strings, logprobs: the same tokens, text and logprobs with and without."""
    shared = REPETITIVE[0]
    prompts = [*REPETITIVE, shared + "Then", shared + "Lily said", "Once upon a time"]
    params = [
        SamplingParams(max_tokens=60 + 7 * i, temperature=0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    params[1] = SamplingParams(max_tokens=80, temperature=0, stop=["his toys. He liked"])
    params[2] = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, logprobs=2)
    before = spec_engine.metrics.stats
    preemptions, hits = before.num_preemptions, before.prefix_cache_hits
    got = LLM(engine=spec_engine).generate(prompts, params)
    want = LLM(engine=stories_engine).generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert got[1].finish_reason == "stop" and len(got[1].token_ids) < 80
    # Of the same tokens; the values as close as a chunk's attention is to a decode's.
    assert [t.token_id for t in got[2].logprobs] == got[2].token_ids
    assert [t.logprob for t in got[2].logprobs] == pytest.approx(
        [t.logprob for t in want[2].logprobs], abs=1e-3
    )
    assert [t.top[0][0] for t in got[2].logprobs] == [t.top[0][0] for t in want[2].logprobs]
    stats = spec_engine.metrics.stats
    assert stats.num_preemptions > preemptions and stats.prefix_cache_hits > hits
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens
    assert sum(c.num_accepted_tokens for c in got) > 0
    prometheus = spec_engine.metrics.registry.get_sample_value
    assert prometheus("jaxserve_spec_accepted_tokens_total") == stats.spec_accepted_tokens
    assert prometheus("jaxserve_spec_acceptance_rate") == pytest.approx(
        stats.spec_accepted_tokens / stats.spec_proposed_tokens
    )
    assert spec_engine.scheduler.num_pages_used == 0
    assert stats.compiles_after_warmup == 0


def test_constrained_and_penalised_requests_run_without_proposals(stories_engine, spec_engine):
    """In one batch with a plain request that accepts proposals, a regex-constrained request
    and ones with a repetition penalty or a logit bias (whose per-row work covers one sampled
    row) are proposed nothing, and give the tokens they give without speculation."""
    prompt = REPETITIVE[2]
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, structured_output={"regex": "( [a-z]+)+[.]"}),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logit_bias={5: 1.0}),
    ]
    got = LLM(engine=spec_engine).generate([prompt] * 4, params)
    want = LLM(engine=stories_engine).generate([prompt] * 4, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert got[0].num_proposed_tokens > 0 and got[0].num_accepted_tokens > 0
    assert [(g.num_proposed_tokens, g.num_verifications) for g in got[1:]] == [(0, 0)] * 3


def test_sampling_with_speculation_keeps_the_distribution(stories_engine, spec_engine):
    """Temperature 0.8: seeded requests give the same tokens with speculation on and off, and
    over 240 requests per engine, with different seeds, each of the first 12 positions' token
    frequencies agree (two-sample chi-square at p ~0.001, rare tokens pooled). The prompt
    makes "sweet" likely but far from certain: proposals of it are often rejected."""
    prompt = "It was a sweet sweet sweet sweet sweet sweet sweet sweet sweet"
    n, length = 240, 12

    def run(engine, seeds):
        params = [
            SamplingParams(max_tokens=length, temperature=0.8, ignore_eos=True, seed=s)
            for s in seeds
        ]
        out = []
        for i in range(0, len(params), 8):  # 8 at a time: the load speculation is for
            out += LLM(engine=engine).generate([prompt] * 8, params[i : i + 8])
        return [c.token_ids for c in out]

    accepted = spec_engine.metrics.stats.spec_accepted_tokens
    proposed = spec_engine.metrics.stats.spec_proposed_tokens
    spec = run(spec_engine, range(n))
    assert spec[:16] == run(stories_engine, range(16))  # same seeds, same tokens
    plain = run(stories_engine, range(n, 2 * n))
    stats = spec_engine.metrics.stats
    assert stats.spec_proposed_tokens - proposed > 100
    assert 0 < stats.spec_accepted_tokens - accepted < stats.spec_proposed_tokens - proposed
    for pos in range(length):
        a = collections.Counter(s[pos] for s in spec)
        b = collections.Counter(s[pos] for s in plain)
        tokens = sorted(set(a) | set(b))
        table = np.array([[a[t] for t in tokens], [b[t] for t in tokens]], float)
        # Pool tokens seen fewer than 10 times in all into one column.
        rare = table.sum(0) < 10
        table = np.column_stack([table[:, ~rare], table[:, rare].sum(1)])
        table = table[:, table.sum(0) > 0]
        if table.shape[1] < 2:
            continue
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
        stat = float(((table - expected) ** 2 / expected).sum())
        assert stat < chi2_critical(table.shape[1] - 1), (pos, stat, table)
    assert spec_engine.metrics.stats.compiles_after_warmup == 0
