"""Ragged paged attention as a Pallas Mosaic TPU kernel, with the reference's signature.

Grid and data movement
- The grid runs over blocks of query tokens (`block_tokens` consecutive rows of the flattened
  batch, whatever sequences they belong to) and blocks of KV heads (`heads_per_block`; all of them
  unless VMEM is short). Queries arrive grouped, [num_kv_heads, rows, D] with the `group` query
  heads of a KV head on consecutive rows, so a block is one VMEM tile per KV head.
- Scalars ride in SMEM by scalar prefetch: the layer, query_start, kv_lens, the flattened page
  tables, and per block the first and last sequence it holds (computed by XLA beforehand, a
  searchsorted over query_start).
- The pool stays in HBM (`pl.ANY`). It is one array, [layers, pages, page_size, lanes], each
  token's keys and values side by side in the minor dimension (head h's keys at lanes
  [2hD, 2hD + D), its values right after: common.fuse_kv). For every head_dim of 64 and up that
  is a multiple of 128 lanes, so XLA:TPU keeps its default row-major layout with no padding (the
  5-d [.., heads, head_dim] pool it replaced was laid out pages-minor whenever head_dim was 64,
  and every step copied the whole pool into row-major for this kernel and back), and a page is
  one contiguous DMA of keys and values. A grid step walks its sequences in order and each
  sequence's key blocks (`pages_per_block` pages) in order, as one flat loop; pages (the step's
  KV heads of them) are copied by DMA from `pool[layer, page]` (the layer indexed inside the
  kernel, so no layer slice of the pool is ever materialised) into one of two VMEM buffers, the
  next block's copy starting before this block is computed (double buffering, across sequence
  boundaries too). Only pages that hold keys some query of the block can see are copied.
- Each key block is copied once in VMEM to heads-first, [heads, keys, 2D] (a static lane slice
  per head), and a loop over the heads (not unrolled) then reads each head's keys and values as
  plain slabs. Mosaic cannot read the lane dimension at a traced offset, and an unrolled loop of
  the attention itself gives every head its own VMEM for temporaries and compile time (14 s
  against 2 s for 32 f32 heads on v6e, measured).
- Softmax is online (flash attention): running max, sum and f32 accumulator per query row live in
  VMEM scratch across the loop; rows of other sequences are masked out of each block, so a block
  that mixes decode tokens of many sequences still reads each sequence's pages once per block.
- Causality is per token: query t of a q_len chunk of sequence s sits at kv_lens[s] - q_len + i.

Why the new keys and values are not written here: `write_kv` scatters them into the pool with
XLA before attention runs, and that is the better tool. The write is T * num_kv_heads * D
elements, tiny beside what attention reads, and with the pool donated XLA does it in place.
Fusing it would make the pool an aliased output of every layer's kernel and would order writes
against reads across grid steps: a prefill chunk split over two query blocks has the second block
read keys the first block's tokens write, which "parallel" grid semantics (both TensorCores of a
v4/v5p chip) do not order. Keeping the write outside keeps the grid parallel and the kernel
read-only.

Block sizes are planned for an explicit chip (`chip`, a generation or device kind; see
`tuning.plan_tpu_blocks`): the KV heads, query rows and pages per grid step shrink until a step's
VMEM, padded to TPU tiles and with the kernel's temporaries, fits that chip's scoped limit, which
is raised above the compiler's default where the chip has the VMEM.

Not yet run on a TPU (written and tested in interpret mode on the CPU, and compiled ahead of time
for v4/v5e/v5p/v6e/TPU7x by tests/kernels/test_tpu_aot.py): what to measure on hardware first is
the cost of the per-block transpose and of head-sliced DMAs when the KV heads are split.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import common, tuning

# A finite "minus infinity", as in the reference: a row with no visible key keeps max -1e30 and
# sum 0 instead of turning into inf - inf = NaN.
_MASKED = -1e30


def _when(cond: jax.Array, *fns) -> None:
    """Calls each of `fns` (DMA starts or waits) in a branch taken when `cond` holds."""

    @pl.when(cond)
    def _():
        for fn in fns:
            fn()


def _kernel(
    # Scalar prefetch (SMEM).
    layer_ref,  # i32[1]
    query_start_ref,  # i32[S + 1]
    kv_lens_ref,  # i32[S]
    page_tables_ref,  # i32[S * P]: flat, since a 2-d SMEM array is padded to whole tiles
    first_seq_ref,  # i32[num_blocks] first sequence with rows in each query block
    last_seq_ref,  # i32[num_blocks] last one; < first_seq for a block of padding only
    # Inputs.
    q_ref,  # [heads, rows, D] VMEM: this block's queries, grouped (heads: KV heads per block)
    kv_hbm,  # [num_layers, num_pages, page_size, lanes] HBM: keys and values (common.fuse_kv)
    # Output.
    o_ref,  # [heads, rows, D] VMEM
    # Scratch.
    kv_buf,  # [2, pages_per_block, page_size, block_lanes] VMEM: double buffer of this step's
    #          heads' lanes of each page (all of the page's lanes when the step has every head)
    sems,  # DMA semaphores [2 (buffer)]
    m_ref,  # f32[heads, rows, 1] running max
    l_ref,  # f32[heads, rows, 1] running sum
    acc_ref,  # f32[heads, rows, D] running numerator
    kv_heads,  # [heads, pages_per_block * page_size, 2 * D] VMEM: the key block, heads first
    *,
    sm_scale: float,
    sliding_window: int | None,
    group: int,
    block_tokens: int,
    pages_per_seq: int,
):
    block = pl.program_id(0)
    _, pages_per_block, page_size, block_lanes = kv_buf.shape
    quantized = common.is_quantized(kv_buf.dtype)  # 8-bit pages with scale lanes
    block_heads, _, head_dim = q_ref.shape  # KV heads of this step
    # This step's heads' lanes of the pool: all of them, or a slice (a strided DMA of each page).
    lane_slice = (
        slice(None)
        if block_lanes == kv_hbm.shape[3]
        else pl.ds(pl.program_id(1) * block_lanes, block_lanes)
    )
    rows = q_ref.shape[1]
    block_kv = pages_per_block * page_size
    q_lo = block * block_tokens  # first token of this block
    first, last = first_seq_ref[block], last_seq_ref[block]

    def span(s):
        """Sequence s within this block: its tokens [t_lo, t_hi), the keys they see."""
        q_start, q_end = query_start_ref[s], query_start_ref[s + 1]
        t_lo = jnp.maximum(q_start, q_lo)
        t_hi = jnp.minimum(q_end, q_lo + block_tokens)
        pos_offset = kv_lens_ref[s] - q_end  # token t sits at position t + pos_offset
        kv_end = t_hi + pos_offset  # one past the last token's position
        kv_start = 0
        if sliding_window is not None:
            kv_start = jnp.maximum(0, t_lo + pos_offset - sliding_window + 1)
        return t_lo, t_hi, pos_offset, kv_start, kv_end

    def kv_blocks(s):
        t_lo, t_hi, _, kv_start, kv_end = span(s)
        # kv_start >= 0, so truncating division is floor division. (jnp's `//` on a traced int
        # lowers through sign(), whose Mosaic rule reads the local device's TPU generation, so
        # ahead-of-time compilation from a CPU host fails with it.)
        lo = lax.div(jnp.asarray(kv_start, jnp.int32), jnp.int32(block_kv))
        return lo, jnp.where(t_hi > t_lo, pl.cdiv(kv_end, block_kv), lo)

    def copies(s, j, slot):
        """The DMAs of key block j of sequence s into buffer `slot`: (needed, copy) per page, one
        copy moving the page's keys and values together."""
        _, _, _, kv_start, kv_end = span(s)
        layer = layer_ref[0]
        out = []
        for p in range(pages_per_block):
            index = j * pages_per_block + p
            page = page_tables_ref[s * pages_per_seq + jnp.minimum(index, pages_per_seq - 1)]
            copy = pltpu.make_async_copy(
                kv_hbm.at[layer, page, :, lane_slice], kv_buf.at[slot, p], sems.at[slot]
            )
            # Pages wholly before a sliding window may have been recycled: never read them.
            needed = (index * page_size < kv_end) & ((index + 1) * page_size > kv_start)
            out.append((needed, copy))
        return out

    def start_fetch(s, j, slot):
        for needed, copy in copies(s, j, slot):
            _when(needed, copy.start)

    def wait_fetch(s, j, slot):
        for needed, copy in copies(s, j, slot):
            _when(needed, copy.wait)

    def advance(s, j):
        """The key block after (s, j): the next one of s, else the first of the next sequence."""
        hi = kv_blocks(s)[1]

        def is_empty(t):
            t_safe = jnp.minimum(t, last)  # `&` does not short-circuit: keep reads in bounds
            return (t <= last) & (query_start_ref[t_safe + 1] <= query_start_ref[t_safe])

        s_next = lax.while_loop(is_empty, lambda t: t + 1, s + 1)
        j_next = kv_blocks(jnp.minimum(s_next, last))[0]
        stay = j + 1 < hi
        return jnp.where(stay, s, s_next), jnp.where(stay, j + 1, j_next)

    def compute(s, j, slot):
        t_lo, t_hi, pos_offset, kv_start, kv_end = span(s)
        # Row r holds token q_lo + r // group; compare r with multiples of group instead of
        # dividing, since vector integer division is slow or missing on the VPU.
        r = lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0)
        c = j * block_kv + lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)  # key position
        mask = (r >= (t_lo - q_lo) * group) & (r < (t_hi - q_lo) * group)
        mask &= (c - pos_offset - q_lo) * group <= r  # causal: c <= position of the row's token
        if sliding_window is not None:
            mask &= (c - pos_offset - q_lo + sliding_window) * group > r
        # Keys past kv_end were not fetched this block (stale buffer) or are unwritten slots:
        # zero their values, since a masked probability of 0 times NaN is still NaN.
        c_col = j * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
        visible = (c_col >= kv_start) & (c_col < kv_end)
        precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

        # Heads first, once per key block (see the module docstring): static lane slices.
        if quantized:
            # 8-bit pages: the scale exponents end each row (common.fuse_kv). The last lane tile
            # of the block holds them all; each head's two exponents are picked out of it by a
            # masked lane sum (a [keys, 1] column), and its keys and values dequantized here,
            # once per key block, into the heads-first copy in q's dtype.
            width = min(common.LANES, block_lanes)
            tail = kv_buf[slot, :, :, pl.ds(block_lanes - width, width)].astype(jnp.float32)
            tail = tail.reshape(block_kv, width)
            lane = lax.broadcasted_iota(jnp.int32, (block_kv, width), 1)
            half = lax.broadcasted_iota(jnp.int32, (block_kv, 2 * head_dim), 1) < head_dim

            def scale(index):
                exps = jnp.sum(jnp.where(lane == index, tail, 0.0), axis=1, keepdims=True)
                return common.pow2(exps.astype(jnp.int32))  # [block_kv, 1]

        for h in range(block_heads):
            rows_kv = kv_buf[slot, :, :, pl.ds(2 * h * head_dim, 2 * head_dim)]
            if quantized:
                first = width - 2 * block_heads + 2 * h  # head h's key exponent in `tail`
                factor = jnp.where(half, scale(first), scale(first + 1))
                rows_kv = rows_kv.astype(jnp.float32).reshape(block_kv, 2 * head_dim) * factor
                kv_heads[h] = rows_kv.astype(kv_heads.dtype)
            else:
                kv_heads[h] = rows_kv.reshape(block_kv, 2 * head_dim)

        @pl.loop(0, block_heads)
        def _(h):
            q = q_ref[h]  # [rows, D]
            k = kv_heads[h, :, pl.ds(0, head_dim)]  # [block_kv, D]
            v = kv_heads[h, :, pl.ds(head_dim, head_dim)]
            v = jnp.where(visible, v, jnp.zeros((), v.dtype))
            scores = lax.dot_general(
                q,
                k,
                (((1,), (1,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            scores = jnp.where(mask, scores * sm_scale, _MASKED)
            m_prev = m_ref[h]
            m_next = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))
            probs = jnp.where(mask, jnp.exp(scores - m_next), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            m_ref[h] = m_next
            l_ref[h] = alpha * l_ref[h] + probs.sum(axis=1, keepdims=True)
            pv = lax.dot_general(
                probs.astype(v.dtype),
                v,
                (((1,), (0,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            acc_ref[h] = alpha * acc_ref[h] + pv

    m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # The first sequence of a block has rows in it (see _block_sequences), so it is never empty.
    j_first = kv_blocks(first)[0]

    @pl.when(first <= last)
    def _():
        start_fetch(first, j_first, 0)

    def body(carry):
        s, j, slot = carry
        s_next, j_next = advance(s, j)

        @pl.when(s_next <= last)
        def _():
            start_fetch(s_next, j_next, 1 - slot)

        wait_fetch(s, j, slot)
        compute(s, j, slot)
        return s_next, j_next, 1 - slot

    lax.while_loop(lambda carry: carry[0] <= last, body, (first, j_first, jnp.int32(0)))

    @pl.loop(0, block_heads)
    def _(h):
        denom = l_ref[h]
        # Rows of no sequence (padding) kept a sum of 0 and acc = 0: they output 0.
        o_ref[h] = (acc_ref[h] / jnp.where(denom > 0, denom, 1.0)).astype(o_ref.dtype)


def _block_sequences(
    query_start: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[]
    block_tokens: int,
    num_blocks: int,
) -> tuple[jax.Array, jax.Array]:  # i32[num_blocks] each
    """First and last sequence with rows in each query block (last < first: padding only)."""
    num_slots = query_start.shape[0] - 1
    total = query_start[num_seqs]
    lo = jnp.arange(num_blocks, dtype=jnp.int32) * block_tokens
    hi = jnp.minimum(lo + block_tokens, total)  # one past the block's last real row
    ends = query_start[1:]
    first = jnp.searchsorted(ends, lo, side="right").astype(jnp.int32)
    last = jnp.searchsorted(ends, hi - 1, side="right").astype(jnp.int32)
    last = jnp.minimum(last, num_seqs - 1)
    # Clamped so that even a padding block reads its first sequence's scalars in bounds.
    first = jnp.minimum(first, num_slots - 1)
    return first, jnp.where(lo < total, last, -1)


def _cost_estimate(
    *,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    num_slots: int,
    num_blocks: int,
    block_tokens: int,
    block_kv: int,
    sliding_window: int | None,
    q_dtype,
    kv_dtype,
) -> pl.CostEstimate:
    """What the kernel costs XLA's scheduler, as an upper bound from the static shapes.

    The lengths (query_start, kv_lens) are dynamic, so the counts take every query token to
    attend the longest context a page table holds (pages_per_seq * page_size keys, or the sliding
    window if that is smaller): 2 * D FLOPs per query head and key for QK^T and as many for PV, one
    exp per score. Keys read: each (query block, sequence) pair reads that sequence's context
    once, and there are at most min(num_tokens, num_blocks * num_slots) such pairs; with a window,
    a pair reads at most the window, the block's tokens and a key block of slack at each end.
    """
    context = pages_per_seq * page_size
    keys_attended = context if sliding_window is None else min(context, sliding_window)
    keys_read = context
    if sliding_window is not None:
        keys_read = min(context, sliding_window + block_tokens + 2 * block_kv)
    pairs = min(num_tokens, num_blocks * num_slots)
    q_bytes = num_tokens * num_heads * head_dim * jnp.dtype(q_dtype).itemsize
    kv_bytes = 2 * pairs * keys_read * num_kv_heads * head_dim * jnp.dtype(kv_dtype).itemsize
    return pl.CostEstimate(
        flops=4 * num_tokens * num_heads * keys_attended * head_dim,
        transcendentals=num_tokens * num_heads * keys_attended,
        bytes_accessed=2 * q_bytes + kv_bytes,  # q in, out, keys and values
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "num_kv_heads",
        "sliding_window",
        "block_sizes",
        "chip",
        "interpret",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    kv_pool: jax.Array,  # [num_layers, num_pages, page_size, lanes]: common.fuse_kv's layout
    layer: jax.Array,  # i32[] which layer of the pool to read
    query_start: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    page_tables: jax.Array,  # i32[S, P]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    num_kv_heads: int | None = None,  # None: the pool's lanes hold exactly its heads (no padding)
    sliding_window: int | None = None,
    block_sizes: tuning.TpuBlockSizes | None = None,
    chip: str | None = None,
    interpret: pltpu.InterpretParams | bool = False,
) -> jax.Array:  # [T, num_heads, head_dim], q.dtype
    """The reference's attention as a Mosaic TPU kernel (conventions in reference.py).

    `chip` is the TPU the kernel is compiled for: a generation ("v5e") or a device kind ("TPU v5
    lite"), see `pallas_kernels.chips`. Pass it whenever the target is known, and always when
    compiling ahead of time for a topology (`functools.partial(ragged_paged_attention,
    chip=device.device_kind)`); None takes the default backend's TPU, or `tuning.INTERPRET_CHIP`
    off a TPU. `block_sizes` replaces the chip's `tuning.TPU_TABLE` row as the target blocks,
    which are then shrunk to fit the chip's VMEM (ValueError, naming the shape and chip, if
    nothing fits). `interpret` runs the kernel on the CPU (`pltpu.InterpretParams()`), for tests.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = common.kv_heads_of(kv_pool, head_dim, num_kv_heads)
    common.check_args(q, kv_pool, num_kv_heads, query_start, kv_lens, page_tables, sliding_window)
    _, _, page_size, lanes = kv_pool.shape
    num_slots, pages_per_seq = page_tables.shape
    group = num_heads // num_kv_heads
    plan = tuning.plan_tpu_blocks(
        num_tokens=num_tokens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        q_dtype=q.dtype,
        kv_dtype=kv_pool.dtype,
        lanes=lanes,
        chip=chip,
        block_sizes=block_sizes,
    )
    block_tokens, rows, heads = plan.block_tokens, plan.rows, plan.heads_per_block
    pages_per_block = plan.pages_per_block
    quantized = common.is_quantized(kv_pool.dtype)
    if quantized and heads != num_kv_heads:  # plan_tpu_blocks keeps them together
        raise AssertionError(f"{heads=} of {num_kv_heads} KV heads per step of a quantized pool")
    # Every head: the page's whole minor dim (padding lanes too), one contiguous DMA per page.
    block_lanes = lanes if heads == num_kv_heads else 2 * heads * head_dim
    num_blocks = pl.cdiv(num_tokens, block_tokens)
    # Padded to whole blocks so that the last block's tile is in bounds; padding rows output 0.
    q_grouped = common.group_queries(q, num_kv_heads, num_blocks * block_tokens)
    first_seq, last_seq = _block_sequences(query_start, num_seqs, block_tokens, num_blocks)

    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        group=group,
        block_tokens=block_tokens,
        pages_per_seq=pages_per_seq,
    )
    q_spec = pl.BlockSpec((heads, rows, head_dim), lambda i, h, *_: (h, i, 0))
    buf = pltpu.VMEM((2, pages_per_block, page_size, block_lanes), kv_pool.dtype)
    stats = pltpu.VMEM((heads, rows, 1), jnp.float32)
    cost = _cost_estimate(
        num_tokens=num_tokens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        num_slots=num_slots,
        num_blocks=num_blocks,
        block_tokens=block_tokens,
        block_kv=pages_per_block * page_size,
        sliding_window=sliding_window,
        q_dtype=q.dtype,
        kv_dtype=kv_pool.dtype,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(num_blocks, num_kv_heads // heads),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                buf,
                pltpu.SemaphoreType.DMA((2,)),
                stats,
                stats,
                pltpu.VMEM((heads, rows, head_dim), jnp.float32),
                # Dequantized keys and values (q's dtype) where the pool is 8-bit.
                pltpu.VMEM(
                    (heads, pages_per_block * page_size, 2 * head_dim),
                    q.dtype if quantized else kv_pool.dtype,
                ),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_grouped.shape, q.dtype),
        # Each grid step fetches its own pages and keeps no state for the next: parallel, so
        # chips with two TensorCores in one device (v4, v5p) split the grid.
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"),
            vmem_limit_bytes=plan.vmem_limit_bytes,
        ),
        cost_estimate=cost,
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        query_start.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        page_tables.reshape(num_slots * pages_per_seq).astype(jnp.int32),
        first_seq,
        last_seq,
        q_grouped,
        kv_pool,
    )
    return common.ungroup_outputs(out, num_tokens, group)
