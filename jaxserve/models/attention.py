"""Attention backends behind one signature, and the write of new keys and values into the pool."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from pallas_kernels.ragged_paged_attention import reference

ATTENTION_BACKENDS = ("reference",)

AttentionFn = Callable[..., jax.Array]


def get_attention_fn(backend: str) -> AttentionFn:
    """The ragged paged attention function of `backend` (see pallas_kernels for the signature)."""
    if backend == "reference":
        return reference.ragged_paged_attention
    raise ValueError(f"attention_backend={backend!r} is not one of {ATTENTION_BACKENDS}.")


@functools.partial(jax.named_call, name="write_kv")
def write_kv(
    k_pool: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_pool: jax.Array,  # same as k_pool
    layer: jax.Array,  # i32[]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[T] page * page_size + offset; out of range for padding
) -> tuple[jax.Array, jax.Array]:
    """Scatters this step's keys and values into their slots; padding rows are dropped."""
    page_size = k_pool.shape[2]
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    k_pool = k_pool.at[layer, page, offset].set(k.astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[layer, page, offset].set(v.astype(v_pool.dtype), mode="drop")
    return k_pool, v_pool
