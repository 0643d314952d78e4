"""The LM head run for a tier of rows (`logits_of_rows`) against the head over every row."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import NAMED_SHAPES
from jaxserve.models.llama import head_tiers, logits_of_rows
from jaxserve.models.loaded import abstract_params, model_for, pack_params
from pallas_kernels.ragged_paged_attention import cpu_ffi


def test_tiers_are_powers_of_two_from_eight_up_to_the_rows():
    assert head_tiers(1) == (1,)
    assert head_tiers(8) == (8,)
    assert head_tiers(16) == (8, 16)
    assert head_tiers(64) == (8, 16, 32, 64)
    assert head_tiers(48) == (8, 16, 32, 48)


@pytest.fixture(scope="module")
def head():
    """llama-tiny's real LM head (untied) as a function of hidden states, and the hidden size."""
    config = NAMED_SHAPES["llama-tiny"]
    module = model_for(config, jnp.float32)
    # Weights drawn by numpy: the head reads only its own, and no draw needs compiling.
    rng = np.random.default_rng(3)
    params = jax.tree.map(
        lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype),
        abstract_params(config, jnp.float32, "auto"),
    )

    def logits_of(h):
        return module.apply({"params": params}, h, method=module.logits)

    # Jitted once for every case below: the tier is chosen on the device, not by retracing.
    tiered = jax.jit(lambda h, r, n: logits_of_rows(logits_of, h, r, n))
    return logits_of, tiered, config.hidden_size


@pytest.mark.parametrize("num_rows", [0, 1, 8, 9, 16, 17, 31, 32, 33, 40])
def test_real_rows_match_the_full_head_and_padding_rows_are_zero_or_full(head, num_rows):
    logits_of, tiered, hidden_size = head
    num_tokens, slots = 96, 40  # tiers 8, 16, 32, 40
    rng = np.random.default_rng(num_rows)
    hidden = jnp.asarray(rng.standard_normal((num_tokens, hidden_size)), jnp.float32)
    # Real rows first, pointing anywhere in the step; padding rows at token 0, as batch.py packs.
    rows = np.zeros(slots, np.int32)
    rows[:num_rows] = rng.choice(num_tokens, num_rows, replace=False)
    got = tiered(hidden, jnp.asarray(rows), jnp.int32(num_rows))
    want = jax.jit(logits_of)(hidden[rows])
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got[:num_rows], want[:num_rows], rtol=1e-5, atol=1e-5)
    # The tier that ran: the smallest of 8, 16, 32, 40 that holds the real rows.
    tier = next(t for t in (8, 16, 32, 40) if t >= num_rows)
    np.testing.assert_allclose(got[num_rows:tier], want[num_rows:tier], rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got[tier:]))


@pytest.mark.skipif(not cpu_ffi.packed_matmul_available(), reason="no packed matmul on this CPU")
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("num_rows", [0, 1, 9, 33, 40])
def test_a_packed_head_computes_the_real_rows_alone(tied, num_rows):
    """On packed weights the head leaves out every padding row (zeros), no tier above them."""
    config = dataclasses.replace(NAMED_SHAPES["llama-tiny"], tie_word_embeddings=tied)
    canonical = model_for(config, jnp.float32)
    packed = model_for(config, jnp.float32, packed_weights=True)
    assert packed.head_skips_padding() and not canonical.head_skips_padding()
    rng = np.random.default_rng(5)
    params = jax.tree.map(
        lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype),
        abstract_params(config, jnp.float32, "auto"),
    )
    packed_params = pack_params(params, config, jnp.float32)
    hidden = jnp.asarray(rng.standard_normal((96, config.hidden_size)), jnp.float32)
    rows = np.zeros(40, np.int32)
    rows[:num_rows] = rng.choice(96, num_rows, replace=False)

    def logits_of(h, valid=None):
        return packed.apply({"params": packed_params}, h, valid, method=packed.logits)

    got = jax.jit(lambda h, r, n: logits_of_rows(logits_of, h, r, n, skips_padding=True))(
        hidden, jnp.asarray(rows), jnp.int32(num_rows)
    )
    want = canonical.apply({"params": params}, hidden[rows], method=canonical.logits)
    np.testing.assert_allclose(got[:num_rows], want[:num_rows], rtol=1e-5, atol=1e-4)
    assert not np.any(np.asarray(got[num_rows:]))
