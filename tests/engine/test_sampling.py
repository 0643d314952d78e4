"""Device sampling: each filter keeps exactly the right tokens, draws follow the distribution,
and a row's draw does not depend on the rows around it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.sampling import SamplingBatch, _filter_top_k_top_p, sample

PROBS = np.array([0.05, 0.5, 0.15, 0.3], np.float32)  # sorted: 1 (0.5), 3 (0.3), 2 (.15), 0


def rows(n, **fields) -> SamplingBatch:
    sb = SamplingBatch.empty(n)
    arrays = {k: np.asarray(v, getattr(sb, k).dtype) for k, v in fields.items()}
    return dataclasses.replace(sb, **arrays)


@pytest.mark.parametrize(
    ("top_k", "top_p", "kept"),
    [
        (0, 1.0, {0, 1, 2, 3}),
        (1, 1.0, {1}),
        (3, 1.0, {1, 2, 3}),
        (0, 0.5, {1}),  # 0.5 alone reaches 0.5
        (0, 0.7, {1, 3}),  # 0.5 < 0.7 <= 0.8
        (0, 0.95, {1, 2, 3}),
        (2, 0.95, {1, 3}),  # top-k first, then the nucleus of what is left
    ],
)
def test_filters_keep_exactly_the_expected_tokens(top_k, top_p, kept):
    logits = jnp.log(jnp.asarray(PROBS))[None, :]
    out = _filter_top_k_top_p(logits, jnp.array([top_k]), jnp.array([top_p], jnp.float32))
    assert set(np.flatnonzero(np.isfinite(np.asarray(out[0])))) == kept


def test_draws_follow_the_filtered_distribution():
    n = 4000
    logits = jnp.log(jnp.tile(jnp.asarray(PROBS), (n, 1)))
    params = rows(
        n, temperature=np.ones(n), top_p=np.full(n, 0.7), seeds=np.arange(n), positions=np.zeros(n)
    )
    counts = np.bincount(np.asarray(jax.jit(sample)(logits, params).token_ids), minlength=4)
    np.testing.assert_allclose(counts / n, [0, 0.625, 0, 0.375], atol=0.03)
    params = dataclasses.replace(
        params, top_p=np.ones(n, np.float32), min_p=np.full(n, 0.2, np.float32)
    )  # drops 0.05 < 0.2 * 0.5
    counts = np.bincount(np.asarray(jax.jit(sample)(logits, params).token_ids), minlength=4)
    np.testing.assert_allclose(counts / n, [0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95], atol=0.03)


def test_greedy_rows_take_the_argmax_and_report_logprobs():
    logits = jax.random.normal(jax.random.key(0), (3, 50))
    out = jax.jit(sample)(logits, rows(3, want_top_logprobs=True))
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits, axis=-1))
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_allclose(out.logprobs, np.max(log_probs, axis=-1), rtol=1e-6)
    np.testing.assert_array_equal(out.top_ids[:, 0], out.token_ids)


def test_a_rows_draw_depends_only_on_its_seed_and_position():
    logits = jax.random.normal(jax.random.key(1), (8, 300))
    base = rows(
        8,
        temperature=np.ones(8),
        top_k=np.full(8, 50),
        seeds=np.arange(8) + 7,
        positions=np.arange(8) * 3,
    )
    together = np.asarray(jax.jit(sample)(logits, base).token_ids)
    # The same row alone, or beside greedy rows with other logits, draws the same token.
    for r in range(8):
        alone = jax.tree.map(lambda a, r=r: np.asarray(a)[r : r + 1] if np.ndim(a) else a, base)
        got = jax.jit(sample)(logits[r : r + 1], alone).token_ids[0]
        assert int(got) == together[r]
    shuffled_logits = logits.at[0].set(-logits[0])
    mixed = dataclasses.replace(base, temperature=np.array([0] + [1] * 7, np.float32))
    out = np.asarray(jax.jit(sample)(shuffled_logits, mixed).token_ids)
    np.testing.assert_array_equal(out[1:], together[1:])
    other_position = dataclasses.replace(base, positions=np.arange(8) * 3 + 1)
    assert (np.asarray(jax.jit(sample)(logits, other_position).token_ids) != together).any()
