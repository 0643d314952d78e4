"""Pure-jnp ragged paged attention: the CPU default and the oracle every kernel is tested against.

Conventions shared with the kernels:
- Queries of all sequences are flattened: sequence s owns rows [query_start[s], query_start[s+1]).
- The new keys and values were written into the pool before attention runs, so the pool holds
  all kv_lens[s] tokens of sequence s, and query i of a q_len-token chunk sits at position
  kv_lens[s] - q_len + i (causal within the chunk).
- Rows past query_start[num_seqs] are padding; their output is 0.
- The pool is one array [num_layers, num_pages, page_size, lanes]: each token's keys and values
  side by side, head h's keys at lanes [2hD, 2hD + D) and its values right after, the rest of the
  lanes padding (common.fuse_kv / split_kv). `num_kv_heads` (static) says how many heads it
  holds; None means all its lanes (2 * num_kv_heads * head_dim == lanes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import common

# A finite "minus infinity": a fully masked (padding) row then averages zeroed values, not NaN.
_MASKED = -1e30


def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    kv_pool: jax.Array,  # [num_layers, num_pages, page_size, lanes] (common.fuse_kv)
    layer: jax.Array,  # i32[] which layer of the pool to read
    query_start: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    page_tables: jax.Array,  # i32[S, P]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    num_kv_heads: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [T, num_heads, head_dim], q.dtype
    """Attention of every query row over its own sequence's cached keys and values.
    `soft_cap` (Gemma 2): scaled scores become soft_cap * tanh(scores / soft_cap) before the
    mask."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = common.kv_heads_of(kv_pool, head_dim, num_kv_heads)
    page_size = kv_pool.shape[2]
    num_slots = page_tables.shape[0]
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    # The sequence of each row: how many sequence ends lie at or before it.
    seq = jnp.minimum(
        jnp.searchsorted(query_start[1:], rows, side="right").astype(jnp.int32), num_slots - 1
    )
    q_len = query_start[seq + 1] - query_start[seq]
    q_pos = kv_lens[seq] - q_len + (rows - query_start[seq])  # i32[T]
    is_real = rows < query_start[num_seqs]

    pages = page_tables[seq]  # i32[T, P]
    context = pages.shape[1] * page_size
    # A quantized pool (int8 / e4m3 with scale lanes) is dequantized into q's dtype, exactly.
    k, v = common.split_kv(kv_pool[layer, pages], num_kv_heads, head_dim, q.dtype)
    k = k.reshape(num_tokens, context, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, context, num_kv_heads, head_dim)

    kv_pos = jnp.arange(context, dtype=jnp.int32)[None, :]
    mask = (kv_pos <= q_pos[:, None]) & (kv_pos < kv_lens[seq][:, None]) & is_real[:, None]
    if sliding_window is not None:
        mask &= kv_pos > q_pos[:, None] - sliding_window
    # Zero values outside the mask: garbage (or NaN) in unused pages must not leak in as 0 * NaN.
    v = jnp.where(mask[:, :, None, None], v, 0)

    group = num_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,tckd->tkgc", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask[:, None, None, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum(
        "tkgc,tckd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
