"""What both kernels' wrappers share: argument checks and the grouped-query layout.

Both kernels read queries as [num_kv_heads, tokens * group, head_dim] ("grouped"): the `group`
query heads that share a KV head become consecutive rows, so one matmul against one KV head's keys
serves all of them (GQA), and a block of rows is a block of whole tokens. The transpose in and out
costs two passes over q (T * H * D elements), which is small beside the keys and values read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_args(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pool: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_pool: jax.Array,  # same as k_pool
    query_start: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    page_tables: jax.Array,  # i32[S, P]
    sliding_window: int | None,
) -> None:
    """Raises ValueError, in a whole sentence with the values, on shapes the kernels cannot run."""
    if q.ndim != 3 or k_pool.ndim != 5:
        raise ValueError(f"Expected q [T, H, D] and a 5-d pool, got {q.shape=}, {k_pool.shape=}.")
    if k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pool and v_pool differ: {k_pool.shape=} {v_pool.shape=}.")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_pool.shape[3]
    if k_pool.shape[4] != head_dim:
        raise ValueError(f"The pool's head_dim {k_pool.shape[4]} is not q's {head_dim}.")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} is not a multiple of {num_kv_heads=} (GQA groups).")
    num_seqs = page_tables.shape[0]
    if query_start.shape != (num_seqs + 1,) or kv_lens.shape != (num_seqs,):
        raise ValueError(
            f"Expected query_start [S + 1] and kv_lens [S] with S = {num_seqs} (page_tables rows), "
            f"got {query_start.shape=}, {kv_lens.shape=}."
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be None or >= 1.")


def group_queries(q: jax.Array, num_kv_heads: int, padded_tokens: int) -> jax.Array:
    """q [T, H, D] -> [num_kv_heads, padded_tokens * group, D], zero rows past T."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    q = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if padded_tokens > num_tokens:
        q = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0), (0, 0)))
    return q.transpose(1, 0, 2, 3).reshape(num_kv_heads, padded_tokens * group, head_dim)


def ungroup_outputs(
    out: jax.Array,  # [num_kv_heads, padded_tokens * group, D]
    num_tokens: int,
    group: int,
    real_rows: jax.Array | None = None,  # bool[T]: rows the kernel may have left unwritten
) -> jax.Array:  # [T, H, D]
    """The inverse of `group_queries`; rows outside `real_rows` become 0 (padding's output)."""
    num_kv_heads, rows, head_dim = out.shape
    out = out.reshape(num_kv_heads, rows // group, group, head_dim)[:, :num_tokens]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_kv_heads * group, head_dim)
    if real_rows is not None:
        # jnp.where, not a product: an unwritten row may hold NaN, and NaN * 0 is NaN.
        out = jnp.where(real_rows[:, None, None], out, jnp.zeros((), out.dtype))
    return out


def real_rows(query_start: jax.Array, num_seqs: jax.Array, num_tokens: int) -> jax.Array:
    """bool[T]: rows before query_start[num_seqs]; the rest are padding and output 0."""
    return jnp.arange(num_tokens, dtype=jnp.int32) < query_start[num_seqs]
