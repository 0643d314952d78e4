"""Attention backends behind one signature, the write of new keys and values into the pool, and
the warm-up batches that run every branch of the step once before serving."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np

from jaxserve.models.step_batch import SeqChunk, StepBatch, pack_chunks
from pallas_kernels.ragged_paged_attention import reference, xla_blocked

# reference: the dense pure-jnp oracle (cost follows max_model_len). xla: pure jnp blocked over
# the real context (the CPU's production path). pallas: the platform's kernel (TPU or GPU), an
# error on the CPU. auto: pallas on TPU and GPU, xla on the CPU. pallas_tpu / pallas_gpu name one
# platform's kernel; the *_interpret forms run it in Pallas interpret mode on the CPU (slow: tests).
# On a GPU, pallas_gpu is the Mosaic GPU kernel from compute capability 9.0 (Hopper) on, with the
# Triton kernel for f32 pools (wgmma cannot take them) and for older GPUs (`gpu_kernel_for`);
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

_KERNEL_PLATFORMS = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}


def resolve_backend(backend: str) -> str:
    """`backend` with `auto` and `pallas` replaced by the platform's choice."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is not one of {ATTENTION_BACKENDS}.")
    platform = jax.default_backend()
    if backend == "auto":
        return _KERNEL_PLATFORMS.get(platform, "xla")
    if backend == "pallas":
        if platform not in _KERNEL_PLATFORMS:
            raise ValueError(
                f"attention_backend='pallas' needs a TPU or GPU, but JAX runs on {platform!r}. "
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


def gpu_kernel_for(compute_capability: str | None) -> str:
    """'mosaic' from compute capability 9.0 (Hopper: TMA and wgmma) on, else 'triton'.

    `compute_capability` is `jax.Device.compute_capability`, a string like "9.0" or "8.6";
    None or an unreadable value picks Triton, which runs on every CUDA GPU Pallas supports.
    """
    try:
        major = int(str(compute_capability).split(".")[0])
    except ValueError:
        return "triton"
    return "mosaic" if major >= 9 else "triton"


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
    num_tokens: int, num_seqs: int, *, page_size: int, pages_per_seq: int, num_pages: int
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
        batch = pack_chunks(chunks, **shape, pages_per_seq=pages_per_seq, num_pages=num_pages)
        # Past the pool's last slot, like padding tokens: the write of every row is dropped.
        dropped = np.full_like(batch.slot_mapping, num_pages * page_size)
        batches.append(dataclasses.replace(batch, slot_mapping=dropped))
    return batches


def _zeros_chunk(length: int, page_size: int) -> SeqChunk:
    """A chunk of `length` tokens from position 0, all of them on page 0."""
    return SeqChunk([0] * length, 0, [0] * -(-length // page_size))


def get_attention_fn(backend: str) -> AttentionFn:
    """The ragged paged attention function of `backend` (see pallas_kernels for the signature).

    The platform is `jax.default_backend()`, read when the model is traced. Kernels are imported
    here, not at module import, so a CPU-only process never loads the Pallas backends it skips.
    """
    platform = jax.default_backend()
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference.ragged_paged_attention
    if backend == "xla":
        return xla_blocked.ragged_paged_attention
    kernel_platform = "tpu" if backend.startswith("pallas_tpu") else "gpu"
    interpret = backend.endswith("_interpret")
    if not interpret and _KERNEL_PLATFORMS.get(platform, "").removeprefix("pallas_") != (
        kernel_platform
    ):
        raise ValueError(
            f"attention_backend={backend!r} needs a {kernel_platform.upper()}, but JAX runs on "
            f"{platform!r}; use '{backend}_interpret' to run it in interpret mode instead."
        )
    if kernel_platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        from pallas_kernels.ragged_paged_attention import tpu_kernel

        fn = tpu_kernel.ragged_paged_attention
        return functools.partial(fn, interpret=pltpu.InterpretParams()) if interpret else fn
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
    if gpu_kernel_for(getattr(jax.devices()[0], "compute_capability", None)) == "triton":
        return triton

    def mosaic_or_triton(q, k_pool, *args, **kwargs):
        # Chosen per pool dtype when the model is traced: wgmma has no f32 K^T.
        use_mosaic = mosaic_gpu_kernel.supports_dtype(k_pool.dtype)
        return (mosaic if use_mosaic else triton)(q, k_pool, *args, **kwargs)

    return mosaic_or_triton


@functools.partial(jax.named_call, name="write_kv")
def write_kv(
    k_pool: jax.Array,  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v_pool: jax.Array,  # same as k_pool
    layer: jax.Array,  # i32[]
    k: jax.Array,  # [T, num_kv_heads, head_dim]
    v: jax.Array,  # [T, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[T] page * page_size + offset; out of range for padding
) -> tuple[jax.Array, jax.Array]:
    """Scatters this step's keys and values into their slots; padding rows are dropped."""
    page_size = k_pool.shape[2]
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    k_pool = k_pool.at[layer, page, offset].set(k.astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[layer, page, offset].set(v.astype(v_pool.dtype), mode="drop")
    return k_pool, v_pool
