"""Which GPU attention kernel serves a shape: Mosaic GPU, Triton, or none (XLA's attention).

Each kernel states its own limits in a `supports(query)` function (None, or the reason it
refuses; the query is a gpu_common.Query built here once); this module only asks them, in
order of preference, so a limit is written once, next to the code that has it. The choice is a
pure function of the target and the shape: the compute capability is an argument, never read
from a device, because a program compiled ahead of time for a GPU
(pallas_kernels.gpu_targets) is traced on a machine whose devices are not that GPU.

Preference: Mosaic GPU where it runs (Hopper, 16-bit pools: TMA copies and wgmma), then Triton
(any CUDA GPU from compute capability 8.0), then None: the caller's XLA attention, which takes
every shape.
"""

from __future__ import annotations

from pallas_kernels.ragged_paged_attention import gpu_common, tuning

MOSAIC_GPU = "mosaic_gpu"
TRITON = "triton"


def gpu_kernel_refusals(
    compute_capability: str | None,
    dtype,
    *,
    head_dim: int,
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    block_sizes: tuning.GpuBlockSizes | None = None,
    num_tokens: int | None = None,
    num_slots: int | None = None,
    pages_per_seq: int | None = None,
) -> dict[str, str | None]:
    """Each GPU kernel's answer for this shape, in order of preference: None where it serves it,
    else the reason it refuses (for logs and error messages). Arguments as `choose_gpu_kernel`."""
    # Imported here: a CPU-only process that never asks loads neither Pallas GPU backend.
    from pallas_kernels.ragged_paged_attention import gpu_kernel, mosaic_gpu_kernel

    query = gpu_common.Query(
        compute_capability=compute_capability,
        dtype=dtype,
        head_dim=head_dim,
        page_size=page_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        block_sizes=block_sizes or tuning.GPU_TABLE["default"],
        num_tokens=num_tokens,
        num_slots=num_slots,
        pages_per_seq=pages_per_seq,
    )
    return {
        MOSAIC_GPU: mosaic_gpu_kernel.supports(query),
        TRITON: gpu_kernel.supports(query),
    }


def choose_gpu_kernel(
    compute_capability: str | None,
    dtype,
    *,
    head_dim: int,
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    block_sizes: tuning.GpuBlockSizes | None = None,
    num_tokens: int | None = None,
    num_slots: int | None = None,
    pages_per_seq: int | None = None,
) -> str | None:
    """The GPU kernel that serves this shape: "mosaic_gpu", "triton", or None for XLA's attention.

    `compute_capability` is the target's ("9.0"; `gpu_targets.compute_capability(name)` ahead of
    time, `jax.Device.compute_capability` on a live GPU); None or an unreadable value gets None.
    `dtype` is the KV pool's. `block_sizes` must be the tuning row the kernel will be called with
    (default: tuning.GPU_TABLE["default"]). With the bucket (num_tokens, num_slots,
    pages_per_seq, all static) the answer is exact for that bucket; without it, it holds for every
    bucket, which is stricter where a kernel's limits depend on the launch (the Mosaic GPU
    kernel's SMEM with key splits). Never returns a kernel whose `supports` refuses the shape.
    """
    refusals = gpu_kernel_refusals(
        compute_capability,
        dtype,
        head_dim=head_dim,
        page_size=page_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        block_sizes=block_sizes,
        num_tokens=num_tokens,
        num_slots=num_slots,
        pages_per_seq=pages_per_seq,
    )
    return next((name for name, reason in refusals.items() if reason is None), None)
