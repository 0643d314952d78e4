"""A packed projection inside a step leaves the bucket's padding rows out (llama._dense)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.llama import _dense
from jaxserve.models.step_batch import SeqChunk, pack_chunks, real_tokens
from pallas_kernels.ragged_paged_attention import cpu_ffi

BUCKET = dict(page_size=16, num_tokens=64, num_seqs=4, pages_per_seq=4, num_pages=16)


class _Projection(nn.Module):
    """One packed projection of 128 outputs, built as a llama layer builds its own."""

    @nn.compact
    def __call__(self, x, batch):  # x: f32[T, in] -> f32[T, 128]
        return _dense(128, False, jnp.float32, "p", packed=True, batch=batch)(x)


def _batch(lengths: list[int]):
    """A device StepBatch of the 64-token bucket holding one sequence per length."""
    chunks = [
        SeqChunk(list(range(1, n + 1)), 0, [4 * s + p for p in range(4)])
        for s, n in enumerate(lengths)
    ]
    return jax.tree.map(jnp.asarray, pack_chunks(chunks, **BUCKET))


@pytest.mark.parametrize("lengths", [[1], [5, 1, 1], [17, 30], [40, 8, 8, 8]])
def test_the_real_token_count_is_the_chunks_tokens_not_the_bucket(lengths):
    assert int(real_tokens(_batch(lengths))) == sum(lengths)


@pytest.mark.skipif(not cpu_ffi.packed_matmul_available(), reason="no packed matmul on this CPU")
@pytest.mark.parametrize("lengths", [[1], [5, 1, 1], [40, 8, 8, 8]])
def test_a_packed_projection_computes_the_real_rows_alone(lengths):
    """Real rows equal the unpacked projection's; the padding rows come back 0 (nothing ran)."""
    batch = _batch(lengths)
    real = sum(lengths)
    rng = np.random.default_rng(len(lengths))
    x = jnp.asarray(rng.standard_normal((BUCKET["num_tokens"], 96)), jnp.float32)  # f32[T, in]
    kernel = rng.standard_normal((96, 128)).astype(np.float32)  # f32[in, out]
    params = {"params": {"p": {"kernel": cpu_ffi.pack_weight(jnp.asarray(kernel))}}}
    got = np.asarray(jax.jit(_Projection().apply)(params, x, batch))
    np.testing.assert_allclose(got[:real], np.asarray(x)[:real] @ kernel, rtol=1e-5, atol=1e-4)
    assert not np.any(got[real:])
