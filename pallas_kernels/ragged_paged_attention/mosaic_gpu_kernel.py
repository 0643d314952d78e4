"""Ragged paged attention in Pallas on Mosaic GPU (Hopper, sm90+), with the reference's signature.

Why a second GPU kernel: JAX 0.11 deprecated Pallas's Triton backend; Pallas on GPU now lowers to
Mosaic GPU, which drives Hopper's TMA engine and warpgroup tensor-core MMAs (wgmma) directly.
gpu_kernel.py (Triton) stays as the fallback for GPUs older than sm90.

Design. The work split is the Triton kernel's (common.py): XLA lists work items (up to
`block_tokens` consecutive query tokens of one sequence) from query_start, in a static number of
slots, and the grid is (work item, KV head, key split). One program = one warpgroup:
- its queries, grouped (the `group` query heads of its KV head on consecutive rows, so one MMA
  serves GQA), are gathered by XLA into a tile of their own per work item and KV head, `rows`
  rows, which one TMA copy puts at the top of a 64-row SMEM tile (wgmma's M; the spare rows,
  never written, are masked). Not one copy straight out of the grouped queries: an item starts
  on row t_lo * group, and a TMA copy into an (8, 64)-tiled SMEM tile must start on a multiple of
  8 rows in GMEM (JAX 0.12's Mosaic GPU refuses the copy; 0.10's lowered it and would have
  rounded the start down to the tile, reading the wrong queries for items not 8-row aligned);
- keys and values go GMEM->SMEM a block of `pages_per_block` pages at a time, one TMA copy per page
  (head h's key lanes, then its value lanes, of `pool[layer, page]`: common.fuse_kv; page ids
  read from the page table in GMEM), into `stages` SMEM slots, each slot with one barrier for its
  keys and one for its values; block j+stages-1 is in flight while block j is computed, so the
  copies overlap the math;
- S = Q K^T and O += P V are wgmmas with f32 accumulators (P goes through SMEM); the softmax is
  online, in registers, with a finite -1e30 for masked scores (rows with no key give 0, not NaN);
- a block that reaches past the visible keys (a sequence's last, partial page; a sliding window's
  first block) may hold unwritten slots, possibly NaN: its values are zeroed in SMEM before the PV
  MMA, since 0 * NaN would otherwise poison the row (keys need no such care: their scores are
  replaced by -1e30 with a select). Pages with no visible key are not copied at all: their
  barrier arrival is a plain arrive;
- each program writes its own [rows, D] output tile (items never share a tile, so no ragged
  stores): XLA then gathers each token's rows back. Small decode batches split the keys ("flash
  decoding") into partial (numerator, max, sum) tiles merged by XLA, as the Triton kernel does.

The new keys and values are written by XLA's scatter (`write_kv`) before the kernel: it only reads
the pool.

Limits (`supports` states them; kernel_choice.py reads it to route other shapes elsewhere):
compute capability 9.x only (wgmma exists on sm_90a alone: Blackwell has none); 16-bit pools
(bf16, f16), since wgmma takes no transposed f32 operand (interpret mode runs f32 too); head_dim
rows of a multiple of 32 bytes (16 elements in 16-bit: wgmma takes no unswizzled tile), at most
256 (wgmma's N); page_size a multiple of 8 (SMEM tiles of 8 rows) that divides the 64-key block or
is a multiple of it, key blocks of at most 256 keys; group <= 64; the SMEM buffers within budget.
Head dims below 64 in 16-bit (rows narrower than 128 bytes) work because P's SMEM tile takes V's
smaller swizzle: wgmma needs the two operands of P V swizzled alike (`_p_swizzle`).

Verified where: only on the CPU. In Mosaic GPU interpret mode (JAX's simulator of TMA copies,
barriers, SMEM and wgmma) against the reference, except two things interpret mode cannot run:
S = Q K^T is a plain dot there (its wgmma takes no transposed operand) and register layouts are
left out; lowered to Mosaic GPU for CUDA by the tests (which checks those two), and compiled to
sm_90a machine code on the CPU against an H100 compile target (tests/kernels/test_gpu_aot.py).
Not yet run on a GPU: `python -m pallas_kernels.gpu_check` runs the tests natively and times it
there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu_targets import parse_compute_capability
from pallas_kernels.ragged_paged_attention import common, gpu_common, tuning

# A finite "minus infinity", as in the reference (no inf - inf = NaN for rows with no keys).
_MASKED = gpu_common.MASKED
# Rows of one wgmma (one warpgroup's M): a program's query tile.
_ROWS = 64
# SMEM for the buffers: Hopper's 227 KiB per block, less room for barriers and alignment.
_SMEM_BYTES = 220 * 1024
# wgmma's largest N: the PV product's head_dim and the QK product's keys per block.
_MAX_WGMMA_N = 256
# wgmma reads SMEM tiles swizzled by 32, 64 or 128 bytes, never unswizzled (16).
_MIN_SWIZZLE = 32


def interpret_params():
    """Mosaic GPU interpret mode's parameters (run the kernel on the CPU), for tests.

    JAX 0.10 has no public alias for them; the private path is imported here only, so a JAX that
    moves it breaks this one function with a clear message, not the module.
    """
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:  # pragma: no cover - depends on the JAX version
        raise NotImplementedError(
            f"This JAX ({jax.__version__}) has no Mosaic GPU interpret mode where it was expected "
            "(jax._src.pallas.mosaic_gpu.interpret.params.InterpretGPUParams)."
        ) from e
    # NaN in uninitialised SMEM, so a read of a slot no copy filled shows in the output.
    return InterpretGPUParams(uninitialized_memory="nan")


def reset_interpret_state() -> None:
    """Clears interpret mode's simulator state, which an exception inside a kernel leaves broken
    (JAX asks for this before the next interpreted kernel); for tests."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    interpret_pallas_call.reset_gpu_interpret_mode_state()


def supports_dtype(dtype) -> bool:
    """Whether the kernel compiles for a pool of `dtype` on a GPU (interpret mode takes any)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def supports(query: gpu_common.Query) -> str | None:
    """None if the kernel compiles for this shape on the query's GPU, else why not.

    The kernel's limits in one place, for kernel_choice.py. With the query's bucket the answer is
    exact, from the launch the kernel would make; without it, it holds for every bucket (the SMEM
    check then assumes key splits, the larger case).
    """
    version = parse_compute_capability(query.compute_capability)
    if version is None or version[0] != 9:
        return (
            f"The Mosaic GPU kernel needs compute capability 9.x (wgmma exists on sm_90a only), "
            f"got {query.compute_capability!r}."
        )
    if not supports_dtype(query.dtype):
        return (
            f"The Mosaic GPU kernel runs 16-bit pools only (wgmma cannot take an f32 K^T), got "
            f"{jnp.dtype(query.dtype).name}."
        )
    if (bucket := query.bucket) is not None:
        try:
            launch_shape(bucket, query.block_sizes)
        except NotImplementedError as e:
            return str(e)
        return None
    block_kv = _block_kv(query.page_size, query.dtype, query.block_sizes)
    shape = (query.group, query.page_size, query.head_dim, query.dtype, block_kv)
    if reason := _shape_refusal(*shape):
        return reason
    # The fewest stages launch_shape falls back to, with the f32 split outputs if it may split.
    return _smem_refusal(block_kv, query.head_dim, query.dtype, 2, query.block_sizes.max_kv_splits)


def _swizzle(minor: int, dtype) -> int:
    """The widest SMEM swizzle (bytes) for a tile whose last dimension has `minor` elements."""
    return plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)


def _p_swizzle(block_kv: int, head_dim: int, dtype) -> int:
    """The swizzle of P's [64, block_kv] SMEM tile: its own widest, or V's if narrower.

    wgmma swizzles both operands of one product alike. P V's operands are P ([64, block_kv], rows
    of 128 bytes or more) and V ([block_kv, head_dim]); with head_dim below 64 in 16-bit, V's rows
    are narrower than 128 bytes and take a 64- or 32-byte swizzle, so P takes the same (its
    tiling follows). Q K^T's operands are both head_dim wide and always agree.
    """
    return min(_swizzle(block_kv, dtype), _swizzle(head_dim, dtype))


def _smem_transforms(minor: int, dtype, swizzle: int | None = None) -> tuple:
    """Tiling and swizzle for an SMEM tile whose last dimension has `minor` elements
    (`swizzle` bytes; default the widest that fits)."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = swizzle or _swizzle(minor, dtype)
    return plgpu.TilingTransform((8, 8 * swizzle // bits)), plgpu.SwizzleTransform(swizzle)


def _kernel(
    *refs,  # ScalarRefs, then q, kv, the outputs, then the scratch (see `_launch`)
    program: gpu_common.Program,
    stages: int,
    interpreted: bool,
):
    """One program: work item `item`, KV head `h`, key split `split` (the grid's named axes).

    Outputs: one split: o [W, num_kv_heads, rows, D]; else o f32[splits, W, num_kv_heads, rows, D]
    (unnormalised) with row max and row sum, f32[splits, W, num_kv_heads, rows].
    """
    scalars = gpu_common.ScalarRefs(*refs[:6])
    # q: [num_kv_heads, W, rows, D] each work item's grouped queries; kv: [num_layers, num_pages,
    # page_size, lanes] (common.fuse_kv).
    q_ref, kv_ref, *refs = refs[6:]
    sm_scale, sliding_window, group = program.sm_scale, program.sliding_window, program.group
    rows, pages_per_block, num_splits = program.rows, program.pages_per_block, program.num_splits
    if num_splits == 1:
        (o_ref, q_smem, k_smem, v_smem, p_smem, o_smem, k_bars, v_bars, q_bar) = refs
    else:
        (o_ref, m_ref, l_ref, q_smem, k_smem, v_smem, p_smem, o_smem, m_smem, l_smem) = refs[:10]
        k_bars, v_bars, q_bar = refs[10:]
    item, h, split = lax.axis_index("item"), lax.axis_index("head"), lax.axis_index("split")
    head_dim, pages_per_seq = q_ref.shape[3], scalars.page_tables.shape[1]
    page_size, block_kv = program.page_size, program.block_kv

    @program.on_used_item(scalars, item, split)
    def _(s, t_lo, span):
        j_lo, j_hi = span.block_lo, span.block_hi
        layer = scalars.layer[0]
        num_rows = (span.t_hi - t_lo) * group  # real rows of this tile

        def copy_page(slot, p, page):
            dst = pl.ds(p * page_size, page_size)
            # Head h's keys sit at lanes [2hD, 2hD + D) of each token, its values right after.
            k_src = (layer, page, slice(None), pl.ds(2 * h * head_dim, head_dim))
            v_src = (layer, page, slice(None), pl.ds((2 * h + 1) * head_dim, head_dim))
            plgpu.copy_gmem_to_smem(kv_ref.at[k_src], k_smem.at[slot, dst], k_bars.at[slot])
            plgpu.copy_gmem_to_smem(kv_ref.at[v_src], v_smem.at[slot, dst], v_bars.at[slot])

        def skip_page(slot):
            # A page no row sees is not read (a short sequence's last block, a window's first):
            # a plain arrival stands for its copy. Its stale slot is masked (K) and zeroed (V)
            # like any invisible key.
            plgpu.barrier_arrive(k_bars.at[slot])
            plgpu.barrier_arrive(v_bars.at[slot])

        def fetch(j):
            """Starts the TMA copies of key block j's visible pages into its slot."""
            slot = lax.rem(j - j_lo, stages)
            # All page ids first, outside the branches: independent loads that overlap, rather
            # than one global-memory round trip per page before its copy can start.
            pages = [
                scalars.page_tables[s, jnp.minimum(j * pages_per_block + p, pages_per_seq - 1)]
                for p in range(pages_per_block)
            ]
            for p, page in enumerate(pages):
                first = j * block_kv + p * page_size
                visible = (first < span.kv_end) & (first + page_size > span.kv_start)
                pl.when(visible)(functools.partial(copy_page, slot, p, page))
                pl.when(~visible)(functools.partial(skip_page, slot))

        plgpu.copy_gmem_to_smem(q_ref.at[h, item], q_smem.at[pl.ds(0, rows)], q_bar.at[0])
        for i in range(stages - 1):  # the pipeline's prologue: blocks in flight before the loop
            pl.when(j_lo + i < j_hi)(functools.partial(fetch, j_lo + i))

        plgpu.barrier_wait(q_bar.at[0])
        # Register layouts are hints for the Mosaic GPU compiler; interpret mode has no rule for
        # them (and needs none), so they are left out there.
        wgmma_layout = plgpu.Layout.WGMMA

        def iota(shape, dim):
            if interpreted:
                return lax.broadcasted_iota(jnp.int32, shape, dim)
            return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=wgmma_layout)

        def cast(x, layout):
            return x if interpreted else plgpu.layout_cast(x, layout)

        r = iota((_ROWS, block_kv), 0)
        col = iota((_ROWS, block_kv), 1)

        def body(j, carry):
            acc, m_prev, l_prev = carry
            slot = lax.rem(j - j_lo, stages)

            # The slot of block j + stages - 1 was read by block j - 1, which has finished.
            @pl.when(j + stages - 1 < j_hi)
            def _():
                fetch(j + stages - 1)

            plgpu.barrier_wait(k_bars.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            if interpreted:
                # Interpret mode's wgmma cannot read a transposed operand: the same product,
                # from the same SMEM tiles, as a plain f32 dot.
                scores = lax.dot_general(
                    q_smem[...],
                    k_smem[slot],
                    (((1,), (1,)), ((), ())),
                    preferred_element_type=jnp.float32,
                    precision=lax.Precision.HIGHEST,
                )
            else:
                scores = pl.run_scoped(qk, plgpu.ACC((_ROWS, block_kv), jnp.float32))
            scores = scores * sm_scale
            c = col + j * block_kv  # key positions
            # Causal (and window) per row, without integer division: c <= t + pos_offset with
            # t = t_lo + r // group  <=>  (c - pos_offset - t_lo) * group <= r.
            rel = (c - span.pos_offset - t_lo) * group
            mask = (r < num_rows) & (rel <= r)
            if sliding_window is not None:
                mask &= rel + sliding_window * group > r
            scores = jnp.where(mask, scores, _MASKED)
            m_next = jnp.maximum(m_prev, scores.max(axis=1))
            probs = jnp.exp(scores - lax.broadcast_in_dim(m_next, scores.shape, [0]))
            probs = jnp.where(mask, probs, 0.0)
            alpha = jnp.exp(m_prev - m_next)
            l_next = alpha * l_prev + probs.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            plgpu.barrier_wait(v_bars.at[slot])
            first, last = j * block_kv, (j + 1) * block_kv

            @pl.when((first < span.kv_start) | (last > span.kv_end))
            def _():
                # Slots outside [kv_start, kv_end) may be unwritten (NaN in tests): 0 * NaN = NaN.
                vals = v_smem[slot]
                pos = first + iota(vals.shape, 0)
                keep = (pos >= span.kv_start) & (pos < span.kv_end)
                v_smem[slot] = jnp.where(keep, vals, jnp.zeros((), vals.dtype))
                plgpu.commit_smem()  # make the stores visible to the wgmma (async proxy)

            # P goes through SMEM rather than registers: decode is bound by the pool's reads, the
            # 64 x block_kv store is cheap beside them, and interpret mode's wgmma takes only refs.
            p_smem[...] = probs.astype(p_smem.dtype)
            plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]

            # A fresh accumulator plus an add, not run_state on `acc`: interpret mode has no
            # run_state, and the add is 64 x D registers beside a 64 x block_kv x D MMA.
            acc = acc + pl.run_scoped(pv, plgpu.ACC((_ROWS, head_dim), jnp.float32))
            return acc, m_next, l_next

        init = (
            cast(jnp.zeros((_ROWS, head_dim), jnp.float32), wgmma_layout),
            cast(jnp.full((_ROWS,), _MASKED, jnp.float32), wgmma_layout.reduce(1)),
            cast(jnp.zeros((_ROWS,), jnp.float32), wgmma_layout.reduce(1)),
        )
        acc, row_max, row_sum = lax.fori_loop(j_lo, j_hi, body, init)
        out_rows = pl.ds(0, rows)
        if num_splits == 1:
            safe = jnp.where(row_sum > 0, row_sum, 1.0)
            o_smem[...] = (acc / lax.broadcast_in_dim(safe, acc.shape, [0])).astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[out_rows], o_ref.at[item, h])
        else:
            # Every split writes, even with no keys (m = -1e30, l = 0): the merge reads them all.
            o_smem[...] = acc
            m_smem[...] = row_max
            l_smem[...] = row_sum
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[out_rows], o_ref.at[split, item, h])
            plgpu.copy_smem_to_gmem(m_smem.at[out_rows], m_ref.at[split, item, h])
            plgpu.copy_smem_to_gmem(l_smem.at[out_rows], l_ref.at[split, item, h])
        plgpu.wait_smem_to_gmem(0)


def launch_shape(bucket: gpu_common.Bucket, sizes: tuning.GpuBlockSizes) -> gpu_common.LaunchShape:
    """The launch for a bucket (all static); NotImplementedError on shapes wgmma cannot take."""
    page_size, head_dim, dtype = bucket.page_size, bucket.head_dim, bucket.dtype
    block_kv = _block_kv(page_size, dtype, sizes)
    if reason := _shape_refusal(bucket.group, page_size, head_dim, dtype, block_kv):
        raise NotImplementedError(reason)
    block_tokens, rows = tuning.gpu_query_block(
        bucket.num_tokens, bucket.num_slots, bucket.group, _ROWS
    )
    num_items = common.max_work_items(bucket.num_tokens, bucket.num_slots, block_tokens)
    max_blocks = pl.cdiv(bucket.pages_per_seq * page_size, block_kv)
    splits = common.num_kv_splits(num_items * bucket.num_kv_heads, max_blocks, sizes)
    stages = max(2, min(sizes.num_stages, max_blocks))
    # Fewer stages where the SMEM buffers would not fit (big pages make big key blocks).
    while stages > 2 and _smem_bytes(block_kv, head_dim, dtype, stages, splits) > _SMEM_BYTES:
        stages -= 1
    if reason := _smem_refusal(block_kv, head_dim, dtype, stages, splits):
        raise NotImplementedError(reason)
    return gpu_common.LaunchShape(
        block_tokens=block_tokens,
        rows=rows,
        num_items=num_items,
        block_kv=block_kv,
        splits=splits,
        stages=stages,
    )


def _block_kv(page_size: int, dtype, sizes: tuning.GpuBlockSizes) -> int:
    """Keys per pipelined block: the tuning row's, at least one page and one swizzle tile of P."""
    # wgmma's K dimension (keys, in the PV product) comes in whole 128-byte tiles: 64 bf16, 32 f32.
    return max(sizes.kv_tokens, 128 // jnp.dtype(dtype).itemsize, page_size)


def _shape_refusal(group: int, page_size: int, head_dim: int, dtype, block_kv: int) -> str | None:
    """Why wgmma or the SMEM tiling cannot take this shape (bucket-independent), or None."""
    dtype = jnp.dtype(dtype)
    if group > _ROWS:
        return f"The Mosaic GPU kernel needs group={group} <= {_ROWS} (one tile)."
    row_bytes = head_dim * dtype.itemsize
    if row_bytes % _MIN_SWIZZLE or head_dim > _MAX_WGMMA_N:
        return (
            f"The Mosaic GPU kernel needs head_dim={head_dim} at most {_MAX_WGMMA_N} and a "
            f"multiple of {_MIN_SWIZZLE // dtype.itemsize} for {dtype.name} (rows of a multiple "
            f"of {_MIN_SWIZZLE} bytes: wgmma takes no unswizzled tile)."
        )
    min_block = 128 // dtype.itemsize
    if block_kv % page_size or block_kv % min_block or page_size % 8:
        return (
            f"The Mosaic GPU kernel needs page_size={page_size} a multiple of 8 dividing a key "
            f"block of {block_kv} keys, itself a multiple of {min_block} for {dtype.name}."
        )
    if block_kv > _MAX_WGMMA_N:
        return (
            f"The Mosaic GPU kernel needs key blocks of at most {_MAX_WGMMA_N} keys (wgmma's N), "
            f"but page_size={page_size} makes them {block_kv}."
        )
    return None


def _smem_refusal(block_kv: int, head_dim: int, dtype, stages: int, splits: int) -> str | None:
    """Why the SMEM buffers of this launch do not fit the budget, or None."""
    need = _smem_bytes(block_kv, head_dim, dtype, stages, splits)
    if need <= _SMEM_BYTES:
        return None
    return (
        f"The Mosaic GPU kernel's buffers need {need} bytes of SMEM with block_kv={block_kv}, "
        f"head_dim={head_dim}, {stages} stages and {splits} key splits, more than the "
        f"{_SMEM_BYTES} it budgets."
    )


def _smem_bytes(block_kv: int, head_dim: int, dtype, stages: int, splits: int) -> int:
    """SMEM the kernel's scratch takes: q, K and V slots, P, the output tile and split stats."""
    size = jnp.dtype(dtype).itemsize
    out_size = size if splits == 1 else 4
    stats = 0 if splits == 1 else 2 * _ROWS * 4
    return (
        _ROWS * head_dim * size
        + 2 * stages * block_kv * head_dim * size
        + _ROWS * block_kv * size
        + _ROWS * head_dim * out_size
        + stats
    )


def _gather_tokens(
    tiles: jax.Array,  # [num_items, num_kv_heads, rows, D] one tile per work item
    item_start: jax.Array,  # i32[num_items]; -1: unused
    num_tokens: int,
    group: int,
) -> jax.Array:  # [T, num_kv_heads * group, D]
    """Each token's `group` rows from its work item's tile (the inverse of the kernel's split).

    A token's item is the last used item starting at or before it; padding tokens get some
    item's rows, zeroed by the caller.
    """
    starts = jnp.where(item_start >= 0, item_start, jnp.iinfo(jnp.int32).max)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    item = jnp.maximum(jnp.searchsorted(starts, t, side="right") - 1, 0).astype(jnp.int32)
    first_row = (t - starts[item]) * group
    row = jnp.clip(first_row[:, None] + jnp.arange(group, dtype=jnp.int32), 0, tiles.shape[2] - 1)
    out = tiles[item[:, None, None], jnp.arange(tiles.shape[1])[None, :, None], row[:, None, :]]
    return out.reshape(num_tokens, tiles.shape[1] * group, tiles.shape[3])


def _launch(call: gpu_common.Call) -> jax.Array:  # [T, num_heads, head_dim], q.dtype
    """The reference's attention as a Pallas Mosaic GPU kernel (conventions in reference.py).

    `block_sizes` defaults to this device kind's row of `tuning.GPU_TABLE` (its q_rows is ignored:
    a program's query tile is one wgmma's 64 rows); `compute_capability` is not read (the kernel
    targets 9.x only: kernel_choice.py asks `supports` first). `interpret=interpret_params()`
    runs the kernel on the CPU in Mosaic GPU interpret mode, for tests.
    """
    bucket, q = call.bucket, call.q
    num_tokens, num_kv_heads, group = bucket.num_tokens, bucket.num_kv_heads, bucket.group
    head_dim, dtype = bucket.head_dim, bucket.dtype
    interpret = None if call.interpret in (None, False) else call.interpret
    if common.is_quantized(dtype):  # interpret mode too: it would read the bytes unscaled
        raise ValueError(
            f"The Mosaic GPU kernel cannot read a {dtype.name} KV pool (--kv-cache-dtype "
            "int8/fp8): its wgmma path takes 16-bit pools. The Triton kernel "
            "(attention_backend 'pallas_gpu' or 'pallas_gpu_triton') and 'xla' dequantize "
            "8-bit pages."
        )
    if interpret is None and not supports_dtype(dtype):
        raise NotImplementedError(
            f"The Mosaic GPU kernel runs 16-bit pools only (wgmma cannot take an f32 K^T), got "
            f"{dtype.name}; gpu_kernel (Triton) serves f32 pools."
        )
    shape = launch_shape(bucket, call.block_sizes)
    block_tokens, rows, num_items = shape.block_tokens, shape.rows, shape.num_items
    block_kv, splits, stages = shape.block_kv, shape.splits, shape.stages
    pages_per_block = block_kv // bucket.page_size
    # Padded so the last item's rows stay in bounds (zeros past the last token).
    padded_tokens = num_tokens + block_tokens
    # wgmma takes one dtype for both operands: q in the pool's.
    q_grouped = common.group_queries(q.astype(dtype), num_kv_heads, padded_tokens)
    item_seq, item_start = common.work_items(
        call.query_start, call.num_seqs, block_tokens, num_items
    )
    # Each item's `rows` rows in a tile of its own, [num_kv_heads, W, rows, D], so that its TMA
    # copy starts on a whole tile (see the module's docstring); unused items read rows 0.
    first_row = jnp.maximum(item_start, 0) * group
    q_tiles = q_grouped[:, first_row[:, None] + jnp.arange(rows, dtype=jnp.int32)]

    tile = (num_items, num_kv_heads, rows)
    kv_transforms = _smem_transforms(head_dim, dtype)
    scratch = [
        plgpu.SMEM((_ROWS, head_dim), dtype, transforms=kv_transforms),
        plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=kv_transforms),
        plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=kv_transforms),
        plgpu.SMEM(
            (_ROWS, block_kv),
            dtype,
            transforms=_smem_transforms(block_kv, dtype, _p_swizzle(block_kv, head_dim, dtype)),
        ),
    ]
    if splits == 1:
        out_type = [jax.ShapeDtypeStruct((*tile, head_dim), dtype)]
        scratch.append(plgpu.SMEM((_ROWS, head_dim), dtype, transforms=kv_transforms))
    else:
        f32_transforms = _smem_transforms(head_dim, jnp.float32)
        out_type = [
            jax.ShapeDtypeStruct((splits, *tile, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((splits, *tile), jnp.float32),
            jax.ShapeDtypeStruct((splits, *tile), jnp.float32),
        ]
        scratch += [
            plgpu.SMEM((_ROWS, head_dim), jnp.float32, transforms=f32_transforms),
            plgpu.SMEM((_ROWS,), jnp.float32),
            plgpu.SMEM((_ROWS,), jnp.float32),
        ]
    scratch += [
        # One arrival per page copy: a block is in when all its pages are.
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),
        plgpu.Barrier(num_barriers=1),
    ]
    program = gpu_common.Program.of(call, shape)
    body = functools.partial(
        _kernel, program=program, stages=stages, interpreted=interpret is not None
    )

    def kernel_body(*refs):  # inputs and outputs; the scratch is allocated here
        pl.run_scoped(functools.partial(body, *refs), *scratch)

    # pl.kernel on a Mosaic GPU mesh is what plgpu.kernel wraps; called directly because
    # plgpu.kernel takes no cost estimate.
    kernel = pl.kernel(
        kernel_body,
        out_type=out_type,
        mesh=plgpu.Mesh(
            grid=(num_items, num_kv_heads, splits), grid_names=("item", "head", "split")
        ),
        interpret=interpret,
        cost_estimate=gpu_common.cost_estimate(shape, bucket, call.sliding_window, _ROWS),
        name="ragged_paged_attention_mosaic_gpu",
    )
    outs = kernel(*call.scalar_operands(item_seq, item_start), q_tiles, call.kv_pool)
    tiles = outs[0] if splits == 1 else common.merge_splits(*outs)
    out = _gather_tokens(tiles, item_start, num_tokens, group).astype(q.dtype)
    # Rows of no work item (padding) hold another item's rows: zero them.
    return jnp.where(call.real_rows()[:, None, None], out, jnp.zeros((), out.dtype))


ragged_paged_attention = gpu_common.entry_point(_launch)
