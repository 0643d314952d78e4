"""The oracle: grouped matmul in numpy, one group at a time, with ops.grouped_matmul's signature.

Plain numpy rather than jnp, so that it shares no code with either implementation it checks
(not ragged_dot, not XLA's dot): slices of rows, one float64 matmul per group, zeros elsewhere.
"""

from __future__ import annotations

import numpy as np


def grouped_matmul(
    lhs,  # [M, K] rows sorted by group
    rhs,  # [G_local, K, N]
    group_sizes,  # int[G]
    group_offset: int | None = None,  # the first group rhs holds; None: 0 and G_local == G
    *,
    preferred_element_type=np.float32,
    **unused,  # implementation, interpret, tiling, chip: nothing to choose here
) -> np.ndarray:  # [M, N] of preferred_element_type
    """Row r of group g in [offset, offset + G_local) is lhs[r] @ rhs[g - offset]; others 0."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    sizes = np.asarray(group_sizes, np.int64)
    offset = 0 if group_offset is None else int(group_offset)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float64)
    for local in range(rhs.shape[0]):
        begin, end = bounds[offset + local], bounds[offset + local + 1]
        out[begin:end] = lhs[begin:end] @ rhs[local]
    return out.astype(preferred_element_type)
