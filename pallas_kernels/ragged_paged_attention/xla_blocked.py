"""Ragged paged attention in plain jnp whose cost follows the batch's real context length.

The dense reference gathers every row's whole page table (max_model_len keys per query row), so
a decode step at context 100 costs as much as one at context 4096. This version walks the page
table in blocks of pages inside a `lax.while_loop` whose trip count is the longest kv_len in the
batch (an array, so no retrace), with an online softmax across blocks. It is the production
path on the CPU (`attention_backend="xla"`, and `auto` there) and is tested against the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Keys read per row per loop iteration: enough work per iteration to amortise the loop.
_BLOCK_TOKENS = 256


def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pool: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_pool: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    layer: jax.Array,  # i32[]
    query_start: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    page_tables: jax.Array,  # i32[S, P]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
) -> jax.Array:  # [T, num_heads, head_dim], q.dtype
    """Same contract as reference.ragged_paged_attention (see its module docstring)."""
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pool.shape[2], k_pool.shape[3]
    num_slots, max_pages = page_tables.shape
    group = num_heads // num_kv_heads
    pages_per_block = max(1, min(max_pages, _BLOCK_TOKENS // page_size))
    num_blocks_total = -(-max_pages // pages_per_block)
    # Pad the table so every block slice is in bounds; padded entries are masked by kv_lens.
    tables = jnp.pad(page_tables, ((0, 0), (0, num_blocks_total * pages_per_block - max_pages)))
    block_tokens = pages_per_block * page_size

    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.minimum(
        jnp.searchsorted(query_start[1:], rows, side="right").astype(jnp.int32), num_slots - 1
    )
    is_real = rows < query_start[num_seqs]
    q_len = query_start[seq + 1] - query_start[seq]
    q_pos = kv_lens[seq] - q_len + (rows - query_start[seq])  # i32[T]
    row_kv_len = jnp.where(is_real, kv_lens[seq], 0)
    lowest = jnp.zeros_like(q_pos) if sliding_window is None else q_pos - sliding_window + 1
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    row_tables = tables[seq]  # i32[T, blocks * pages_per_block]
    num_blocks = (jnp.max(row_kv_len) + block_tokens - 1) // block_tokens

    def body(block, carry):
        running_max, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(
            row_tables, block * pages_per_block, pages_per_block, axis=1
        )
        k = k_pool[layer, pages].reshape(num_tokens, block_tokens, num_kv_heads, head_dim)
        v = v_pool[layer, pages].reshape(num_tokens, block_tokens, num_kv_heads, head_dim)
        kv_pos = block * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)[None, :]
        mask = (kv_pos <= q_pos[:, None]) & (kv_pos < row_kv_len[:, None])
        mask &= kv_pos >= lowest[:, None]
        v = jnp.where(mask[:, :, None, None], v, 0)  # unused slots may hold NaN
        scores = jnp.einsum("tkgd,tckd->tkgc", qg, k, preferred_element_type=jnp.float32)
        scores = jnp.where(mask[:, None, None, :], scores * sm_scale, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        probs = jnp.where(mask[:, None, None, :], jnp.exp(scores - safe_max[..., None]), 0.0)
        rescale = jnp.where(jnp.isfinite(running_max), jnp.exp(running_max - safe_max), 0.0)
        denom = denom * rescale + jnp.sum(probs, axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum(
            "tkgc,tckd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        return new_max, denom, acc

    shape = (num_tokens, num_kv_heads, group)
    init = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # fully masked rows stay 0
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
