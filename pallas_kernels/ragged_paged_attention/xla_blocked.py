"""Ragged paged attention in plain jnp whose cost is the real work: the CPU's production path.

The dense reference gathers every row's whole page table, so a prefill chunk of T tokens reads its
context T times and a decode step at context 100 costs as much as one at max_model_len. Here the
work is split the way a kernel splits it (`attention_backend="xla"`, and `auto` on the CPU):

- Prefill chunks (sequences with more than one query this step) are cut into query tiles of
  `_TILE_ROWS` rows, each inside one sequence. A `while_loop` runs over the step's real tiles and,
  inside it, another over that tile's key blocks only: from the sliding window's first block to
  the block of the tile's last query (causal), so each key block is read once per (sequence,
  query tile) and a sequence stops at its own context. GQA: the query heads of one KV head form
  one matmul against that head's keys (no repeat of K or V).
- Decode sequences (one query) would waste a whole tile each, so they run together: one batched
  loop over key blocks of every sequence slot at once, up to the longest decoding context. Past a
  row's own context its block reads point at page 0 (cache-hot) and are masked.

The tile list and the decode rows (`StepPlan`) depend only on the step's batch, so the model makes
them once per step (`plan_step`, before the layer loop) and every layer reuses them.

Chosen by measurement: the per-row gather it replaced against this, both jitted in one process,
best of 5, one layer of smollm2-135m's attention (9 heads, 3 KV heads, head_dim 64, pages of 16,
256-page tables), f32, on the 2-core CPU while other jobs ran (load ~11, so ratios, not times):
  decode, 64 sequences at context 280-320:     60-170 ms -> 26-63 ms   (2.3-2.7x)
  prefill, one 512-token prompt:               930-1540 ms -> 17-25 ms (38-73x)
  a 448-token chunk at context 1000 + 64 decodes: 1.9-2.5 s -> 68-105 ms (18-36x)
Tile sizes: a 512-token prompt alone runs about as fast at any size from 32x128 to 256x512, but
the short prompts of serving traffic (16-128 tokens) waste most of a large tile, rows and keys
both. 64 rows x 128 keys, against the 128 x 256 it replaced, whole prefill steps of 512 tokens
compiled in one process and timed interleaved (2026-12-01, idle 2-core CPU), tiny / small:
8 prompts of 64 tokens 0.62 / 0.80x, 16 of 32 0.56 / 0.69x, 4 of 128 0.79 / 0.85x, one of 511
0.97 / 0.98x, a 488-token chunk at context 512 1.00 / 0.97x. 64 x 64 was faster still on `tiny`
but 1.04x on `small`'s long chunk; 64 x 128 was never slower.
Decode blocks: 16 or 32 keys ran 2-6x faster than 128 or 256 (the gathered
block stays in cache between the gather and its two matmuls), and 32 halves the trips of 16; a
step with one sequence slot takes 128-key blocks (`_DECODE_KEYS_ONE_SEQ`), fewer trips for
blocks that stay small.

Most of a decode block's time is the gather of its K and V pages fused with a transpose into the
matmuls' batch-major layout ([S, kv head, d, keys] for K). Formulations that avoid that transpose
were slower still, each against this loop in one process (one layer of smollm2-135m, S = 1, 16
and 64 at context 140-300, CPU-seconds, loaded machine), so none replaced it: multiply-and-sum
scores and PV with no matmul (1.1-1.6x slower at S >= 16), one matmul over all heads with K as
the left operand and cross-head scores masked (1.2-1.5x), K @ q^T per KV head keeping d minor
(1.4-1.6x), a 2D row gather of whole pages (1.1-1.2x; 1.8x faster alone, not once fused), and
blocks of 16, 64 or 128 keys under each of them. Beware when trying more: XLA:CPU 0.10.2 (YNN
fusions) miscompiled the multiply-and-sum form when q was reshaped [S, H, d] -> [S, Hkv, g, d]
inside the fusion (every head but the first of each group wrong; right under disable_jit).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import common, cpu_ffi

# Query rows per prefill tile: big enough for a real matmul against each key block, small enough
# that a short chunk or the causal diagonal wastes little (module docstring: measured). A step of
# fewer tokens takes tiles of its own size (`_tile_rows`).
_TILE_ROWS = 64
# Keys per block of the prefill loop.
_TILE_KEYS = 128
_DECODE_KEYS = 32
# Keys per block of the decode loop when the step has one sequence slot (a batch-1 decode
# bucket): there a block is too small for its gather to matter and the loop's fixed cost per
# trip (~15 small thunks) is most of the attention. Measured in smollm2-135m's batch-1 decode step
# (compiled in one process, interleaved medians, shared 2-core machine), step time over that with
# 32-key blocks: context 144 0.99x, 300 0.82x, 600 0.81x, 900 0.75x; 256-key blocks 0.85x and
# 0.83x at 300 and 900.
_DECODE_KEYS_ONE_SEQ = 128
# A finite "minus infinity": a row with no visible key in a block adds exp(0) * (zeroed V) there,
# which the first block with a visible key rescales away (its max is far above -1e30).
_MASKED = -1e30


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Per-step work list of the tiled attention, the same for every layer of the step."""

    tile_seq: jax.Array  # i32[NT] sequence of each query tile (padding tiles: 0, never run)
    tile_start: jax.Array  # i32[NT] first query row of each tile
    tile_rows: jax.Array  # i32[NT] real rows of each tile, 1.._tile_rows(T) (padding tiles: 0)
    num_tiles: jax.Array  # i32[] tiles to run; tiles [num_tiles, NT) are padding
    decode_rows: jax.Array  # i32[S] query row of each decoding sequence; T (scratch) otherwise
    decode_kv_max: jax.Array  # i32[] longest context among decoding sequences (0: none)


jax.tree_util.register_dataclass(
    StepPlan, data_fields=[f.name for f in dataclasses.fields(StepPlan)], meta_fields=[]
)


def _tile_rows(num_tokens: int) -> int:
    """Query rows per prefill tile in a step of `num_tokens` (static): _TILE_ROWS, or the step's
    own size where that is smaller. A chunk never has more rows than its step, so a small step's
    chunks still take one tile each, without the padded rows: a speculative verification (a
    chunk of k + 1 tokens in a small bucket) ran 64 rows for its 5, and on the embedded model
    that padding was most of the step (docs/benchmarks.md, "Speculative decoding")."""
    return min(_TILE_ROWS, max(num_tokens, 1))


def plan_step(
    num_tokens: int,
    query_start: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    num_seqs: jax.Array,  # i32[]
) -> StepPlan:
    """The tile list and decode rows of one step (jnp, O(S + T / _TILE_ROWS)); see the module."""
    num_slots = kv_lens.shape[0]
    tile_rows = _tile_rows(num_tokens)
    q_lens = query_start[1:] - query_start[:-1]
    real = jnp.arange(num_slots) < num_seqs
    is_decode = real & (q_lens == 1)
    tiles_per_seq = jnp.where(real & (q_lens > 1), -(-q_lens // tile_rows), 0)
    tiles_end = jnp.cumsum(tiles_per_seq)  # exclusive prefix: tiles_end - tiles_per_seq
    # Each prefill sequence has >= 2 rows and wastes < 1 tile, so this bounds the real tiles.
    max_tiles = min(-(-num_tokens // tile_rows) + num_slots, max(num_tokens // 2, 1))
    tile = jnp.arange(max_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tiles_end, tile, side="right"), num_slots - 1)
    start = query_start[seq] + (tile - (tiles_end[seq] - tiles_per_seq[seq])) * tile_rows
    num_tiles = tiles_end[-1]
    rows = jnp.where(tile < num_tiles, jnp.minimum(query_start[seq + 1] - start, tile_rows), 0)
    return StepPlan(
        tile_seq=seq.astype(jnp.int32),
        tile_start=start.astype(jnp.int32),
        tile_rows=rows.astype(jnp.int32),
        num_tiles=num_tiles.astype(jnp.int32),
        decode_rows=jnp.where(is_decode, query_start[:-1], num_tokens).astype(jnp.int32),
        decode_kv_max=jnp.max(jnp.where(is_decode, kv_lens, 0)).astype(jnp.int32),
    )


def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    kv_pool: jax.Array,  # [num_layers, num_pages, page_size, lanes] (common.fuse_kv)
    layer: jax.Array,  # i32[]
    query_start: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    page_tables: jax.Array,  # i32[S, P]
    num_seqs: jax.Array,  # i32[]
    plan: StepPlan | None = None,  # plan_step(T, query_start, kv_lens, num_seqs); made if None
    *,
    sm_scale: float,
    num_kv_heads: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [T, num_heads, head_dim], q.dtype
    """Same contract as reference.ragged_paged_attention (see its module docstring).

    On the CPU in float32 with AVX-512, one native call per layer runs every row
    (cpu_ffi.ragged_attention); elsewhere, and on accelerators, the jnp loops below. A
    `soft_cap` (Gemma 2: scores -> soft_cap * tanh(scores / soft_cap)) always takes the jnp
    loops: the native calls have none.
    """
    num_tokens, _, head_dim = q.shape
    num_kv_heads = common.kv_heads_of(kv_pool, head_dim, num_kv_heads)
    args = (q, kv_pool, layer, query_start, kv_lens, page_tables, num_seqs, plan)
    loops = functools.partial(
        _loops,
        sm_scale=sm_scale,
        num_kv_heads=num_kv_heads,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    if soft_cap is not None or not cpu_ffi.ragged_runs_here(q, kv_pool, head_dim):
        return loops(*args)

    def native(q):
        qg = q.reshape(num_tokens, num_kv_heads, -1, head_dim)
        out = cpu_ffi.ragged_attention(
            qg,
            kv_pool,
            layer,
            query_start,
            kv_lens,
            page_tables,
            num_seqs,
            sm_scale,
            sliding_window,
        )
        return out.reshape(q.shape).astype(q.dtype)

    # Chosen when the step is lowered: a step compiled for an accelerator gets the loops.
    return jax.lax.platform_dependent(q, cpu=native, default=lambda q: loops(q, *args[1:]))


def _loops(
    q,
    kv_pool,
    layer,
    query_start,
    kv_lens,
    page_tables,
    num_seqs,
    plan,
    *,
    sm_scale,
    num_kv_heads,
    sliding_window,
    soft_cap=None,
) -> jax.Array:  # [T, num_heads, head_dim], q.dtype
    """The jnp path: the decode rows batched (or cpu_ffi's decode call), the prefill tiles."""
    num_tokens, _, head_dim = q.shape
    if plan is None:
        plan = plan_step(num_tokens, query_start, kv_lens, num_seqs)
    pool = _Pool(kv_pool, layer, page_tables, kv_lens, num_kv_heads, head_dim, q.dtype)
    out = jnp.zeros((num_tokens, *q.shape[1:]), jnp.float32)
    decoded = _decode(q, pool, plan, sm_scale, sliding_window, soft_cap)
    out = out.at[plan.decode_rows].set(decoded, mode="drop")
    if num_tokens == 1:  # static: one token is a decode, never a prefill tile
        return out.astype(q.dtype)

    def prefill(out):
        # Padded by one tile so a tile's slice never runs off the end (dynamic_slice clamps).
        out = jnp.pad(out, ((0, _tile_rows(num_tokens)), (0, 0), (0, 0)))
        out = _prefill_tiles(q, pool, query_start, plan, out, sm_scale, sliding_window, soft_cap)
        return out[:num_tokens]

    # A decode-only step skips the tile loop's set-up as well as the loop: the compiled step
    # otherwise copies its accumulators and padded buffers (~1.5 MB) in every layer: in a
    # profile of a 1-token step of smollm2-135m (unrolled, under load) copies were ~16 of ~56 ms.
    out = jax.lax.cond(plan.num_tiles > 0, prefill, lambda out: out, out)
    return out.astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class _Pool:
    """The pool and what reading a block of it needs (a plain tuple before the pool was fused)."""

    kv: jax.Array  # [num_layers, num_pages, page_size, lanes]
    layer: jax.Array
    page_tables: jax.Array
    kv_lens: jax.Array
    num_kv_heads: int
    head_dim: int
    dtype: jnp.dtype = jnp.float32  # what a quantized pool's blocks are dequantized into (q's)

    @property
    def page_size(self) -> int:
        return self.kv.shape[2]

    def read(self, pages: jax.Array, keys: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values of `pages` [..., n] of the layer: each [..., keys, heads, head_dim]
        (keys = n * page_size), one gather for both; a quantized pool's dequantized."""
        rows = self.kv[self.layer, pages]
        k, v = common.split_kv(rows, self.num_kv_heads, self.head_dim, self.dtype)
        shape = (*pages.shape[:-1], keys, self.num_kv_heads, self.head_dim)
        return k.reshape(shape), v.reshape(shape)


def _block_pages(table: jax.Array, block: jax.Array, pages_per_block: int) -> jax.Array:
    """Pages [.., pages_per_block] of key block `block`; past the table's end they are page 0."""
    idx = block * pages_per_block + jnp.arange(pages_per_block)
    return jnp.where(idx < table.shape[-1], table[..., jnp.minimum(idx, table.shape[-1] - 1)], 0)


def _online_softmax_step(carry, scores, mask, v, spec: str):
    """Folds one key block into (running max, denominator, accumulator); scores are scaled."""
    running_max, denom, acc = carry
    scores = jnp.where(mask, scores, _MASKED)
    new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
    probs = jnp.exp(scores - new_max[..., None])
    rescale = jnp.exp(running_max - new_max)
    denom = denom * rescale + jnp.sum(probs, axis=-1)
    pv = jnp.einsum(spec, probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return new_max, denom, acc * rescale[..., None] + pv


def _capped(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    """Scaled scores soft-capped (soft_cap * tanh(scores / soft_cap)), or as they are."""
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


def _decode(q, pool, plan: StepPlan, sm_scale, sliding_window, soft_cap=None):
    """Every decoding sequence's one query, batched over sequence slots: f32[S, H, d].

    On the CPU, with a float32 pool or a quantized one (int8 / e4m3 pages, dequantized in the
    call), the native call (cpu_ffi) when it is built; the jnp loop
    (`_decode_loop`) elsewhere, and on other platforms whatever this process runs on.
    """
    native = (
        q.dtype == jnp.float32
        and (pool.kv.dtype == jnp.float32 or common.is_quantized(pool.kv.dtype))
        and jax.default_backend() == "cpu"
        and cpu_ffi.available()
        and soft_cap is None
    )
    if not native:
        return _decode_loop(q, pool, plan, sm_scale, sliding_window, soft_cap)

    def on_cpu(q):
        num_slots, num_kv_heads = pool.page_tables.shape[0], pool.num_kv_heads
        is_decode = plan.decode_rows < q.shape[0]
        kv_len = jnp.where(is_decode, pool.kv_lens, 0)
        lowest = jnp.zeros_like(kv_len) if sliding_window is None else kv_len - sliding_window
        qd = q[jnp.minimum(plan.decode_rows, q.shape[0] - 1)]
        qd = qd.reshape(num_slots, num_kv_heads, -1, pool.head_dim)
        out = cpu_ffi.decode_attention(
            qd, pool.kv, pool.layer, pool.page_tables, kv_len, lowest, sm_scale
        )
        return out.reshape(num_slots, -1, pool.head_dim)

    # Chosen when the step is lowered: a step compiled for an accelerator gets the loop.
    return jax.lax.platform_dependent(
        q, cpu=on_cpu, default=lambda q: _decode_loop(q, pool, plan, sm_scale, sliding_window)
    )


def _decode_loop(q, pool, plan: StepPlan, sm_scale, sliding_window, soft_cap=None):
    """The jnp decode: one batched loop over key blocks of every slot, f32[S, H, d]."""
    page_tables, kv_lens = pool.page_tables, pool.kv_lens
    page_size, num_kv_heads, head_dim = pool.page_size, pool.num_kv_heads, pool.head_dim
    num_slots = page_tables.shape[0]
    group = q.shape[1] // num_kv_heads
    decode_keys = _DECODE_KEYS_ONE_SEQ if num_slots == 1 else _DECODE_KEYS
    pages_per_block = max(1, decode_keys // page_size)
    block_keys = pages_per_block * page_size
    is_decode = plan.decode_rows < q.shape[0]
    kv_len = jnp.where(is_decode, kv_lens, 0)
    qd = q[jnp.minimum(plan.decode_rows, q.shape[0] - 1)] * sm_scale
    qd = qd.reshape(num_slots, num_kv_heads, group, head_dim)
    lowest = jnp.zeros_like(kv_len) if sliding_window is None else kv_len - sliding_window
    first = jnp.min(jnp.where(is_decode, jnp.maximum(lowest, 0), jnp.iinfo(jnp.int32).max))
    first_block = jnp.minimum(first, plan.decode_kv_max) // block_keys
    num_blocks = -(-plan.decode_kv_max // block_keys)

    def body(block, carry):
        kv_pos = block * block_keys + jnp.arange(block_keys)  # i32[block_keys]
        mask = (kv_pos[None, :] < kv_len[:, None]) & (kv_pos[None, :] >= lowest[:, None])
        pages = _block_pages(page_tables, block, pages_per_block)  # i32[S, pages_per_block]
        # Blocks wholly past a row's context read page 0 instead: the same cached lines.
        pages = jnp.where(block * block_keys < kv_len[:, None], pages, 0)
        k, v = pool.read(pages, block_keys)  # [S, block_keys, num_kv_heads, head_dim] each
        v = jnp.where(mask[:, :, None, None], v, 0)  # unused slots may hold NaN; 0 * NaN = NaN
        scores = jnp.einsum("skgd,sckd->skgc", qd, k, preferred_element_type=jnp.float32)
        scores = _capped(scores, soft_cap)
        return _online_softmax_step(carry, scores, mask[:, None, None, :], v, "skgc,sckd->skgd")

    shape = (num_slots, num_kv_heads, group)
    init = (
        jnp.full(shape, _MASKED, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(first_block, num_blocks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(num_slots, num_kv_heads * group, head_dim)


def _prefill_tiles(
    q, pool, query_start, plan: StepPlan, out, sm_scale, sliding_window, soft_cap=None
):
    """Runs the plan's query tiles, each over its own key blocks, into rows of `out` (f32)."""
    page_tables, kv_lens = pool.page_tables, pool.kv_lens
    page_size, num_kv_heads, head_dim = pool.page_size, pool.num_kv_heads, pool.head_dim
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    pages_per_block = max(1, _TILE_KEYS // page_size)
    block_keys = pages_per_block * page_size
    tile_rows = _tile_rows(q.shape[0])
    # Padded by one tile so a tile's slice never runs off the end (dynamic_slice would clamp it).
    q_padded = jnp.pad(q * sm_scale, ((0, tile_rows), (0, 0), (0, 0)))
    row = jnp.arange(tile_rows)

    def tile_body(i, out):
        seq, start, rows = plan.tile_seq[i], plan.tile_start[i], plan.tile_rows[i]
        kv_len, table = kv_lens[seq], page_tables[seq]
        first_pos = kv_len - (query_start[seq + 1] - start)  # position of the tile's row 0
        q_pos = first_pos + row  # i32[tile_rows]
        lowest = jnp.zeros_like(q_pos) if sliding_window is None else q_pos - sliding_window + 1
        qt = jax.lax.dynamic_slice_in_dim(q_padded, start, tile_rows)
        qt = qt.reshape(tile_rows, num_kv_heads, group, head_dim)

        def kv_body(block, carry):
            kv_pos = block * block_keys + jnp.arange(block_keys)  # i32[block_keys]
            pages = _block_pages(table, block, pages_per_block)
            k, v = pool.read(pages, block_keys)  # [block_keys, num_kv_heads, head_dim] each
            # Only the tile's key range [lowest[0], kv_len) was ever written; the rest may hold
            # NaN, and 0 * NaN is NaN in the PV matmul. Inside the range, masked probs are 0.
            seen = (kv_pos >= lowest[0]) & (kv_pos < kv_len)
            v = jnp.where(seen[:, None, None], v, 0)
            mask = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] >= lowest[:, None])
            mask &= (row < rows)[:, None]
            scores = jnp.einsum("qkgd,ckd->kgqc", qt, k, preferred_element_type=jnp.float32)
            scores = _capped(scores, soft_cap)
            return _online_softmax_step(carry, scores, mask, v, "kgqc,ckd->kgqd")

        shape = (num_kv_heads, group, tile_rows)
        init = (
            jnp.full(shape, _MASKED, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32),
        )
        first_block = jnp.maximum(lowest[0], 0) // block_keys
        # Causal: up to the tile's last query. A padding tile (rows == 0) runs no block: XLA
        # peels a loop it can prove runs at most once (a decode-only step's one padding tile),
        # so only this bound keeps such a step from paying for a whole tile per layer.
        last_block = jnp.where(rows > 0, (first_pos + rows - 1) // block_keys, first_block - 1)
        _, denom, acc = jax.lax.fori_loop(first_block, last_block + 1, kv_body, init)
        tile_out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [Hkv, g, rows, d]
        tile_out = jnp.moveaxis(tile_out, 2, 0).reshape(tile_rows, num_heads, head_dim)
        # The tile's padding rows belong to the next sequence (or padding): keep what is there.
        old = jax.lax.dynamic_slice_in_dim(out, start, tile_rows)
        new = jnp.where((row < rows)[:, None, None], tile_out, old)
        return jax.lax.dynamic_update_slice_in_dim(out, new, start, axis=0)

    return jax.lax.fori_loop(0, plan.num_tiles, tile_body, out)
