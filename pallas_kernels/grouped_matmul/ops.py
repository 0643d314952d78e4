"""`grouped_matmul`, the one entry point, and `expert_parallel_matmul`, the same over a mesh."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.grouped_matmul import megablox, xla

IMPLEMENTATIONS = ("auto", "xla", "megablox")


def grouped_matmul(
    lhs: jax.Array,  # [M, K] rows sorted by group (bf16 or f32)
    rhs: jax.Array,  # [G_local, K, N] this device's groups' weights
    group_sizes: jax.Array,  # i32[G] rows of every group, G >= G_local; rows from sum on: padding
    group_offset: jax.Array | int | None = None,  # i32[]: the first group rhs holds
    *,
    implementation: str = "auto",
    interpret: bool = False,
    preferred_element_type=jnp.float32,
    tiling: tuple[int, int, int] | None = None,
    chip: str | None = None,
    precision=None,  # jax.lax.Precision of the xla path (HIGHEST for float32 models on GPUs)
) -> jax.Array:  # [M, N]
    """Each row of lhs times the weights of its group, for the groups rhs holds; every other row 0.

    The experts' matmul of a mixture-of-experts layer: lhs holds the tokens' rows sorted by
    expert, group g owning the `group_sizes[g]` rows after those of groups 0..g-1, and rhs holds
    the weights of groups [group_offset, group_offset + G_local). Row r of group g in that range
    comes back as `lhs[r] @ rhs[g - group_offset]`; rows of other groups, and the padding rows
    from `sum(group_sizes)` to M, come back 0, so the devices' outputs of an expert-parallel
    layer add up to the whole product (`expert_parallel_matmul`).

    `group_offset`: None means 0 with rhs holding every group (G_local == G); an int is checked
    against G; a traced i32[] (`jax.lax.axis_index(axis) * G_local` under shard_map) cannot be,
    and must lie in [0, G - G_local]. sum(group_sizes) must not exceed M. The sizes and the
    offset are arrays, so new values never retrace or recompile.

    `implementation`: "xla" is `jax.lax.ragged_dot` (GPUs, the CPU); "megablox" is JAX's TPU
    Pallas kernel (a TPU, or the CPU with `interpret=True`: Pallas's interpret mode, which only
    "megablox" takes); "auto" is megablox where the program is lowered for a TPU and xla
    elsewhere, decided at lowering (`jax.lax.platform_dependent`), so a program traced on this
    CPU for a TPU topology gets the kernel. `tiling` (tm, tk, tn) and `chip` (a TPU generation
    or device kind: its row of tuning.TPU_TABLE; None: the row that fits every chip) concern
    megablox only. The output has `preferred_element_type` (megablox accumulates in f32
    whatever it is). The zeroing is one select over [M, N], which XLA can fuse into what reads
    the result (the activation, the combine).
    """
    num_local = _check(lhs, rhs, group_sizes, group_offset, implementation)
    group_sizes = group_sizes.astype(jnp.int32)
    offset = 0 if group_offset is None else group_offset
    if not isinstance(offset, int):  # a static 0 stays static: the xla path then skips its rolls
        offset = jnp.reshape(jnp.asarray(offset, jnp.int32), ())
    # bounds[g]: the first row of group g; this device's rows are [bounds[offset], end).
    bounds = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(group_sizes)])
    start, end = bounds[offset], bounds[offset + num_local]

    def with_xla():
        return xla.grouped_matmul(
            lhs,
            rhs,
            group_sizes,
            offset,
            start,
            preferred_element_type=preferred_element_type,
            precision=precision,
        )

    def with_megablox(interpret=interpret):
        return megablox.grouped_matmul(
            lhs,
            rhs,
            group_sizes,
            offset,
            preferred_element_type=preferred_element_type,
            tiling=tiling,
            chip=chip,
            interpret=interpret,
        )

    if implementation == "xla":
        out = with_xla()
    elif implementation == "megablox":
        out = with_megablox()
    else:
        # Chosen when lowered, for the platform lowered for: only that branch is lowered, so
        # the CPU never meets the Pallas TPU kernel, and an ahead-of-time TPU compile gets it.
        # The TPU branch is the compiled kernel: interpret mode is for "megablox" on the CPU,
        # where "auto" is xla anyway.
        tpu = functools.partial(with_megablox, interpret=False)
        out = jax.lax.platform_dependent(tpu=tpu, default=with_xla)
    # Neither kernel promises zeros outside its groups (see xla.py, megablox.py).
    rows = jax.lax.broadcasted_iota(jnp.int32, (lhs.shape[0], 1), 0)
    return jnp.where((rows >= start) & (rows < end), out, jnp.zeros((), out.dtype))


def _check(lhs, rhs, group_sizes, group_offset, implementation) -> int:
    """G_local, or a ValueError naming the argument that does not fit."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}.")
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            f"grouped_matmul takes lhs [M, K], rhs [G_local, K, N] and group_sizes [G], but got "
            f"lhs {lhs.shape}, rhs {rhs.shape} and group_sizes {group_sizes.shape}."
        )
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"lhs {lhs.shape} and rhs {rhs.shape} must share K: lhs's second dimension "
            f"{lhs.shape[1]} is not rhs's second {rhs.shape[1]}."
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers, but its dtype is {group_sizes.dtype}.")
    num_local, num_groups = rhs.shape[0], group_sizes.shape[0]
    if group_offset is None and num_local != num_groups:
        raise ValueError(
            f"rhs holds {num_local} groups but group_sizes has {num_groups}: without a "
            "group_offset rhs must hold every group."
        )
    if num_local > num_groups:
        raise ValueError(f"rhs holds {num_local} groups, more than group_sizes' {num_groups}.")
    if isinstance(group_offset, int) and not 0 <= group_offset <= num_groups - num_local:
        raise ValueError(
            f"group_offset={group_offset} must lie in [0, {num_groups - num_local}] for rhs's "
            f"{num_local} groups of {num_groups}."
        )
    if implementation == "megablox":
        for name, array in (("lhs", lhs), ("rhs", rhs)):
            if array.dtype not in (jnp.bfloat16, jnp.float32):
                raise ValueError(f"megablox takes bf16 or f32, but {name} is {array.dtype}.")
    return num_local


def expert_parallel_matmul(
    mesh: jax.sharding.Mesh,
    axis: str,
    lhs: jax.Array,  # [M, K] every device's rows, sorted by group; replicated
    rhs: jax.Array,  # [G, K, N] split over `axis`: each device holds G / mesh.shape[axis] groups
    group_sizes: jax.Array,  # i32[G], replicated
    **kwargs,
) -> jax.Array:  # [M, N], replicated
    """grouped_matmul with the groups (experts) split over mesh axis `axis`, as the MoE layer's
    expert parallelism does it: the same as `grouped_matmul(lhs, rhs, group_sizes)` on one device.

    The pattern, for a model's own shard_map (where more than one matmul runs between
    collectives): each device calls grouped_matmul with its G_local = G / n groups and
    `group_offset = jax.lax.axis_index(axis) * G_local`; its rows of other devices' groups come
    back 0, so a psum over `axis` (or a reduce-scatter of the rows) assembles the result, each
    row taken from the one device that computed it. That shard_map needs `check_vma=False`
    (below). `kwargs` go to grouped_matmul.
    """
    shards = mesh.shape[axis]
    if rhs.shape[0] % shards:
        raise ValueError(
            f"rhs's {rhs.shape[0]} groups do not split evenly over the {shards} devices of "
            f"mesh axis {axis!r}."
        )
    num_local = rhs.shape[0] // shards

    # check_vma=False: megablox's pallas_call declares no mesh axes its output varies over,
    # which shard_map's check demands of every pallas_call (JAX 0.12 raises without it).
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), P(axis), P()), out_specs=P(), check_vma=False
    )
    def local(lhs, rhs, group_sizes):
        offset = jax.lax.axis_index(axis) * num_local
        out = grouped_matmul(lhs, rhs, group_sizes, offset, **kwargs)
        return jax.lax.psum(out, axis)

    return local(lhs, rhs, group_sizes)
