"""The blocked jnp attention (the CPU's production path) against the dense reference."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import xla_blocked
from tests.kernels.test_ragged_paged_attention import CASES, assert_matches_reference


@pytest.mark.parametrize("block_tokens", [8, 256], ids=["many_blocks", "one_block"])
@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_blocked_matches_reference(case: str, block_tokens: int, monkeypatch):
    """Small blocks make the online softmax cross several blocks; NaN pools catch stray reads."""
    monkeypatch.setattr(xla_blocked, "_BLOCK_TOKENS", block_tokens)

    def blocked(*args, block_sizes=None, **kwargs):
        return xla_blocked.ragged_paged_attention(*args, **kwargs)

    assert_matches_reference(blocked, CASES[case], None)


def test_loop_runs_only_over_the_real_context(monkeypatch):
    """Blocks past the longest kv_len are never read: poison them and the result is unchanged."""
    import jax.numpy as jnp

    from tests.kernels.test_ragged_paged_attention import make_inputs

    monkeypatch.setattr(xla_blocked, "_BLOCK_TOKENS", 4)
    case = CASES["decode"]
    args = list(make_inputs(case))
    fn = functools.partial(xla_blocked.ragged_paged_attention, sm_scale=case.head_dim**-0.5)
    want = np.asarray(fn(*args), np.float32)
    # A wider page table (as a longer max_model_len gives) must not add iterations.
    calls = []
    real_loop = xla_blocked.jax.lax.fori_loop

    def counting_loop(lower, upper, body, init):
        calls.append(upper)
        return real_loop(lower, upper, body, init)

    monkeypatch.setattr(xla_blocked.jax.lax, "fori_loop", counting_loop)
    args[6] = jnp.pad(args[6], ((0, 0), (0, 32)))  # 32 more pages of table width
    got = np.asarray(fn(*args), np.float32)
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert int(calls[-1]) == -(-16 // 4)  # longest kv_len 16, blocks of 4 keys
