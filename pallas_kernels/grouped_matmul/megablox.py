"""The grouped matmul on TPU: JAX's own Pallas kernel, megablox `gmm`, wrapped for any M.

megablox (jax.experimental.pallas.ops.tpu.megablox) walks only the m tiles that hold rows of
this device's groups (its group_offset and rhs.shape[0]) and loads each group's weights tile by
tile, so no FLOP or byte is spent on other devices' experts. What it asks and what it leaves:
- M must be a multiple of the m tile: lhs is padded with zero rows to one here and the output
  cut back. The padding rows lie past sum(group_sizes), so no group claims them.
- Rows no local group holds are left as the output buffer was (uninitialized HBM; NaN in Pallas's
  interpret mode) whenever rhs holds every group; it zeroes them itself only when rhs holds
  fewer. The caller (`ops.grouped_matmul`) zeroes them in every case.
- Its VMEM limit is the compiler's default scoped limit (it sets none), hence tuning.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Imported with this module, not in the first trace: JAX 0.12's Pallas TPU module defines a value
# of the tracing context when first imported, so a first trace that imported it had a key no
# later trace matched, and the caller's jit traced (and compiled) twice (models/attention.py's
# import_kernels says the same of the attention kernel).
from jax.experimental.pallas.ops.tpu import megablox

from pallas_kernels.grouped_matmul import tuning


def grouped_matmul(
    lhs: jax.Array,  # [M, K] rows sorted by group; bf16 or f32
    rhs: jax.Array,  # [G_local, K, N]; bf16 or f32
    group_sizes: jax.Array,  # i32[G]
    group_offset: jax.Array | int,  # i32[]: the first group rhs holds
    *,
    preferred_element_type,
    tiling: tuple[int, int, int] | None = None,
    chip: str | None = None,
    interpret: bool = False,
) -> jax.Array:  # [M, N]: rows of the local groups correct; every other row unspecified
    """megablox's gmm on an lhs of any row count, with its tile chosen for `chip`.

    `tiling` (tm, tk, tn) overrides `tuning.megablox_tiling` (tests use small tiles to take many
    grid steps on tiny shapes). `interpret` runs the kernel in Pallas's interpret mode on the
    CPU, which fills output it never wrote with NaN. That is Pallas's plain interpreter (XLA ops,
    no callbacks), not the TPU one (`pltpu.InterpretParams`): under shard_map on simulated CPU
    devices the TPU interpreter hung (JAX 0.10.2, 4 devices on 2 cores), and it is slower.
    """
    m, k = lhs.shape
    n = rhs.shape[2]
    if tiling is None:
        tiling = tuning.megablox_tiling(
            m,
            k,
            n,
            group_sizes.shape[0],
            lhs_dtype=lhs.dtype,
            rhs_dtype=rhs.dtype,
            out_dtype=preferred_element_type,
            chip=chip,
        )
    tm = tiling[0]
    padded = -(-m // tm) * tm
    if padded != m:  # megablox takes whole m tiles only; the extra rows belong to no group
        lhs = jnp.pad(lhs, ((0, padded - m), (0, 0)))
    out = megablox.gmm(
        lhs,
        rhs,
        group_sizes,
        preferred_element_type,
        tuple(tiling),
        jnp.asarray(group_offset, jnp.int32),
        None,  # existing_out
        False,  # transpose_rhs
        interpret,
    )
    return out[:m]
