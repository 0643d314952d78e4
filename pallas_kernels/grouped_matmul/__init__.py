"""Grouped matmul: the experts' matmul of a mixture-of-experts layer (issue 42).

Why: an MoE layer sends each token to k of E experts. Sorted by expert, the token rows form E
groups of varying size, and each group is multiplied by its own expert's weights. A dense
[M, K] x [E, K, N] einsum would do E times the work; a per-expert loop would retrace with the
sizes. `grouped_matmul` takes the sizes as an array, so a step compiles once per bucket.

Semantics (`grouped_matmul(lhs, rhs, group_sizes, group_offset)`):
- lhs [M, K] holds the rows sorted by group; group g owns `group_sizes[g]` rows after those of
  groups 0..g-1; rows from `sum(group_sizes)` (at most M) to M are padding.
- rhs [G_local, K, N] holds the weights of groups [group_offset, group_offset + G_local): with
  expert parallelism each device has G / n experts and `group_offset = axis_index * G / n`.
- The result [M, N] has `lhs[r] @ rhs[g - group_offset]` in each row r of a local group g and 0
  in every other row (other devices' groups, padding), so the devices' results add up to the
  single-device product (`expert_parallel_matmul` does exactly that under `jax.shard_map`).

Why two implementations, chosen by target ("auto", decided when the program is lowered):
- TPU: megablox, JAX's own Pallas kernel (`jax.experimental.pallas.ops.tpu.megablox.gmm`,
  megablox.py). It visits only the m tiles that hold this device's groups and streams each
  group's weights once per tile, with tiles sized per chip (tuning.py). XLA:TPU's ragged dot
  has no group offset and its lowering is not a kernel we can size. Google's tokamax has a newer
  TPU kernel (gmm v2) but needs JAX >= 0.11.1 and Python >= 3.12 (the oldest end here is 0.10
  on 3.11), refuses manual mesh axes (shard_map, which expert parallelism runs in) and pulls in
  qwix, pydantic, jaxtyping and xprof; its v1 kernel is megablox with no group offset.
- GPU and CPU: `jax.lax.ragged_dot` (xla.py), the portable grouped matmul. No group offset
  either, so this device's rows are rolled to the front and back. Correct everywhere, but both
  XLA:CPU and XLA:GPU (jaxlib 0.12) run it as a dense masked dot: G_local times the FLOPs and
  every local expert's weights read (xla.py has the numbers). Fine for tests and small models;
  serving a big MoE on GPUs wants a grouped-GEMM kernel, not written yet.

Modules: ops.py (the entry points `grouped_matmul` and `expert_parallel_matmul`, validation,
the zeroing both paths need), xla.py, megablox.py, tuning.py (megablox's tiles per chip),
reference.py (the numpy oracle). This file imports none of them, as every package here: an
`__init__` that re-exported ops would sit in an import cycle with the modules that import
tuning (tests/unit/test_layering.py).
"""
