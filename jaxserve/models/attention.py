"""Attention backends behind one signature, the write of new keys and values into the pool, and
the warm-up batches that run every branch of the step once before serving."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import target
from jaxserve.models.step_batch import SeqChunk, StepBatch, pack_chunks
from pallas_kernels.ragged_paged_attention import common, cpu_ffi, reference, xla_blocked

# reference: the dense pure-jnp oracle (cost follows max_model_len). xla: pure jnp blocked over
# the real context (the CPU's production path). pallas: the platform's kernel (TPU or GPU), an
# error on the CPU. auto: pallas on TPU and GPU, xla on the CPU. pallas_tpu / pallas_gpu name one
# platform's kernel; the *_interpret forms run it in Pallas interpret mode on the CPU (slow: tests).
# On a GPU, pallas_gpu is the kernel kernel_choice picks for the target's compute capability and
# the pool's shape (Mosaic GPU on Hopper, else Triton, else the XLA attention);
# pallas_gpu_mosaic / pallas_gpu_triton force one. pallas_gpu_interpret is the Triton kernel in
# interpret mode, as before the Mosaic kernel existed (the CPU has no capability to choose by).
ATTENTION_BACKENDS = (
    "reference",
    "xla",
    "pallas",
    "auto",
    "pallas_tpu",
    "pallas_gpu",
    "pallas_gpu_mosaic",
    "pallas_gpu_triton",
    "pallas_tpu_interpret",
    "pallas_gpu_interpret",
    "pallas_gpu_mosaic_interpret",
    "pallas_gpu_triton_interpret",
)

AttentionFn = Callable[..., jax.Array]
logger = logging.getLogger(__name__)

_KERNEL_PLATFORMS = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}


def resolve_backend(backend: str) -> str:
    """`backend` with `auto` and `pallas` replaced by the target's choice (jaxserve.target).

    `auto` is the Pallas kernel on a TPU and the XLA attention on the CPU and on GPUs: no GPU
    kernel has run on a GPU yet (the accelerator check has not passed on one), so there the
    kernel is opt-in (`pallas`) until it has (docs/accelerators/README.md).
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is not one of {ATTENTION_BACKENDS}.")
    platform = target.current().platform
    if backend == "auto":
        return "pallas_tpu" if platform == "tpu" else "xla"
    if backend == "pallas":
        if platform not in _KERNEL_PLATFORMS:
            raise ValueError(
                f"attention_backend='pallas' needs a TPU or GPU, but the target is {platform!r}. "
                "Use 'auto' or 'reference' there, or 'pallas_tpu_interpret' / "
                "'pallas_gpu_interpret' to run a kernel in interpret mode (slow; for tests)."
            )
        return _KERNEL_PLATFORMS[platform]
    return backend


def import_kernels(backend: str) -> None:
    """Imports what `backend` needs of Pallas now, before a step is traced.

    JAX 0.12's Pallas TPU module defines a value of the tracing context, and interpret mode
    imports it too, the first time it lowers a kernel. Imported during the first trace of a
    step (get_attention_fn runs then), it made that trace's key differ from every later one:
    the first bucket compiled twice at warm-up. JAX 0.10 defines no such value.
    """
    backend = resolve_backend(backend)
    if backend.startswith("pallas_tpu") or backend.endswith("_interpret"):
        from jax.experimental.pallas import tpu  # noqa: F401


def with_attention_plan(backend: str, batch: StepBatch) -> StepBatch:
    """`batch` with its per-step attention metadata, made once per step before the layer loop.

    Only the xla backend has any (its tile list and decode rows); every layer then passes
    `batch.attention_plan` on to the attention instead of deriving it again. The other backends
    keep their contract and get the batch unchanged.
    """
    if resolve_backend(backend) != "xla" or batch.attention_plan is not None:
        return batch
    plan = xla_blocked.plan_step(
        batch.token_ids.shape[0], batch.query_start, batch.kv_lens, batch.num_seqs
    )
    return dataclasses.replace(batch, attention_plan=plan)


def warm_up_batches(
    num_tokens: int,
    num_seqs: int,
    *,
    page_size: int,
    pages_per_seq: int,
    num_pages: int,
    num_groups: int = 1,
) -> list[StepBatch]:
    """Batches of bucket shape (num_tokens, num_seqs) that run the step's decode loop and prefill
    tiles once each while writing nothing to the KV pool: what `precompile` should run per bucket.

    An all-padding batch compiles the bucket but skips the xla backend's prefill tiles (a
    conditional) and runs its decode loop zero times, and XLA:CPU sets up the kernels of a branch
    or loop body on its first run, not at compile time. So the first real step of each bucket
    paid that set-up: on smollm2-135m's 16-token bucket (unrolled), in CPU-seconds in one process,
    +158 ms on the first decode step (325 ms warm) and +322 ms on the first prefill (359 ms warm);
    after these batches the first real step costs what later ones do (+2 ms and -14 ms).

    A decode row (1 token, context 1) and a prefill row (the rest, from position 0) read page 0,
    and every slot points past the pool, so the step's scatter drops all writes; sampling outputs
    are meant to be discarded. One batch when the bucket fits both rows, else one per row.
    `num_groups` > 1 (a hybrid pool): every group reads the same pages, and writes nowhere.
    """
    decode = SeqChunk([0], 0, [0])
    room = min(num_tokens, pages_per_seq * page_size)  # a prefill row's longest chunk
    if room < 2:  # no prefill fits (a 1-token bucket): the decode row alone
        groups = [[decode]]
    elif num_seqs >= 2 and room >= 3:  # both rows in one batch
        groups = [[decode, _zeros_chunk(min(num_tokens - 1, room), page_size)]]
    else:
        groups = [[decode], [_zeros_chunk(room, page_size)]]
    shape = dict(num_tokens=num_tokens, num_seqs=num_seqs, page_size=page_size)
    batches = []
    for chunks in groups:
        batch = pack_chunks(
            chunks, **shape, pages_per_seq=pages_per_seq, num_pages=num_pages, num_groups=num_groups
        )
        # Past the pool's last slot, like padding tokens: the write of every row is dropped.
        dropped = np.full_like(batch.slot_mapping, num_pages * page_size)
        group_dropped = np.full_like(batch.group_slots, num_pages * page_size)
        batches.append(dataclasses.replace(batch, slot_mapping=dropped, group_slots=group_dropped))
    return batches


def _zeros_chunk(length: int, page_size: int) -> SeqChunk:
    """A chunk of `length` tokens from position 0, all of them on page 0."""
    return SeqChunk([0] * length, 0, [0] * -(-length // page_size))


def get_attention_fn(backend: str) -> AttentionFn:
    """The ragged paged attention function of `backend` (see pallas_kernels for the signature).

    The platform and chip are the target's (jaxserve.target), read when the model is traced: the
    TPU kernel plans its blocks for the target's chip, and the GPU kernel is chosen for the
    target's compute capability and the pool's shape (kernel_choice), falling back to the XLA
    attention for a shape no GPU kernel takes. Kernels are imported here, not at module import,
    so a CPU-only process never loads the Pallas backends it skips.
    """
    where = target.current()
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference.ragged_paged_attention
    if backend == "xla":
        return xla_blocked.ragged_paged_attention
    kernel_platform = "tpu" if backend.startswith("pallas_tpu") else "gpu"
    interpret = backend.endswith("_interpret")
    if not interpret and where.platform != kernel_platform:
        raise ValueError(
            f"attention_backend={backend!r} needs a {kernel_platform.upper()}, but the target is "
            f"{where.platform!r}; use '{backend}_interpret' to run it in interpret mode instead."
        )
    if kernel_platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        from pallas_kernels.ragged_paged_attention import tpu_kernel

        fn = tpu_kernel.ragged_paged_attention
        if interpret:
            return functools.partial(fn, interpret=pltpu.InterpretParams())
        return functools.partial(fn, chip=where.device_kind)
    from pallas_kernels.ragged_paged_attention import gpu_kernel, mosaic_gpu_kernel

    triton = gpu_kernel.ragged_paged_attention
    mosaic = mosaic_gpu_kernel.ragged_paged_attention
    name = backend.removesuffix("_interpret").removeprefix("pallas_gpu").removeprefix("_")
    if interpret:  # pallas_gpu_interpret stays the Triton kernel
        if name == "mosaic":
            return functools.partial(mosaic, interpret=mosaic_gpu_kernel.interpret_params())
        return functools.partial(triton, interpret=True)
    if name:  # "mosaic" or "triton", forced
        return mosaic if name == "mosaic" else triton
    return functools.partial(_chosen_gpu_kernel, where.compute_capability, where.device_kind)


def _chosen_gpu_kernel(compute_capability, device_kind, q, kv_pool, *args, **kwargs):
    """The GPU kernel that takes this shape (kernel_choice), else the XLA attention: chosen when
    the model is traced, from the target's compute capability and the pool's dtype and shape."""
    from pallas_kernels.ragged_paged_attention import (
        gpu_kernel,
        kernel_choice,
        mosaic_gpu_kernel,
        tuning,
    )

    sizes = tuning.gpu_block_sizes(device_kind)
    page_tables = args[3]  # after layer, query_start, kv_lens
    kernel = kernel_choice.choose_gpu_kernel(
        compute_capability,
        kv_pool.dtype,
        head_dim=q.shape[2],
        page_size=kv_pool.shape[2],
        num_q_heads=q.shape[1],
        num_kv_heads=common.kv_heads_of(kv_pool, q.shape[2], kwargs.get("num_kv_heads")),
        block_sizes=sizes,
        num_tokens=q.shape[0],
        num_slots=page_tables.shape[0],
        pages_per_seq=page_tables.shape[1],
    )
    if kernel == kernel_choice.MOSAIC_GPU:
        return mosaic_gpu_kernel.ragged_paged_attention(
            q, kv_pool, *args, block_sizes=sizes, **kwargs
        )
    if kernel == kernel_choice.TRITON:
        return gpu_kernel.ragged_paged_attention(
            q, kv_pool, *args, block_sizes=sizes, compute_capability=compute_capability, **kwargs
        )
    if common.is_quantized(kv_pool.dtype):
        _log_quantized_fallback(str(kv_pool.dtype), compute_capability)
    return xla_blocked.ragged_paged_attention(q, kv_pool, *args, **kwargs)


@functools.cache
def _log_quantized_fallback(dtype: str, compute_capability) -> None:
    """Says once per pool dtype and GPU (when the step is traced) that 8-bit pages are read by
    the XLA attention: no GPU kernel takes them there (e4m3 before compute capability 8.9)."""
    logger.warning(
        "The KV pool is %s (--kv-cache-dtype): on this GPU (compute capability %s) the XLA "
        "attention reads and dequantizes its pages; no GPU kernel takes them here (the Triton "
        "kernel reads int8 from 8.0 and e4m3 from 8.9, Mosaic GPU 16-bit pools only).",
        dtype,
        compute_capability,
    )


@functools.partial(jax.named_call, name="write_kv")
def write_kv(
    kv_pool: jax.Array,  # [num_layers, num_pages, page_size, lanes] (jaxserve/models/kv_pool.py)
    layer: jax.Array,  # i32[]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[T] page * page_size + offset; out of range for padding
    shards: int = 1,  # KV shards of the pool's lanes (ShardingPlan.kv_shards)
    rows_sharding: jax.sharding.Sharding | None = None,  # ShardingPlan.kv_rows, split over a mesh
) -> jax.Array:
    """Scatters this step's keys and values into their slots, one [lanes] row per token (keys
    and values side by side, `common.fuse_kv`); padding rows are dropped. Into a quantized pool
    (int8 / e4m3) each token's keys and values are quantized per KV head first, their scale
    exponents in the same row, so the one scatter writes them too."""
    page_size, lanes = kv_pool.shape[2], kv_pool.shape[3]
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    rows = common.fuse_kv(k, v, lanes, shards, kv_pool.dtype)
    if rows_sharding is not None:
        # Rows split as the pool's lanes are. Left to itself XLA may split them finer where KV
        # heads are replicated (over model_rep too), then split the pool that way for the
        # scatter and gather it back for attention: a pool-sized all-gather in every layer.
        rows = jax.lax.with_sharding_constraint(rows, rows_sharding)
    if (
        kv_pool.dtype == jnp.float8_e4m3fn
        and rows_sharding is None
        and shards == 1
        and cpu_ffi.available()
    ):
        # XLA:CPU has no float8 scatter: it widened the whole pool to float16 and back around
        # every layer's write (50x a decode step). The CPU writes the rows in C++ instead;
        # a step compiled for an accelerator keeps the scatter.
        def scatter(kv_pool, rows):
            return kv_pool.at[layer, page, offset].set(rows, mode="drop")

        def native(kv_pool, rows):
            return cpu_ffi.write_rows(kv_pool, layer, rows, slot_mapping)

        return jax.lax.platform_dependent(kv_pool, rows, cpu=native, default=scatter)
    return kv_pool.at[layer, page, offset].set(rows, mode="drop")
