"""Ragged paged attention in Pallas on Triton (GPU), with the reference's signature.

The pre-Hopper fallback: JAX 0.11 deprecated Pallas's Triton backend, and on compute capability
9.0 and later `attention_backend="pallas"` runs mosaic_gpu_kernel.py instead (see
jaxserve/models/attention.py). This kernel still serves older GPUs and f32 pools (which the Mosaic
GPU kernel's wgmma cannot take). Its work list, key-block range and split/merge live in common.py,
shared with the Mosaic GPU kernel.

Grid: (work item, KV head, key split). A work item is up to `block_tokens` consecutive query
tokens of one sequence (a decode token, or a piece of a prefill chunk); XLA lists the items
beforehand from query_start (a cumsum and a searchsorted), in a static number of slots so that
the grid never changes with the batch, and the slots left over exit at once. One program reads
its item's queries for one KV head, grouped ([rows, D], the `group` query heads of that KV head on
consecutive rows, so one dot serves GQA), then loops over key blocks of `pages_per_block` pages:
page ids come from the page table, each page is gathered straight from `pool[layer, page, :, h]`
with a masked load (the layer indexed in the kernel, never sliced outside it; slots past the
visible keys are not read, so unwritten or unused pages never enter). Softmax is online.

Small decode batches leave most of the GPU idle with one program per (sequence, KV head), so the
key range is split ("flash decoding") into up to `max_kv_splits` parts that write partial
(numerator, max, sum) and are merged by XLA; buckets with enough programs use one split and write
the output directly. Both choices are static, from the bucket shape and the tuning table.

The new keys and values are written by XLA's scatter (`write_kv`) before the kernel, as for the
TPU kernel (see tpu_kernel.py for why): this kernel only reads the pool.

Limits: head_dim and page_size must be powers of 2 (Triton tensor shapes). Not yet run on a GPU:
written and tested in interpret mode on the CPU, and lowered to Triton IR by the tests;
`python -m pallas_kernels.gpu_check` runs the tests natively and times it on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention import common, tuning

# A finite "minus infinity", as in the reference (no inf - inf = NaN for rows with no keys).
_MASKED = -1e30


def _dot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    """f32 a @ b (contract_b=0) or a @ b.T (contract_b=1), exact for f32 inputs.

    Triton's dot needs every dimension >= 16; tiny shapes (stories260k's head_dim 8) fall back to
    a broadcast multiply and sum, which is exact and cheap at that size.
    """
    n = b.shape[1 - contract_b]
    if min(a.shape[0], a.shape[1], n) >= 16:
        # DEFAULT precision lowers f32 dots to IEEE f32 on Triton (no silent TF32).
        return lax.dot_general(
            a, b, (((1,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32
        )
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    if contract_b == 1:
        return jnp.sum(a32[:, None, :] * b32[None, :, :], axis=2)
    return jnp.sum(a32[:, :, None] * b32[None, :, :], axis=1)


def _kernel(
    layer_ref,  # i32[1]
    query_start_ref,  # i32[S + 1]
    kv_lens_ref,  # i32[S]
    page_tables_ref,  # i32[S, P]
    item_seq_ref,  # i32[W] sequence of each work item
    item_start_ref,  # i32[W] first token of each work item; -1: an unused slot
    q_ref,  # [num_kv_heads, padded_tokens * group, D] grouped queries
    k_ref,  # [num_layers, num_pages, page_size, num_kv_heads, D]
    v_ref,  # same as k_ref
    o_ref,  # one split: [num_kv_heads, padded_tokens * group, D]; else f32[splits, ...same]
    *stat_refs,  # splits > 1 only: max and sum, f32[splits, num_kv_heads, padded_tokens * group]
    sm_scale: float,
    sliding_window: int | None,
    group: int,
    block_tokens: int,
    rows: int,
    pages_per_block: int,
    num_splits: int,
):
    item, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page_size, head_dim = k_ref.shape[2], k_ref.shape[4]
    pages_per_seq = page_tables_ref.shape[1]
    block_kv = pages_per_block * page_size
    s, t_lo = item_seq_ref[item], item_start_ref[item]

    @pl.when(t_lo >= 0)
    def _():
        span = common.item_span(
            t_lo,
            query_start_ref[s + 1],
            kv_lens_ref[s],
            split,
            block_tokens=block_tokens,
            block_kv=block_kv,
            num_splits=num_splits,
            sliding_window=sliding_window,
        )
        t_hi, pos_offset, kv_start, kv_end = span.t_hi, span.pos_offset, span.kv_start, span.kv_end
        j_lo, j_hi = span.block_lo, span.block_hi

        r = jnp.arange(rows, dtype=jnp.int32)  # row r holds token t_lo + r // group
        row_ok = r < (t_hi - t_lo) * group
        row_slice = pl.ds(t_lo * group, rows)
        q = plgpu.load(q_ref.at[h, row_slice, :], mask=row_ok[:, None], other=0)
        layer = layer_ref[0]

        def body(j, carry):
            acc, m_prev, l_prev = carry
            c = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # key positions
            slots = j * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
            pages = page_tables_ref[s, jnp.minimum(slots, pages_per_seq - 1)]
            # Read only the keys some row may see: others may be unwritten (or NaN in tests).
            visible = ((c >= kv_start) & (c < kv_end)).reshape(pages_per_block, page_size, 1)
            # Whole index arrays rather than slices: interpret mode cannot mix the two in a load.
            index = (
                layer,
                pages[:, None, None],
                jnp.arange(page_size, dtype=jnp.int32)[None, :, None],
                h,
                jnp.arange(head_dim, dtype=jnp.int32)[None, None, :],
            )
            visible = jnp.broadcast_to(visible, (pages_per_block, page_size, head_dim))
            k = plgpu.load(k_ref.at[index], mask=visible, other=0)
            v = plgpu.load(v_ref.at[index], mask=visible, other=0)
            k = k.reshape(block_kv, head_dim)
            v = v.reshape(block_kv, head_dim)
            # Causal (and window) per row, without integer division: c <= t + pos_offset with
            # t = t_lo + r // group  <=>  (c - pos_offset - t_lo) * group <= r.
            rel = (c[None, :] - pos_offset - t_lo) * group
            mask = row_ok[:, None] & (rel <= r[:, None])
            if sliding_window is not None:
                mask &= rel + sliding_window * group > r[:, None]
            scores = jnp.where(mask, _dot(q, k, 1) * sm_scale, _MASKED)
            m_next = jnp.maximum(m_prev, scores.max(axis=1))
            probs = jnp.where(mask, jnp.exp(scores - m_next[:, None]), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            l_next = alpha * l_prev + probs.sum(axis=1)
            acc = alpha[:, None] * acc + _dot(probs.astype(v.dtype), v, 0)
            return acc, m_next, l_next

        init = (
            jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), _MASKED, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
        )
        acc, row_max, row_sum = lax.fori_loop(j_lo, j_hi, body, init)
        if num_splits == 1:
            out = acc / jnp.where(row_sum > 0, row_sum, 1.0)[:, None]
            plgpu.store(o_ref.at[h, row_slice, :], out.astype(o_ref.dtype), mask=row_ok[:, None])
        else:
            # Every split writes, even with no keys (m = -1e30, l = 0), so the merge sees no
            # garbage in real rows.
            m_ref, l_ref = stat_refs
            plgpu.store(o_ref.at[split, h, row_slice, :], acc, mask=row_ok[:, None])
            plgpu.store(m_ref.at[split, h, row_slice], row_max, mask=row_ok)
            plgpu.store(l_ref.at[split, h, row_slice], row_sum, mask=row_ok)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "block_sizes", "interpret")
)
def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pool: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_pool: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    layer: jax.Array,  # i32[] which layer of the pool to read
    query_start: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    page_tables: jax.Array,  # i32[S, P]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    block_sizes: tuning.GpuBlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, num_heads, head_dim], q.dtype
    """The reference's attention as a Pallas Triton kernel (conventions in reference.py).

    `block_sizes` defaults to this device kind's row of `tuning.GPU_TABLE`. `interpret=True`
    runs the kernel on the CPU, for tests.
    """
    common.check_args(q, k_pool, v_pool, query_start, kv_lens, page_tables, sliding_window)
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = k_pool.shape
    num_slots, pages_per_seq = page_tables.shape
    for name, value in (("head_dim", head_dim), ("page_size", page_size)):
        if value & (value - 1):
            raise NotImplementedError(f"The Triton kernel needs {name}={value} a power of 2.")
    group = num_heads // num_kv_heads
    sizes = block_sizes or tuning.gpu_block_sizes()

    block_tokens, rows = tuning.gpu_query_block(num_tokens, num_slots, group, sizes.q_rows)
    pages_per_block = max(1, sizes.kv_tokens // page_size)
    pages_per_block = min(pages_per_block, tuning.next_power_of_2(pages_per_seq))
    num_items = common.max_work_items(num_tokens, num_slots, block_tokens)
    max_blocks = pl.cdiv(pages_per_seq, pages_per_block)
    splits = common.num_kv_splits(num_items * num_kv_heads, max_blocks, sizes)
    # Padded by a program's rows so the last item's [rows, D] tile stays in bounds.
    padded_tokens = num_tokens + pl.cdiv(rows, group)
    q_grouped = common.group_queries(q, num_kv_heads, padded_tokens)
    item_seq, item_start = common.work_items(query_start, num_seqs, block_tokens, num_items)

    grouped_shape = q_grouped.shape
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct(grouped_shape, q.dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((splits, *grouped_shape), jnp.float32),
            jax.ShapeDtypeStruct((splits, *grouped_shape[:2]), jnp.float32),
            jax.ShapeDtypeStruct((splits, *grouped_shape[:2]), jnp.float32),
        ]
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        group=group,
        block_tokens=block_tokens,
        rows=rows,
        pages_per_block=pages_per_block,
        num_splits=splits,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(num_items, num_kv_heads, splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=sizes.num_warps, num_stages=sizes.num_stages
        ),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        query_start.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        page_tables.astype(jnp.int32),
        item_seq,
        item_start,
        q_grouped,
        k_pool,
        v_pool,
    )
    out = outs[0] if splits == 1 else common.merge_splits(*outs).astype(q.dtype)
    # Rows of no work item (padding) were never written: zero them.
    return common.ungroup_outputs(
        out, num_tokens, group, common.real_rows(query_start, num_seqs, num_tokens)
    )
