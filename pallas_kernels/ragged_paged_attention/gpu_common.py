"""What the two GPU kernels share: the question asked of them, the shapes a launch is sized from,
the launch, its cost estimate and the reference-signature entry point.

gpu_kernel.py (Triton) and mosaic_gpu_kernel.py (Mosaic GPU) split the work alike (common.py:
work items of consecutive query tokens of one sequence, a grid of (work item, KV head, key
split)); they differ in how a program moves its keys and runs its dots, and in the limits that
follow. Everything around that lives here once, so a fix to the checks, the bucket or the cost
model reaches both kernels:

- `Query`: what kernel_choice.py asks each kernel's `supports` (the target, the pool's dtype, the
  model's heads, the tuning row, optionally the bucket);
- `Bucket`: the static shapes of one call, from which each kernel's `launch_shape` sizes a
  `LaunchShape` (blocks, grid, pipeline depth);
- `cost_estimate`: an upper bound on one call's work, from a launch and its bucket;
- `entry_point`: the reference's signature (reference.py) around a kernel's launch of a checked
  `Call`, jitted with the same static options for both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.ragged_paged_attention import common, tuning

# A finite "minus infinity", as in the reference (no inf - inf = NaN for rows with no keys).
MASKED = -1e30


@dataclasses.dataclass(frozen=True)
class Bucket:
    """The static shapes of one kernel call: all a launch is sized from."""

    num_tokens: int  # query tokens (the bucket's T)
    num_slots: int  # sequence slots (page_tables' S)
    num_kv_heads: int
    group: int  # query heads per KV head
    pages_per_seq: int  # page_tables' P
    page_size: int
    head_dim: int
    dtype: Any  # the pool's


@dataclasses.dataclass(frozen=True)
class Query:
    """Whether a GPU kernel compiles for this shape on this GPU: what kernel_choice asks.

    With the bucket (num_tokens, num_slots, pages_per_seq, all or none) the answer is for that
    bucket; without it, for every bucket.
    """

    compute_capability: str | None  # the target's ("9.0"); None or unreadable: no GPU kernel
    dtype: Any  # the KV pool's
    head_dim: int
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    block_sizes: tuning.GpuBlockSizes  # the tuning row the kernel will be called with
    num_tokens: int | None = None
    num_slots: int | None = None
    pages_per_seq: int | None = None

    def __post_init__(self):
        if self.num_q_heads < 1 or self.num_kv_heads < 1 or self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} must be a positive multiple of "
                f"num_kv_heads={self.num_kv_heads} (GQA groups)."
            )
        given = (self.num_tokens, self.num_slots, self.pages_per_seq)
        if any(x is None for x in given) and any(x is not None for x in given):
            raise ValueError(
                f"Give all of num_tokens, num_slots and pages_per_seq or none, got {given}."
            )

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def bucket(self) -> Bucket | None:
        """The bucket asked about, or None when the question is about every bucket."""
        if self.num_tokens is None:
            return None
        return Bucket(
            num_tokens=self.num_tokens,
            num_slots=self.num_slots,
            num_kv_heads=self.num_kv_heads,
            group=self.group,
            pages_per_seq=self.pages_per_seq,
            page_size=self.page_size,
            head_dim=self.head_dim,
            dtype=jnp.dtype(self.dtype),
        )


@dataclasses.dataclass(frozen=True)
class LaunchShape:
    """The static shape of one call: blocks, grid and pipeline depth, from the bucket's sizes."""

    block_tokens: int  # query tokens per work item
    rows: int  # query rows a program stores (block_tokens * group, >= 16)
    num_items: int  # work-item slots: the grid's first axis
    block_kv: int  # keys per key block (whole pages)
    splits: int  # key splits ("flash decoding"): the grid's last axis
    stages: int  # pipeline depth: Triton's num_stages; Mosaic GPU's SMEM slots per K and V


def cost_estimate(
    shape: LaunchShape, bucket: Bucket, sliding_window: int | None, mma_rows: int
) -> pl.CostEstimate:
    """An upper bound on what one call of a kernel does, from the static shapes alone.

    The used work items and the key lengths are only known at run time, so every item slot counts
    as used and as reading its sequence's whole page table of keys (or, with a sliding window,
    the window plus the item's own tokens, one block of misalignment included). Dots count whole
    [mma_rows, block_kv] tiles (the Triton kernel's `rows`; the Mosaic GPU kernel's 64-row
    wgmma), masked rows included; the exps count each score and each row's rescale per key
    block; K and V count whole blocks. (JAX 0.10's GPU lowerings drop the estimate, so XLA does
    not see it yet; this function is also what callers can read it from.)
    """
    size = jnp.dtype(bucket.dtype).itemsize
    block_kv, head_dim = shape.block_kv, bucket.head_dim
    blocks = pl.cdiv(bucket.pages_per_seq * bucket.page_size, block_kv)  # per item, all splits
    if sliding_window is not None:
        blocks = min(blocks, pl.cdiv(sliding_window + shape.block_tokens - 1, block_kv) + 1)
    programs = shape.num_items * bucket.num_kv_heads * shape.splits
    block_steps = shape.num_items * bucket.num_kv_heads * blocks  # (program, key block) pairs
    flops = block_steps * 2 * (2 * mma_rows * block_kv * head_dim)  # Q K^T and P V
    transcendentals = block_steps * mma_rows * (block_kv + 1)
    kv_bytes = block_steps * 2 * block_kv * head_dim * size
    q_bytes = programs * mma_rows * head_dim * size
    out_tile = shape.num_items * bucket.num_kv_heads * shape.rows
    if shape.splits == 1:
        out_bytes = out_tile * head_dim * size
    else:  # f32 numerators, row maxes and row sums per split
        out_bytes = shape.splits * out_tile * (head_dim + 2) * 4
    # i32 metadata: the scalars each program reads, and the page ids of each key block.
    meta_bytes = 4 * (2 * bucket.num_slots + 2 * shape.num_items + 2)
    meta_bytes += 4 * block_steps * (block_kv // bucket.page_size)
    return pl.CostEstimate(
        flops=flops,
        transcendentals=transcendentals,
        bytes_accessed=kv_bytes + q_bytes + out_bytes + meta_bytes,
    )


class ScalarRefs(NamedTuple):
    """The i32 refs every program reads (`Call.scalar_operands`), by name inside a kernel."""

    layer: Any  # i32[1]
    query_start: Any  # i32[S + 1]
    kv_lens: Any  # i32[S]
    page_tables: Any  # i32[S, P]
    item_seq: Any  # i32[W] sequence of each work item
    item_start: Any  # i32[W] first token of each work item; -1: an unused slot


@dataclasses.dataclass(frozen=True)
class Program:
    """The static shape one program of either kernel works to (from its LaunchShape)."""

    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None  # Gemma 2: scaled scores -> soft_cap * tanh(scores / soft_cap)
    group: int  # query heads per KV head
    block_tokens: int  # query tokens per work item
    rows: int  # query rows a program stores
    pages_per_block: int  # pages per key block
    page_size: int
    num_splits: int  # key splits

    @classmethod
    def of(cls, call: Call, shape: LaunchShape) -> Program:
        """The programs of `call` launched as `shape`."""
        page_size = call.bucket.page_size
        return cls(
            sm_scale=call.sm_scale,
            sliding_window=call.sliding_window,
            soft_cap=call.soft_cap,
            group=call.bucket.group,
            block_tokens=shape.block_tokens,
            rows=shape.rows,
            pages_per_block=shape.block_kv // page_size,
            page_size=page_size,
            num_splits=shape.splits,
        )

    @property
    def block_kv(self) -> int:
        """Keys per key block."""
        return self.pages_per_block * self.page_size

    def on_used_item(self, refs: ScalarRefs, item, split) -> Callable:
        """Decorates a program's body, `body(s, t_lo, span)`, to run only for a used work item
        (sequence `s`, first token `t_lo`, its key span for this `split`); unused slots exit."""
        s, t_lo = refs.item_seq[item], refs.item_start[item]

        def decorate(body: Callable) -> None:
            pl.when(t_lo >= 0)(lambda: body(s, t_lo, self.span(refs, s, t_lo, split)))

        return decorate

    def capped(self, scores):  # f32[rows, keys] scaled scores -> the same, soft-capped
        """The scaled scores with the call's soft cap applied (as they are without one)."""
        if self.soft_cap is None:
            return scores
        return self.soft_cap * jnp.tanh(scores / self.soft_cap)

    def span(self, refs: ScalarRefs, s, t_lo, split) -> common.ItemSpan:
        """Work item (sequence `s`, first token `t_lo`)'s key range and this split's blocks."""
        return common.item_span(
            t_lo,
            refs.query_start[s + 1],
            refs.kv_lens[s],
            split,
            block_tokens=self.block_tokens,
            block_kv=self.block_kv,
            num_splits=self.num_splits,
            sliding_window=self.sliding_window,
        )


@dataclasses.dataclass(frozen=True)
class Call:
    """One checked call of a GPU kernel: its arrays, its bucket and its static options."""

    q: jax.Array  # [T, num_heads, head_dim]
    kv_pool: jax.Array  # [num_layers, num_pages, page_size, lanes] (common.fuse_kv)
    layer: jax.Array  # i32[]
    query_start: jax.Array  # i32[S + 1]
    kv_lens: jax.Array  # i32[S]
    page_tables: jax.Array  # i32[S, P]
    num_seqs: jax.Array  # i32[]
    bucket: Bucket
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    block_sizes: tuning.GpuBlockSizes  # the tuning row, resolved
    compute_capability: str | None
    interpret: Any  # False/None: compiled; else the kernel's interpret-mode switch

    def scalar_operands(
        self,
        item_seq: jax.Array,  # i32[W] sequence of each work item
        item_start: jax.Array,  # i32[W] first token of each work item; -1: unused
    ) -> tuple[jax.Array, ...]:
        """The i32 operands every program reads, in the kernels' order: layer, query_start,
        kv_lens, page_tables, item_seq, item_start."""
        return (
            jnp.reshape(self.layer, (1,)).astype(jnp.int32),
            self.query_start.astype(jnp.int32),
            self.kv_lens.astype(jnp.int32),
            self.page_tables.astype(jnp.int32),
            item_seq,
            item_start,
        )

    def real_rows(self) -> jax.Array:  # bool[T]
        """Which query tokens belong to a sequence (the rest are the bucket's padding)."""
        return common.real_rows(self.query_start, self.num_seqs, self.bucket.num_tokens)


# The options each entry point takes as static (hashable) arguments.
_STATIC_OPTIONS = (
    "sm_scale",
    "num_kv_heads",
    "sliding_window",
    "soft_cap",
    "block_sizes",
    "compute_capability",
    "interpret",
)


def entry_point(launch: Callable[[Call], jax.Array]) -> Callable[..., jax.Array]:
    """`launch` (one kernel's launch of a checked Call) behind the reference's signature, jitted.

    The returned function takes the reference's arguments (reference.py) plus `block_sizes` (the
    tuning row; default this device kind's row of `tuning.GPU_TABLE`), `compute_capability` (the
    target GPU's, which bounds the Triton kernel's SMEM; default the GPU Pallas compiles for) and
    `interpret` (run on the CPU in the kernel's interpret mode, for tests).
    """

    def attention(
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
        block_sizes: tuning.GpuBlockSizes | None = None,
        compute_capability: str | None = None,
        interpret: Any = None,
    ) -> jax.Array:  # [T, num_heads, head_dim], q.dtype
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = common.kv_heads_of(kv_pool, head_dim, num_kv_heads)
        common.check_args(
            q, kv_pool, num_kv_heads, query_start, kv_lens, page_tables, sliding_window
        )
        bucket = Bucket(
            num_tokens=num_tokens,
            num_slots=page_tables.shape[0],
            num_kv_heads=num_kv_heads,
            group=num_heads // num_kv_heads,
            pages_per_seq=page_tables.shape[1],
            page_size=kv_pool.shape[2],
            head_dim=head_dim,
            dtype=kv_pool.dtype,
        )
        call = Call(
            q=q,
            kv_pool=kv_pool,
            layer=layer,
            query_start=query_start,
            kv_lens=kv_lens,
            page_tables=page_tables,
            num_seqs=num_seqs,
            bucket=bucket,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            block_sizes=block_sizes or tuning.gpu_block_sizes(),
            compute_capability=compute_capability,
            interpret=interpret,
        )
        return launch(call)

    # The launch's docstring, not functools.wraps: jit would read the launch's signature.
    attention.__doc__ = launch.__doc__
    attention.__module__ = launch.__module__
    return jax.jit(attention, static_argnames=_STATIC_OPTIONS)
