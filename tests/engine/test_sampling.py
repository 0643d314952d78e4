"""Device sampling: each filter keeps exactly the right tokens (among the candidates, and over the
whole vocabulary when the kept set reaches past them), draws follow the distribution, and a row's
draw does not depend on the rows around it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime.sampling import (
    NUM_CANDIDATES,
    SamplingBatch,
    _inverse_cdf,
    candidate_filter,
    full_vocab_threshold,
    sample,
)

PROBS = np.array([0.05, 0.5, 0.15, 0.3], np.float32)  # sorted: 1 (0.5), 3 (0.3), 2 (.15), 0
VOCAB = 1000  # > NUM_CANDIDATES and not a multiple of the CDF block: the padded two-level path
N_DRAWS = 3000  # rows of one batch, one draw each: loose bounds, seeded so they cannot flake
sample_jit = jax.jit(sample)


def rows(n, **fields) -> SamplingBatch:
    sb = SamplingBatch.empty(n)
    arrays = {k: np.asarray(v, getattr(sb, k).dtype) for k, v in fields.items()}
    return dataclasses.replace(sb, **arrays)


def reference_keep(scaled: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """bool[V]: top-k, then the top-p nucleus of what is left, then min-p, in float64 by sorting."""
    scaled = scaled.astype(np.float64)
    keep = np.ones(scaled.shape, bool)
    if top_k > 0:
        keep &= scaled >= np.sort(scaled)[::-1][top_k - 1]
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    if top_p < 1:
        ordered = np.sort(probs)[::-1]
        last = np.searchsorted(np.cumsum(ordered), top_p)  # first prefix reaching top_p
        keep &= probs >= ordered[min(last, len(ordered) - 1)]
    if min_p > 0:
        keep &= scaled >= scaled.max() + np.log(min_p)
    return keep


def test_pure_top_k_and_top_p_on_a_worked_example():
    # probs 0.5, 0.3, 0.15, 0.05 (ids 1, 3, 2, 0); top-k 2 keeps {1, 3}; top-p 0.7 also keeps
    # {1, 3} (0.5 < 0.7 <= 0.8); top-p 0.5 keeps {1} alone; min-p 0.2 drops 0 (0.05 < 0.1).
    logits = np.log(PROBS)
    for top_k, top_p, min_p, kept in [
        (2, 1.0, 0.0, {1, 3}),
        (0, 0.7, 0.0, {1, 3}),
        (0, 0.5, 0.0, {1}),
        (0, 1.0, 0.2, {1, 2, 3}),
        (3, 0.9, 0.0, {1, 2, 3}),  # renormalised over the top 3: 0.5/.95 + 0.3/.95 = 0.84 < 0.9
    ]:
        assert set(np.flatnonzero(reference_keep(logits, top_k, top_p, min_p))) == kept
        params = rows(1, top_k=[top_k], top_p=[top_p], min_p=[min_p])
        values, ids = jax.lax.top_k(jnp.asarray(logits)[None], 4)
        total = jnp.sum(jnp.exp(values - values[:, :1]), axis=-1)  # the candidates are all
        keep, exact = candidate_filter(values, total, params)
        assert set(np.asarray(ids[0])[np.asarray(keep[0])]) == kept and bool(exact[0])


def _mixed_logits(num_rows: int) -> np.ndarray:
    """Rows from peaked (a few tokens hold the mass) to flat (the nucleus is hundreds wide)."""
    rng = np.random.default_rng(0)
    scales = np.linspace(6.0, 0.3, num_rows)[:, None]
    return (rng.standard_normal((num_rows, VOCAB)) * scales).astype(np.float32)


FILTERS = [  # (top_k, top_p, min_p, whether every row is exact among the candidates)
    (1, 1.0, 0.0, True),
    (7, 1.0, 0.0, True),
    (NUM_CANDIDATES, 1.0, 0.0, True),
    (40, 0.8, 0.0, True),
    (5, 1.0, 0.3, True),
    (0, 0.9, 0.0, None),  # peaked rows fit, flat rows do not
    (0, 1.0, 0.05, None),
    (NUM_CANDIDATES + 72, 1.0, 0.0, False),
]


@pytest.mark.parametrize(("top_k", "top_p", "min_p", "all_exact"), FILTERS)
def test_candidate_filter_matches_the_sorted_reference_where_it_claims_exactness(
    top_k, top_p, min_p, all_exact
):
    logits = _mixed_logits(8)
    n = len(logits)
    params = rows(n, top_k=[top_k] * n, top_p=[top_p] * n, min_p=[min_p] * n)
    values, ids = jax.lax.top_k(jnp.asarray(logits), NUM_CANDIDATES)
    total = jnp.sum(jnp.exp(logits - values[:, :1]), axis=-1)
    keep, exact = (np.asarray(a) for a in candidate_filter(values, total, params))
    ids = np.asarray(ids)
    if all_exact is not None:
        assert exact.all() == all_exact and exact.any() == all_exact
    else:
        assert exact[0] and not exact[-1]  # the peaked row fits, the flat one does not
    for r in range(n):
        want = reference_keep(logits[r], top_k, top_p, min_p)
        if exact[r]:
            assert not want[np.setdiff1d(np.arange(VOCAB), ids[r])].any()
            np.testing.assert_array_equal(keep[r], want[ids[r]])
        else:
            # Not exact: some kept token lies past the candidates, so all of them are kept.
            assert want[np.setdiff1d(np.arange(VOCAB), ids[r])].any()


@pytest.mark.parametrize(("top_k", "top_p"), [(7, 1.0), (200, 1.0), (0, 0.9), (300, 0.6)])
def test_full_vocab_threshold_keeps_the_reference_set(top_k, top_p):
    logits = _mixed_logits(8)
    n = len(logits)
    threshold = jax.jit(full_vocab_threshold)(
        logits, jnp.full(n, top_k, jnp.int32), jnp.full(n, top_p, jnp.float32)
    )
    kept = logits >= np.asarray(threshold)[:, None]
    for r in range(n):
        np.testing.assert_array_equal(kept[r], reference_keep(logits[r], top_k, top_p, 0.0))


def test_inverse_cdf_never_picks_a_token_without_mass():
    mass = jnp.array([[0.0, 2.0, 0.0, 1.0, 0.0]] * 5, jnp.float32)
    u = jnp.array([0.0, 0.5, 0.66, 0.9999999, 1.0], jnp.float32)  # 1.0: rounding past the end
    np.testing.assert_array_equal(_inverse_cdf(mass, u), [1, 1, 1, 3, 3])


def test_draws_follow_the_filtered_distribution_on_a_tiny_vocab():
    n = N_DRAWS
    logits = jnp.log(jnp.tile(jnp.asarray(PROBS), (n, 1)))
    params = rows(
        n, temperature=np.ones(n), top_p=np.full(n, 0.7), seeds=np.arange(n), positions=np.zeros(n)
    )
    counts = np.bincount(np.asarray(sample_jit(logits, params).token_ids), minlength=4)
    np.testing.assert_allclose(counts / n, [0, 0.625, 0, 0.375], atol=0.03)
    params = dataclasses.replace(
        params, top_p=np.ones(n, np.float32), min_p=np.full(n, 0.2, np.float32)
    )  # drops 0.05 < 0.2 * 0.5
    counts = np.bincount(np.asarray(sample_jit(logits, params).token_ids), minlength=4)
    np.testing.assert_allclose(counts / n, [0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95], atol=0.03)


def test_plain_temperature_draws_reach_every_block_of_the_vocabulary():
    # Three tokens in different blocks hold 0.3, 0.3 and 0.2 of the mass; 997 others share 0.2.
    n = N_DRAWS
    probs = np.full(VOCAB, 0.2 / (VOCAB - 3))
    probs[[5, 500, VOCAB - 1]] = 0.3, 0.3, 0.2
    logits = jnp.tile(jnp.log(jnp.asarray(probs, jnp.float32)), (n, 1))
    params = rows(n, temperature=np.ones(n), seeds=np.arange(n), positions=np.arange(n))
    tokens = np.asarray(sample_jit(logits, params).token_ids)
    assert tokens.min() >= 0 and tokens.max() < VOCAB
    shares = [np.mean(tokens == t) for t in (5, 500, VOCAB - 1)]
    np.testing.assert_allclose([*shares, 1 - sum(shares)], [0.3, 0.3, 0.2, 0.2], atol=0.03)


def test_a_nucleus_wider_than_the_candidates_is_drawn_exactly():
    # A flat row: the 0.9-nucleus holds ~850 tokens, far past the candidates, so the draw takes
    # the full-vocabulary fallback; it must stay inside the nucleus and reach its tail.
    n = N_DRAWS
    row = _mixed_logits(8)[-1]
    want = reference_keep(row, 0, 0.9, 0.0)
    assert want.sum() > 2 * NUM_CANDIDATES
    logits = jnp.tile(jnp.asarray(row), (n, 1))
    params = rows(
        n, temperature=np.ones(n), top_p=np.full(n, 0.9), seeds=np.arange(n), positions=np.zeros(n)
    )
    tokens = np.asarray(sample_jit(logits, params).token_ids)
    assert want[tokens].all()
    top = np.argsort(-row)[:NUM_CANDIDATES]
    probs = np.where(want, np.exp(row - row.max()), 0.0)
    probs /= probs.sum()
    # The share drawn among the top candidates matches their share of the nucleus (~0.3 here).
    np.testing.assert_allclose(np.isin(tokens, top).mean(), probs[top].sum(), atol=0.04)


def test_greedy_rows_take_the_argmax_and_report_logprobs_when_asked():
    logits = jax.random.normal(jax.random.key(0), (8, VOCAB))  # the shapes other tests compile
    log_probs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    out = sample_jit(logits, rows(8, want_top_logprobs=True))
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits, axis=-1))
    np.testing.assert_allclose(out.logprobs, log_probs.max(axis=-1), rtol=1e-5)
    np.testing.assert_array_equal(out.top_ids[:, 0], out.token_ids)
    np.testing.assert_allclose(
        out.top_logprobs, -np.sort(-log_probs, axis=-1)[:, :20], rtol=1e-5, atol=1e-6
    )
    only_chosen = sample_jit(logits, rows(8, want_logprobs=True))
    np.testing.assert_allclose(only_chosen.logprobs, log_probs.max(axis=-1), rtol=1e-5)
    assert not np.asarray(only_chosen.top_ids).any()
    nothing = sample_jit(logits, rows(8))
    np.testing.assert_array_equal(nothing.token_ids, np.argmax(logits, axis=-1))
    assert not np.asarray(nothing.logprobs).any()


def test_a_sampled_row_reports_the_logprob_of_the_token_it_drew():
    logits = jax.random.normal(jax.random.key(2), (8, VOCAB)) * 3
    params = rows(8, temperature=np.full(8, 0.7), top_k=[0, 20, 0, 0] * 2, top_p=[1, 1, 0.8, 1] * 2)
    out = sample_jit(logits, dataclasses.replace(params, want_logprobs=np.bool_(True)))
    log_probs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    want = log_probs[np.arange(8), np.asarray(out.token_ids)]
    np.testing.assert_allclose(out.logprobs, want, rtol=1e-5)


def test_a_rows_draw_depends_only_on_its_seed_and_position():
    logits = jax.random.normal(jax.random.key(1), (8, VOCAB)) * 2
    base = rows(
        8,
        temperature=np.ones(8),
        top_k=[50, 50, 0, 0, 5, 0, 300, 50],
        top_p=[1, 0.9, 0.9, 1, 1, 0.5, 1, 1],
        min_p=[0, 0, 0, 0, 0, 0.1, 0, 0],
        seeds=np.arange(8) + 7,
        positions=np.arange(8) * 3,
    )
    together = np.asarray(sample_jit(logits, base).token_ids)
    # The same row alone, or beside greedy rows with other logits, draws the same token: whether
    # the batch takes the candidate path, the whole-vocabulary one or both must not matter.
    for r in range(8):
        alone = jax.tree.map(lambda a, r=r: np.asarray(a)[r : r + 1] if np.ndim(a) else a, base)
        assert int(sample_jit(logits[r : r + 1], alone).token_ids[0]) == together[r]
    shuffled_logits = logits.at[0].set(-logits[0])
    mixed = dataclasses.replace(base, temperature=np.array([0] + [1] * 7, np.float32))
    out = np.asarray(sample_jit(shuffled_logits, mixed).token_ids)
    np.testing.assert_array_equal(out[1:], together[1:])
    other_position = dataclasses.replace(base, positions=np.arange(8) * 3 + 1)
    assert (np.asarray(sample_jit(logits, other_position).token_ids) != together).any()


def test_processed_rows_report_the_distribution_they_draw_from():
    # Rows 0-3 ask for processed logprobs (tempered, filtered), rows 4-7 the same settings raw.
    logits = jax.random.normal(jax.random.key(3), (8, VOCAB)) * 3
    temperature = [0.7, 0.5, 1.3, 0.0] * 2
    top_k = [5, 0, 0, 3] * 2
    top_p = [1.0, 0.6, 1.0, 1.0] * 2
    min_p = [0.0, 0.0, 0.05, 0.0] * 2
    params = rows(
        8,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seeds=np.arange(8) + 1,
        processed_logprobs=[True] * 4 + [False] * 4,
        want_logprobs=True,
        want_top_logprobs=True,
    )
    out = sample_jit(logits, params)
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)
    tokens = np.asarray(out.token_ids)
    for r in range(4):
        scaled = np.asarray(logits[r], np.float64) / (temperature[r] or 1.0)
        keep = reference_keep(scaled, top_k[r], top_p[r], min_p[r])
        masked = np.where(keep, scaled, -np.inf)
        want = masked - np.log(np.exp(masked - masked.max()).sum()) - masked.max()
        assert keep[tokens[r]], f"row {r} drew token {tokens[r]} outside its kept set"
        np.testing.assert_allclose(out.logprobs[r], want[tokens[r]], rtol=1e-4, atol=1e-5)
        n_kept = int(keep.sum())
        top = np.asarray(out.top_logprobs[r])[: min(n_kept, 20)]
        np.testing.assert_allclose(top, np.sort(want[keep])[::-1][:20], rtol=1e-4, atol=1e-5)
        assert np.isneginf(np.asarray(out.top_logprobs[r])[n_kept:]).all()
        if n_kept <= 20:  # the whole kept set is listed: its probabilities sum to one
            np.testing.assert_allclose(np.exp(top).sum(), 1.0, rtol=1e-4)
    for r in range(4, 8):  # the raw rows beside them are the model's untempered log-softmax
        np.testing.assert_allclose(out.logprobs[r], raw[r, tokens[r]], rtol=1e-5)
        np.testing.assert_allclose(
            out.top_logprobs[r], np.sort(raw[r])[::-1][:20], rtol=1e-5, atol=1e-6
        )
    # The draws themselves do not depend on the mode.
    as_raw = sample_jit(logits, dataclasses.replace(params, processed_logprobs=np.zeros(8, bool)))
    np.testing.assert_array_equal(as_raw.token_ids, tokens)


def test_argmax_rows_matches_argmax_on_ties_infinities_and_nans():
    from jaxserve.runtime.sampling import argmax_rows

    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, size=(40, 333)).astype(np.float32)  # many tied maxima per row
    x[1] = -np.inf  # every token masked: argmax says 0
    x[2, 7] = np.inf
    x[3, [5, 9]] = np.nan  # the first NaN wins, as in argmax
    x[4, 0] = np.nan
    x[5, -1] = 10.0  # the maximum in the last column
    x[6] = -1.0
    x[6, [4, 8]] = [-0.0, 0.0]  # -0.0 ties with 0.0: the first wins
    x[7] = -np.inf
    x[7, 11] = -1e30  # negative keys order by magnitude
    x[7, 12] = -2e30
    got = np.asarray(jax.jit(argmax_rows)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert got.dtype == np.int32 and list(got[1:8]) == [0, 7, 5, 0, 332, 4, 11]
