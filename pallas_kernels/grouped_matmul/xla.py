"""The grouped matmul through XLA's ragged dot (`jax.lax.ragged_dot`): GPUs and the CPU.

ragged_dot has no group offset (JAX 0.10 through 0.12 raise NotImplementedError for one), and
its groups start at row 0. With expert parallelism this device's groups start at row
`sum(group_sizes[:offset])`, so their rows are rolled to the front, multiplied with this
device's sizes, and rolled back. What ragged_dot leaves in rows past its groups differs by
platform (the CPU's dense masked dot gives 0; on GPU and TPU it is XLA's chlo.ragged_dot), so
the caller (`ops.grouped_matmul`) zeroes every row outside the local groups itself.

What it costs, by platform (as compiled with jaxlib 0.10.2 on the CPU, 0.12.0.1 for Hopper):
- CPU: JAX lowers ragged_dot to a dense dot of a masked [G_local, M, K] copy of lhs.
- GPU: XLA's ragged-dot rewriter makes it a dense dot too, of an [M, G_local * K] masked copy
  of lhs by all of rhs: G_local times the FLOPs, every local expert's weights read at every
  step, and an [M, G_local, K] temporary (Qwen3-30B-A3B's gate_up at 8192 tokens: 32 GiB on one
  H100; tests/kernels/test_grouped_matmul_aot.py). It compiles and fits, but is no grouped
  GEMM; expert parallelism divides it by the devices. XLA's cuDNN ragged-dot fusion
  (--xla_gpu_experimental_use_ragged_dot_fusion) did not change the compile-only program (no
  cuDNN in the compile set); a GPU grouped-GEMM kernel is work still to do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(
    lhs: jax.Array,  # [M, K] rows sorted by group
    rhs: jax.Array,  # [G_local, K, N]
    group_sizes: jax.Array,  # i32[G]
    group_offset: jax.Array | int,  # i32[]: the first group rhs holds
    start: jax.Array | int,  # i32[]: the first row of group `group_offset`
    *,
    preferred_element_type,
    precision=None,  # jax.lax.Precision: HIGHEST keeps float32 models' GPU dots off TF32
) -> jax.Array:  # [M, N]: rows of the local groups correct; every other row unspecified
    """The local groups' rows of lhs times their rhs, through ragged_dot, rows in place.

    Exists because ragged_dot takes no group offset: this is the shift around it. A static
    offset of 0 (no expert parallelism) skips both rolls, which copy [M, K] and [M, N].
    """
    num_local = rhs.shape[0]
    static_zero = isinstance(group_offset, int) and group_offset == 0
    if not static_zero:
        group_sizes = jax.lax.dynamic_slice_in_dim(group_sizes, group_offset, num_local)
        lhs = jnp.roll(lhs, -start, axis=0)
    out = jax.lax.ragged_dot(
        lhs,
        rhs,
        group_sizes[:num_local],
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    return out if static_zero else jnp.roll(out, start, axis=0)
