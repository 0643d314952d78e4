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

Limits (`supports` states them; kernel_choice.py reads it): compute capability 8.0 or later;
f32, bf16 or f16 pools, or 8-bit ones (int8; e4m3 from 8.9), whose keys and values are
dequantized as loaded, each token's exponent per head read beside them (common.fuse_kv);
head_dim and page_size powers of 2 (Triton tensor shapes), head_dim at
most 256 (what the tests compile); the SMEM Triton allocates within the GPU's per-block limit.
That last one is a model (`smem_bound`), measured by compiling for sm_90a against a target with
1 KiB of SMEM, where Triton reports what it asked for: two buffers per K and V block when
pipelined (num_stages >= 2, whatever the number), one otherwise, plus a [rows, head_dim] tile
(1.1-2x what Triton asked for, where it asked for more than 64 KiB). Where the tuning row's launch
would not fit, the launch takes smaller key blocks, then one stage (`launch_shape`), rather than
failing to compile: on an H100, f32 head_dim 256 runs 32-key blocks and bf16 head_dim 256 with
128-key pages one stage; f32 head_dim 256 with 128-key pages is refused (the model's 321 KiB;
Triton measured 192 KiB).

Not yet run on a GPU: written and tested in interpret mode on the CPU, and compiled for sm_90a
on the CPU by the tests (tests/kernels/test_gpu_aot.py); `python -m pallas_kernels.gpu_check`
runs the tests natively and times it on a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_targets import parse_compute_capability
from pallas_kernels.ragged_paged_attention import common, gpu_common, tuning

# A finite "minus infinity", as in the reference (no inf - inf = NaN for rows with no keys).
_MASKED = gpu_common.MASKED
# The largest head_dim the tests compile (tests/kernels/test_gpu_aot.py).
_MAX_HEAD_DIM = 256
# Shared memory one block may opt into, by compute capability (CUDA's per-architecture limits):
# 163 KiB on 8.0 and 8.7, 227 KiB on 9.0 and 10.x; 99 KiB on 8.6, 8.9, 12.x and anything unknown.
_SMEM_PER_BLOCK = {(8, 0): 163 * 1024, (8, 7): 163 * 1024, (9, 0): 227 * 1024}
_SMEM_PER_BLOCK_MAJOR = {10: 227 * 1024}
_SMEM_FALLBACK = 99 * 1024
# Slack for Triton's barriers and alignment beside the modelled buffers (measured: < 64 bytes).
_SMEM_SLACK = 1024
# Fewest keys per block the launch shrinks to before giving up the pipeline (tensor-core dots
# want >= 16 per dimension).
_MIN_PIPELINED_BLOCK = 32


def supports(query: gpu_common.Query) -> str | None:
    """None if the kernel compiles for this shape on the query's GPU, else why not.

    The kernel's limits in one place, for kernel_choice.py. With the query's bucket the answer is
    exact; without it, it holds for every bucket (the largest query tile the row allows).
    """
    compute_capability = query.compute_capability
    version = parse_compute_capability(compute_capability)
    if version is None or version < (8, 0):
        return (
            f"The Triton kernel needs compute capability 8.0 or later (what Pallas on Triton is "
            f"tested on), got {compute_capability!r}."
        )
    dtype = jnp.dtype(query.dtype)
    if dtype == jnp.dtype(jnp.float8_e4m3fn) and version < (8, 9):
        return (
            f"The Triton kernel reads e4m3 pools from compute capability 8.9 (Triton's fp8 "
            f"conversions), got {compute_capability!r}."
        )
    floats = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if dtype not in floats and not common.is_quantized(dtype):
        return (
            f"The Triton kernel runs f32, bf16 and f16 pools and 8-bit ones (int8, e4m3; "
            f"--kv-cache-dtype), got {dtype.name}."
        )
    if reason := _shape_refusal(query.head_dim, query.page_size):
        return reason
    if (bucket := query.bucket) is not None:
        try:
            launch_shape(bucket, query.block_sizes, compute_capability)
        except NotImplementedError as e:
            return str(e)
        return None
    # Any bucket: launch_shape shrinks to one page and one stage at worst; the query tile is at
    # most the row's q_rows (or the group, if larger).
    rows = max(16, tuning.next_power_of_2(query.group), query.block_sizes.q_rows)
    need = smem_bound(rows, query.page_size, query.head_dim, dtype, 1)
    if need > (budget := smem_budget(compute_capability)):
        return _smem_message(
            need, budget, rows, query.page_size, query.head_dim, dtype, compute_capability
        )
    return None


def smem_budget(compute_capability: str | None) -> int:
    """Bytes of shared memory one block may use on a GPU of `compute_capability`."""
    version = parse_compute_capability(compute_capability)
    if version is None:
        return _SMEM_FALLBACK
    if version in _SMEM_PER_BLOCK:
        return _SMEM_PER_BLOCK[version]
    return _SMEM_PER_BLOCK_MAJOR.get(version[0], _SMEM_FALLBACK)


def smem_bound(rows: int, block_kv: int, head_dim: int, dtype, stages: int) -> int:
    """An upper bound on the SMEM Triton allocates for this kernel (bytes), from its tiles.

    Measured on the sm_90a compile (calibration in tests/kernels/test_gpu_aot.py): a pipelined
    loop (stages >= 2, the same for 2, 3 or 4) double-buffers the K and V blocks, an unpipelined
    one holds one of each, and a [rows, head_dim] tile (at most f32) comes on top. The measured
    need was at most 0.9 of this over f32/bf16, head_dim 16-256, pages 1-128 and rows 16-128.
    """
    buffers = 2 if stages >= 2 else 1
    size = jnp.dtype(dtype).itemsize
    return 2 * buffers * block_kv * head_dim * size + rows * head_dim * 4 + _SMEM_SLACK


def _shape_refusal(head_dim: int, page_size: int) -> str | None:
    """Why Triton's tensor shapes cannot take this head_dim or page_size, or None."""
    for name, value in (("head_dim", head_dim), ("page_size", page_size)):
        if value < 1 or value & (value - 1):
            return f"The Triton kernel needs {name}={value} a power of 2."
    if head_dim > _MAX_HEAD_DIM:
        return (
            f"The Triton kernel is compiled and tested up to head_dim {_MAX_HEAD_DIM}, got "
            f"{head_dim}."
        )
    return None


def _smem_message(need, budget, rows, block_kv, head_dim, dtype, compute_capability) -> str:
    return (
        f"The Triton kernel needs about {need} bytes of SMEM even with one stage and one page per "
        f"block (rows={rows}, block_kv={block_kv}, head_dim={head_dim}, "
        f"{jnp.dtype(dtype).name}), more than the {budget} a block has on compute capability "
        f"{compute_capability!r}."
    )


def _target_capability() -> str:
    """The capability Pallas's Triton lowering itself compiles for: the first local GPU's, or 9.0
    without one (its own fallback, e.g. when compiling ahead of time on a CPU)."""
    try:
        return str(jax.local_devices(backend="gpu")[0].compute_capability)
    except RuntimeError:
        return "9.0"


def launch_shape(
    bucket: gpu_common.Bucket,
    sizes: tuning.GpuBlockSizes,
    compute_capability: str | None = None,
) -> gpu_common.LaunchShape:
    """The launch for a bucket (all static), its SMEM within `compute_capability`'s limit.

    From the tuning row; where its blocks would not fit, key blocks halve (down to 32 keys), then
    the pipeline goes (one stage), then blocks halve down to one page. NotImplementedError if even
    that does not fit, or on shapes Triton cannot take. `compute_capability` None: the GPU Pallas
    compiles for (`_target_capability`).
    """
    page_size, head_dim, dtype = bucket.page_size, bucket.head_dim, bucket.dtype
    if reason := _shape_refusal(head_dim, page_size):
        raise NotImplementedError(reason)
    capability = compute_capability or _target_capability()
    budget = smem_budget(capability)
    block_tokens, rows = tuning.gpu_query_block(
        bucket.num_tokens, bucket.num_slots, bucket.group, sizes.q_rows
    )
    pages_per_block = max(1, sizes.kv_tokens // page_size)
    pages_per_block = min(pages_per_block, tuning.next_power_of_2(bucket.pages_per_seq))
    stages = sizes.num_stages
    while (need := smem_bound(rows, pages_per_block * page_size, head_dim, dtype, stages)) > budget:
        if pages_per_block > 1 and pages_per_block * page_size > _MIN_PIPELINED_BLOCK:
            pages_per_block //= 2
        elif stages > 1:
            stages = 1
        elif pages_per_block > 1:
            pages_per_block //= 2
        else:
            raise NotImplementedError(
                _smem_message(need, budget, rows, page_size, head_dim, dtype, capability)
            )
    num_items = common.max_work_items(bucket.num_tokens, bucket.num_slots, block_tokens)
    max_blocks = pl.cdiv(bucket.pages_per_seq, pages_per_block)
    splits = common.num_kv_splits(num_items * bucket.num_kv_heads, max_blocks, sizes)
    return gpu_common.LaunchShape(
        block_tokens=block_tokens,
        rows=rows,
        num_items=num_items,
        block_kv=pages_per_block * page_size,
        splits=splits,
        stages=stages,
    )


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
    *refs,  # ScalarRefs, then q, kv, the output and (splits > 1) the max and sum outputs
    program: gpu_common.Program,
):
    # q: [num_kv_heads, padded_tokens * group, D] grouped queries; kv: [num_layers, num_pages,
    # page_size, lanes] (common.fuse_kv); o: one split [num_kv_heads, padded_tokens * group, D],
    # else f32[splits, ...same]; max and sum: f32[splits, num_kv_heads, padded_tokens * group].
    scalars = gpu_common.ScalarRefs(*refs[:6])
    q_ref, kv_ref, o_ref, *stat_refs = refs[6:]
    sm_scale, sliding_window, group = program.sm_scale, program.sliding_window, program.group
    rows, pages_per_block, num_splits = program.rows, program.pages_per_block, program.num_splits
    item, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim, pages_per_seq = q_ref.shape[2], scalars.page_tables.shape[1]
    num_kv_heads = q_ref.shape[0]  # the pool's (grouped q: [num_kv_heads, rows, D])
    quantized = common.is_quantized(kv_ref.dtype)  # 8-bit pages with exponent lanes
    page_size, block_kv = program.page_size, program.block_kv

    @program.on_used_item(scalars, item, split)
    def _(s, t_lo, span):
        t_hi, pos_offset, kv_start, kv_end = span.t_hi, span.pos_offset, span.kv_start, span.kv_end
        j_lo, j_hi = span.block_lo, span.block_hi

        r = jnp.arange(rows, dtype=jnp.int32)  # row r holds token t_lo + r // group
        row_ok = r < (t_hi - t_lo) * group
        row_slice = pl.ds(t_lo * group, rows)
        q = plgpu.load(q_ref.at[h, row_slice, :], mask=row_ok[:, None], other=0)
        layer = scalars.layer[0]

        def body(j, carry):
            acc, m_prev, l_prev = carry
            c = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # key positions
            slots = j * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
            pages = scalars.page_tables[s, jnp.minimum(slots, pages_per_seq - 1)]
            # Read only the keys some row may see: others may be unwritten (or NaN in tests).
            visible = ((c >= kv_start) & (c < kv_end)).reshape(pages_per_block, page_size, 1)
            # Whole index arrays rather than slices: interpret mode cannot mix the two in a load.
            # Head h's keys sit at lanes [2hD, 2hD + D) of each token, its values right after.
            lanes = 2 * h * head_dim + jnp.arange(head_dim, dtype=jnp.int32)[None, None, :]
            index = (
                layer,
                pages[:, None, None],
                jnp.arange(page_size, dtype=jnp.int32)[None, :, None],
            )
            seen = visible[:, :, 0]  # [pages_per_block, page_size]
            visible = jnp.broadcast_to(visible, (pages_per_block, page_size, head_dim))
            # A float zero for e4m3 pools: Triton's lowering casts no int to fp8.
            zero = 0.0 if kv_ref.dtype == jnp.float8_e4m3fn else 0
            k = plgpu.load(kv_ref.at[(*index, lanes)], mask=visible, other=zero)
            v = plgpu.load(kv_ref.at[(*index, lanes + head_dim)], mask=visible, other=zero)
            if quantized:
                # 8-bit pages: head h's key exponent sits at lane lanes - 2 * heads + 2h of each
                # token, its value exponent after it (common.fuse_kv); scale by 2^e in f32.
                e_lane = kv_ref.shape[3] - 2 * num_kv_heads + 2 * h
                tokens = jnp.arange(page_size, dtype=jnp.int32)[None, :]
                # Masked slots read as exponent 0 (times the zeroed value): never 0 * inf.
                at_k = (layer, pages[:, None], tokens, e_lane)
                at_v = (layer, pages[:, None], tokens, e_lane + 1)
                ek = plgpu.load(kv_ref.at[at_k], mask=seen, other=zero)
                ev = plgpu.load(kv_ref.at[at_v], mask=seen, other=zero)
                k = k.astype(jnp.float32) * common.pow2(ek.astype(jnp.float32))[..., None]
                v = v.astype(jnp.float32) * common.pow2(ev.astype(jnp.float32))[..., None]
                k, v = k.astype(q_ref.dtype), v.astype(q_ref.dtype)
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


def _launch(call: gpu_common.Call) -> jax.Array:  # [T, num_heads, head_dim], q.dtype
    """The reference's attention as a Pallas Triton kernel (conventions in reference.py).

    `block_sizes` defaults to this device kind's row of `tuning.GPU_TABLE`. `compute_capability`
    is the target GPU's ("8.0", "9.0"), which bounds the SMEM a launch may take; pass the one the
    kernel choice was made for (default: the GPU Pallas compiles for). `interpret=True` runs the
    kernel on the CPU, for tests.
    """
    bucket, q = call.bucket, call.q
    group = bucket.group
    shape = launch_shape(bucket, call.block_sizes, call.compute_capability)
    block_tokens, rows, splits = shape.block_tokens, shape.rows, shape.splits
    # Padded by a program's rows so the last item's [rows, D] tile stays in bounds.
    padded_tokens = bucket.num_tokens + pl.cdiv(rows, group)
    q_grouped = common.group_queries(q, bucket.num_kv_heads, padded_tokens)
    item_seq, item_start = common.work_items(
        call.query_start, call.num_seqs, block_tokens, shape.num_items
    )

    grouped_shape = q_grouped.shape
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct(grouped_shape, q.dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((splits, *grouped_shape), jnp.float32),
            jax.ShapeDtypeStruct((splits, *grouped_shape[:2]), jnp.float32),
            jax.ShapeDtypeStruct((splits, *grouped_shape[:2]), jnp.float32),
        ]
    program = gpu_common.Program.of(call, shape)
    kernel = functools.partial(_kernel, program=program)
    outs = pl.pallas_call(
        kernel,
        grid=(shape.num_items, bucket.num_kv_heads, splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=call.block_sizes.num_warps, num_stages=shape.stages
        ),
        interpret=bool(call.interpret),
        cost_estimate=gpu_common.cost_estimate(shape, bucket, call.sliding_window, rows),
        name="ragged_paged_attention_gpu",
    )(*call.scalar_operands(item_seq, item_start), q_grouped, call.kv_pool)
    out = outs[0] if splits == 1 else common.merge_splits(*outs).astype(q.dtype)
    # Rows of no work item (padding) were never written: zero them.
    return common.ungroup_outputs(out, bucket.num_tokens, group, call.real_rows())


ragged_paged_attention = gpu_common.entry_point(_launch)
