"""What the kernels share: argument checks, the grouped-query layout, and the GPU kernels' work
list, key-block range and flash-decoding split/merge (the Triton and Mosaic GPU kernels split the
work the same way, so it lives here once).

Both kernels read queries as [num_kv_heads, tokens * group, head_dim] ("grouped"): the `group`
query heads that share a KV head become consecutive rows, so one matmul against one KV head's keys
serves all of them (GQA), and a block of rows is a block of whole tokens. The transpose in and out
costs two passes over q (T * H * D elements), which is small beside the keys and values read.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# TPU vector registers and HBM tiles are 128 lanes wide: a pool whose minor dimension is a
# multiple of this keeps XLA:TPU's default (row-major) layout, so no step ever relays it out.
LANES = 128


def kv_lanes(
    num_kv_heads: int, head_dim: int, shards: int = 1, align: int = 1, quantized: bool = False
) -> int:
    """The pool's minor dimension: each of `shards` holds its num_kv_heads / shards heads' keys
    and values side by side (2 * heads * head_dim lanes), in a quantized pool followed by their
    2 * heads scale exponents (`fuse_kv`), padded to a multiple of `align` (LANES on TPU, 1
    elsewhere)."""
    heads = num_kv_heads // shards
    per_shard = heads * 2 * head_dim + (2 * heads if quantized else 0)
    return shards * (-(-per_shard // align) * align)


# Quantized pools (jaxserve/models/kv_pool.py, "Quantized KV cache" in docs/architecture.md):
# keys and values in 8 bits, each token's keys (and, apart, its values) of each KV head with one
# power-of-two scale 2^e. The exponent e is an integer stored in the pool's own dtype (int8 and
# e4m3 both hold every integer of [SCALE_EXP_MIN, SCALE_EXP_MAX] exactly) in the LAST 2 * heads
# lanes of each shard's block: local head i's key exponent at lane lanes - 2 * heads + 2i, its
# value exponent right after. So a page carries its scales wherever it is copied, and a reader
# finds them from the block's width alone, whatever padding the platform added before them.
KV_CACHE_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
SCALE_EXP_MIN, SCALE_EXP_MAX = -16, 16


def is_quantized(dtype) -> bool:
    """Whether a pool of `dtype` holds 8-bit keys and values with scale lanes (`fuse_kv`)."""
    return jnp.dtype(dtype) in _QMAX


def pow2(e: jax.Array) -> jax.Array:
    """f32 2^e for integer-valued e in [-126, 127], exactly (built from its bits: XLA:CPU's exp2
    of an integer is not always exact)."""
    bits = (e.astype(jnp.int32) + 127) << 23
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (values [..., D] in `dtype`, exponents i32[...]): symmetric over the last
    axis, x ~= values * 2^e with e the least exponent putting max|x| below the format's largest
    value (127 for int8, 448 for e4m3), clipped to [SCALE_EXP_MIN, SCALE_EXP_MAX]; int8 rounds
    half to even, e4m3 as the conversion does, both saturating."""
    dtype = jnp.dtype(dtype)
    qmax = _QMAX[dtype]
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    _, e = jnp.frexp(amax / qmax)  # amax / qmax < 2^e
    e = jnp.clip(e, SCALE_EXP_MIN, SCALE_EXP_MAX).astype(jnp.int32)
    y = jnp.clip(x * pow2(-e)[..., None], -qmax, qmax)  # exact: a power of two
    if dtype == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype), e


def kv_heads_of(kv_pool: jax.Array, head_dim: int, num_kv_heads: int | None) -> int:
    """The KV heads a pool holds: given, or its whole (unpadded) minor dimension's."""
    if num_kv_heads is not None:
        return num_kv_heads
    return kv_pool.shape[-1] // (2 * head_dim + (2 if is_quantized(kv_pool.dtype) else 0))


def fuse_kv(k: jax.Array, v: jax.Array, lanes: int, shards: int = 1, dtype=None) -> jax.Array:
    """k, v [..., num_kv_heads, D] -> [..., lanes] in `dtype` (default k's): head h's keys at
    lanes [2hD, 2hD + D), its values at [2hD + D, 2hD + 2D), each of `shards` contiguous blocks
    of heads padded to lanes / shards. In a quantized `dtype` (`is_quantized`) k and v are
    quantized per (token, head) and each block ends with its heads' scale exponents (key, value,
    key, ...). The pool's layout (jaxserve/models/kv_pool.py); `split_kv` reads it back."""
    *batch, heads, head_dim = k.shape
    dtype = jnp.dtype(k.dtype if dtype is None else dtype)
    per = heads // shards
    if is_quantized(dtype):
        (kq, ek), (vq, ev) = quantize(k, dtype), quantize(v, dtype)
        kv = jnp.stack([kq, vq], axis=-2).reshape(*batch, shards, per * 2 * head_dim)
        exps = jnp.stack([ek, ev], axis=-1).reshape(*batch, shards, 2 * per).astype(dtype)
        pad = lanes // shards - kv.shape[-1] - exps.shape[-1]
        gap = jnp.zeros((*batch, shards, pad), dtype)
        return jnp.concatenate([kv, gap, exps], axis=-1).reshape(*batch, lanes)
    kv = jnp.stack([k.astype(dtype), v.astype(dtype)], axis=-2)
    kv = kv.reshape(*batch, shards, per * 2 * head_dim)
    pad = lanes // shards - kv.shape[-1]
    if pad:
        kv = jnp.pad(kv, [(0, 0)] * (kv.ndim - 1) + [(0, pad)])
    return kv.reshape(*batch, lanes)


def split_kv(
    kv: jax.Array, num_kv_heads: int, head_dim: int, dtype=None
) -> tuple[jax.Array, jax.Array]:
    """[..., lanes] of one shard (or an unsharded pool) -> k, v [..., num_kv_heads, D]. A
    quantized block is dequantized with its scale lanes into `dtype` (default float32), exactly
    (8-bit values times a power of two fit bfloat16's mantissa); a float one keeps its dtype."""
    data = kv[..., : 2 * num_kv_heads * head_dim].reshape(*kv.shape[:-1], num_kv_heads, 2, head_dim)
    if is_quantized(kv.dtype):
        exps = kv[..., kv.shape[-1] - 2 * num_kv_heads :].astype(jnp.float32)
        scale = pow2(exps.reshape(*kv.shape[:-1], num_kv_heads, 2))
        data = (data.astype(jnp.float32) * scale[..., None]).astype(dtype or jnp.float32)
    return data[..., 0, :], data[..., 1, :]


def dequantize_pool(kv_pool: jax.Array, num_kv_heads: int, head_dim: int, dtype) -> jax.Array:
    """A quantized pool [..., lanes] (unsharded) as the float pool of the same keys and values,
    [..., 2 * num_kv_heads * head_dim] in `dtype`: what tests compare a kernel on quantized pages
    against (the reference over this pool)."""
    k, v = split_kv(kv_pool, num_kv_heads, head_dim, dtype)
    return fuse_kv(k, v, 2 * num_kv_heads * head_dim)


def check_args(
    q: jax.Array,  # [T, num_heads, head_dim]
    kv_pool: jax.Array,  # [num_layers, num_pages, page_size, lanes]: keys and values (fuse_kv)
    num_kv_heads: int,
    query_start: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    page_tables: jax.Array,  # i32[S, P]
    sliding_window: int | None,
) -> None:
    """Raises ValueError, in a whole sentence with the values, on shapes the kernels cannot run."""
    if q.ndim != 3 or kv_pool.ndim != 4:
        raise ValueError(
            f"Expected q [T, H, D] and a 4-d pool [L, pages, page_size, lanes], got {q.shape=}, "
            f"{kv_pool.shape=}."
        )
    num_heads, head_dim = q.shape[1:]
    needed = kv_lanes(num_kv_heads, head_dim, quantized=is_quantized(kv_pool.dtype))
    if num_kv_heads < 1 or kv_pool.shape[-1] < needed:
        raise ValueError(
            f"The pool's {kv_pool.shape[-1]} lanes cannot hold {num_kv_heads} KV heads of keys "
            f"and values of head_dim {head_dim} (in {kv_pool.dtype}: {needed} lanes)."
        )
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


def max_work_items(num_tokens: int, num_slots: int, block_tokens: int) -> int:
    """Work items a bucket can need: each sequence's tokens split into ceil(q_len / block_tokens).

    Static (bucket sizes only), so the grid never changes with the batch.
    """
    real = min(num_slots, num_tokens)
    return max(1, (num_tokens + real * (block_tokens - 1)) // block_tokens)


def work_items(
    query_start: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[]
    block_tokens: int,
    num_items: int,
) -> tuple[jax.Array, jax.Array]:  # i32[num_items] each
    """Sequence and first token of each work item; first token -1 for the unused slots."""
    num_slots = query_start.shape[0] - 1
    q_lens = jnp.where(
        jnp.arange(num_slots) < num_seqs, query_start[1:] - query_start[:-1], 0
    ).astype(jnp.int32)
    blocks = -(-q_lens // block_tokens)
    ends = jnp.cumsum(blocks)
    w = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right"), num_slots - 1).astype(jnp.int32)
    start = query_start[seq] + (w - (ends[seq] - blocks[seq])) * block_tokens
    return seq, jnp.where(w < ends[-1], start, -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class ItemSpan:
    """What one program (work item, KV head, key split) attends over; scalars, all i32."""

    t_hi: jax.Array  # one past the item's last token
    pos_offset: jax.Array  # token t sits at position t + pos_offset
    kv_start: jax.Array  # first key position any of the item's rows sees
    kv_end: jax.Array  # one past the last such position
    block_lo: jax.Array  # this split's key blocks: [block_lo, block_hi) of block_kv keys
    block_hi: jax.Array


def item_span(
    t_lo: jax.Array,  # i32[] the item's first token
    q_end: jax.Array,  # i32[] query_start[s + 1] of its sequence s
    kv_len: jax.Array,  # i32[] kv_lens[s]
    split: jax.Array,  # i32[] this program's key split
    *,
    block_tokens: int,
    block_kv: int,
    num_splits: int,
    sliding_window: int | None,
) -> ItemSpan:
    """The key range of a work item and this split's share of its key blocks, inside a kernel.

    Plain scalar arithmetic, so the same code traces in the Triton and the Mosaic GPU kernel.
    Splits divide the item's blocks evenly; the last ones may get none (then they write an empty
    partial: max -1e30, sum 0).
    """
    t_hi = jnp.minimum(q_end, t_lo + block_tokens)
    pos_offset = kv_len - q_end
    kv_end = t_hi + pos_offset
    kv_start = jnp.int32(0)
    if sliding_window is not None:
        kv_start = jnp.maximum(0, t_lo + pos_offset - sliding_window + 1)
    blk_lo = kv_start // block_kv
    blk_hi = (kv_end + block_kv - 1) // block_kv
    per_split = (blk_hi - blk_lo + num_splits - 1) // num_splits
    j_lo = blk_lo + split * per_split
    j_hi = jnp.minimum(blk_hi, j_lo + per_split)
    return ItemSpan(t_hi, pos_offset, kv_start, kv_end, j_lo, j_hi)


def num_kv_splits(num_programs: int, max_blocks: int, sizes) -> int:
    """Key splits that bring the program count to about 4 per SM (a power of 2, capped).

    `num_programs` is the count before splitting (work items * KV heads); `sizes` a
    `tuning.GpuBlockSizes` (its num_sms and max_kv_splits).
    """
    want = (4 * sizes.num_sms) // max(1, num_programs)
    splits = 1
    while splits * 2 <= min(want, sizes.max_kv_splits, max_blocks):
        splits *= 2
    return splits


def merge_splits(
    acc: jax.Array,  # f32[splits, ..., rows, D] unnormalised numerators
    row_max: jax.Array,  # f32[splits, ..., rows]
    row_sum: jax.Array,  # f32[splits, ..., rows]
) -> jax.Array:  # f32[..., rows, D]
    """Combines the splits' partial softmaxes (rescaled to a common max)."""
    weight = jnp.exp(row_max - row_max.max(axis=0)[None])
    total = (weight * row_sum).sum(axis=0)
    out = (weight[..., None] * acc).sum(axis=0)
    return out / jnp.where(total > 0, total, 1.0)[..., None]
