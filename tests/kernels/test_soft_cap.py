"""Attention-logit soft-capping (Gemma 2: scaled scores -> cap * tanh(scores / cap) before the
mask) in the tiled jnp path against the dense reference, and the reference against the formula
written out: decode rows, prefill chunks across key blocks and a window, with the native CPU
calls, which have no cap, never taken for a capped call."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import common, reference, xla_blocked
from tests.kernels.test_ragged_paged_attention import make_inputs
from tests.kernels.test_xla_blocked import RAGGED

CAP = 0.7  # far below the scaled scores of these inputs, so an uncapped score shows


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(xla_blocked, "_TILE_ROWS", 4)
    monkeypatch.setattr(xla_blocked, "_TILE_KEYS", 8)
    monkeypatch.setattr(xla_blocked, "_DECODE_KEYS", 8)
    monkeypatch.setattr(xla_blocked, "_DECODE_KEYS_ONE_SEQ", 12)


@pytest.mark.parametrize("name", ["gqa2", "window"])
def test_tiled_soft_cap_matches_reference(name, small_tiles):
    case = RAGGED[name]
    args = make_inputs(case)
    kwargs = dict(sm_scale=case.head_dim**-0.5, sliding_window=case.sliding_window)
    fn = functools.partial(xla_blocked.ragged_paged_attention, soft_cap=CAP, **kwargs)
    lowered = jax.jit(fn).lower(*args).as_text()
    assert "jaxserve_" not in lowered, "a capped call lowered to a native call without a cap"
    got = np.asarray(jax.jit(fn)(*args))
    want = np.asarray(reference.ragged_paged_attention(*args, soft_cap=CAP, **kwargs))
    uncapped = np.asarray(reference.ragged_paged_attention(*args, **kwargs))
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    assert np.max(np.abs(want - uncapped)) > 1e-2, "the cap changed nothing: a weak test"


def test_reference_soft_cap_is_tanh_of_the_scaled_scores():
    """One sequence of 5 tokens, one head: the reference's capped attention written out."""
    rng = np.random.default_rng(0)
    t, d = 5, 16
    q = rng.normal(size=(t, 1, d)).astype(np.float32)
    k = rng.normal(size=(t, 1, d)).astype(np.float32)
    v = rng.normal(size=(t, 1, d)).astype(np.float32)
    lanes = 2 * d
    pool = np.zeros((1, 2, 4, lanes), np.float32)
    rows = np.asarray(common.fuse_kv(jnp.asarray(k), jnp.asarray(v), lanes, 1))
    pool[0, 0, :4], pool[0, 1, :1] = rows[:4], rows[4:]
    out = reference.ragged_paged_attention(
        jnp.asarray(q),
        jnp.asarray(pool),
        jnp.int32(0),
        jnp.asarray([0, t], jnp.int32),
        jnp.asarray([t], jnp.int32),
        jnp.asarray([[0, 1]], jnp.int32),
        jnp.int32(1),
        sm_scale=d**-0.5,
        soft_cap=CAP,
    )
    s = (q[:, 0] @ k[:, 0].T) * d**-0.5
    s = CAP * np.tanh(s / CAP)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v[:, 0]
    np.testing.assert_allclose(np.asarray(out)[:, 0], want, atol=2e-6, rtol=2e-6)
