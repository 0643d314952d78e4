"""Placeholder until branch issue42-gmm lands: ragged_dot with a group offset."""

import jax
import jax.numpy as jnp


def grouped_matmul(lhs, rhs, group_sizes, group_offset=None, *, precision=None):
    local = rhs.shape[0]
    if group_offset is None:
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision)
    start = jnp.sum(jnp.where(jnp.arange(group_sizes.shape[0]) < group_offset, group_sizes, 0))
    sizes = jax.lax.dynamic_slice(group_sizes, (group_offset,), (local,))
    out = jax.lax.ragged_dot(jnp.roll(lhs, -start, axis=0), rhs, sizes, precision=precision)
    return jnp.roll(out, start, axis=0)
