"""The grouped matmul against the numpy oracle (pallas_kernels/grouped_matmul/reference.py).

Both implementations run on the CPU: "xla" natively, "megablox" in Pallas's interpret mode,
which fills output the kernel never wrote with NaN, so a row left unzeroed shows. Small tiles
(16 rows, 128 of K and N) give many grid steps on tiny shapes: M = 50 is no multiple of the m
tile, groups straddle tiles, some are empty, rows from sum(group_sizes) on are padding. One jit
per implementation and dtype serves every case, the sizes and the offset traced, and a counter
in the traced function checks that nothing retraced.

Expert parallelism runs on 4 simulated CPU devices, a flag XLA reads only when JAX starts: a
session without them reruns that test in a subprocess with the flag.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from pallas_kernels.grouped_matmul import reference, tuning
from pallas_kernels.grouped_matmul.ops import (
    IMPLEMENTATIONS,
    expert_parallel_matmul,
    grouped_matmul,
)

M, K, N, G = 50, 256, 256, 6
SMALL = (16, 128, 128)  # (tm, tk, tn): 4 m tiles over M = 50 (padded to 64), 2 k and 2 n tiles
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # bf16: the output rounds to 8 bits
KERNELS = ("xla", "megablox")
# (group_sizes, group_offset) for rhs holding 3 of the 6 groups; every sum is at most M.
LOCAL_CASES = [
    ([7, 0, 12, 5, 0, 9], 0),  # sum 33: 17 padding rows; local groups 0-2, one empty
    ([7, 0, 12, 5, 0, 9], 3),  # local groups 3-5 start at row 19, inside the second m tile
    ([3, 10, 1, 20, 15, 1], 2),  # sum M: no padding; local rows 13..49 cross three tiles
    ([0, 0, 0, 0, 0, 0], 1),  # no rows at all: everything 0
    ([16, 16, 0, 0, 0, 0], 2),  # the local groups hold no rows: everything 0
    ([1, 1, 1, 1, 1, 1], 1),  # one row per group
]


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    lhs = rng.normal(size=(M, K)).astype(np.float32)
    rhs = rng.normal(size=(G, K, N)).astype(np.float32)
    # The oracle multiplies the values the kernels see: rounded to dtype first.
    return np.asarray(jnp.asarray(lhs, dtype)), np.asarray(jnp.asarray(rhs, dtype))


def _outside_rows(sizes, offset, num_local) -> np.ndarray:
    """bool[M]: the rows no local group holds (other groups' and padding)."""
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    rows = np.arange(M)
    return (rows < bounds[offset]) | (rows >= bounds[offset + num_local])


def _check(out, lhs, rhs, sizes, offset, dtype):
    out = np.asarray(out.astype(jnp.float32))
    want = reference.grouped_matmul(lhs, rhs, sizes, offset, preferred_element_type=np.float32)
    outside = _outside_rows(sizes, offset or 0, rhs.shape[0])
    assert not np.isnan(out).any(), f"NaN in rows {np.nonzero(np.isnan(out).any(1))[0]}"
    assert (out[outside] == 0).all(), f"rows {np.nonzero(outside)[0]} must be exactly 0"
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(out, want, atol=TOLERANCE[dtype] * scale, rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("implementation", KERNELS)
def test_local_groups_match_the_reference_without_retracing(implementation, dtype):
    lhs, rhs = _inputs(dtype)
    traces = []

    @jax.jit
    def run(lhs, rhs, sizes, offset):
        traces.append(1)  # runs only while tracing
        return grouped_matmul(
            lhs,
            rhs,
            sizes,
            offset,
            implementation=implementation,
            interpret=True,
            tiling=SMALL,
            preferred_element_type=dtype,
        )

    for sizes, offset in LOCAL_CASES:
        local = rhs[offset : offset + 3]
        out = run(lhs, local, np.asarray(sizes, np.int32), np.int32(offset))
        assert out.shape == (M, N) and out.dtype == dtype
        _check(out, lhs, local, sizes, offset, dtype)
    assert len(traces) == 1 and run._cache_size() == 1, "new sizes or offsets must not retrace"


@pytest.mark.parametrize("implementation", KERNELS)
def test_every_group_without_an_offset_zeroes_the_padding(implementation):
    """rhs holds all 6 groups: megablox zeroes nothing itself then (its padding rows are NaN in
    interpret mode), so the padding rows 33..49 test the wrapper's own zeroing."""
    lhs, rhs = _inputs(jnp.float32, seed=1)
    sizes = [7, 0, 12, 5, 0, 9]
    fn = jax.jit(lambda *a: grouped_matmul(*a, implementation=implementation, interpret=True))
    out = fn(lhs, rhs, np.asarray(sizes, np.int32))  # megablox: the table's tiles, M padded
    _check(out, lhs, rhs, sizes, None, jnp.float32)


def test_auto_is_ragged_dot_on_the_cpu():
    """ "auto" lowered for the CPU takes the xla branch: no TPU kernel in the program (the TPU
    branch is checked in test_grouped_matmul_aot.py), and the same answer as the reference."""
    lhs, rhs = _inputs(jnp.float32, seed=2)
    sizes, offset = np.asarray([4, 9, 0, 11, 6, 3], np.int32), np.int32(2)
    fn = jax.jit(lambda *a: grouped_matmul(*a, implementation="auto"))
    assert "tpu_custom_call" not in fn.lower(lhs, rhs[2:5], sizes, offset).compile().as_text()
    _check(fn(lhs, rhs[2:5], sizes, offset), lhs, rhs[2:5], sizes, 2, jnp.float32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_case_worked_by_hand(implementation):
    """Groups of 2 and 2 rows, row 4 padding; rhs g0 = [[1], [2]], g1 = [[10], [20]]:
    rows [1, 0], [0, 1] (g0) give 1 and 2; rows [1, 1], [2, 0] (g1) give 30 and 20; row 4 gives
    0 whatever it holds. With only g1 on this device (offset 1), g0's rows give 0 too."""
    lhs = jnp.array([[1, 0], [0, 1], [1, 1], [2, 0], [9, 9]], jnp.float32)
    rhs = jnp.array([[[1], [2]], [[10], [20]]], jnp.float32)
    sizes = jnp.array([2, 2], jnp.int32)
    kwargs = dict(implementation=implementation, interpret=implementation == "megablox")
    both = grouped_matmul(lhs, rhs, sizes, **kwargs)
    assert both[:, 0].tolist() == [1, 2, 30, 20, 0]
    second = grouped_matmul(lhs, rhs[1:], sizes, 1, **kwargs)  # a static offset, the last valid
    assert second[:, 0].tolist() == [0, 0, 30, 20, 0]
    first = grouped_matmul(lhs, rhs[:1], sizes, 0, **kwargs)  # a static 0: no rolls
    assert first[:, 0].tolist() == [1, 2, 0, 0, 0]


def _kernel_tiles(fn, *args) -> list[tuple[int, ...]]:
    """The block shapes of the Pallas kernel in fn's program: lhs (tm, tk), rhs (tk, tn)."""

    def calls(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn.params["grid_mapping"].block_mappings
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(inner, "eqns"):
                    yield from calls(inner)

    (mappings,) = calls(jax.make_jaxpr(fn)(*args).jaxpr)
    sizes = [tuple(getattr(d, "block_size", None) for d in m.block_shape) for m in mappings]
    return [tuple(d for d in shape if d is not None) for shape in sizes[:2]]


def test_the_tiles_asked_for_reach_the_kernel():
    """An explicit tiling is what the kernel gets (the sweeps above rely on SMALL's many grid
    steps); without one, the chip's: f32 M = 50 is one m tile of 56 rows (50 rounded up to 8);
    K = 2048 is whole on v6e (its row allows 2048) and halved on the default row (1024)."""
    args = (jnp.zeros((M, K)), jnp.zeros((G, K, N)), jnp.zeros(G, jnp.int32))
    small = functools.partial(grouped_matmul, implementation="megablox", tiling=SMALL)
    assert _kernel_tiles(small, *args) == [(16, 128), (128, 128)]
    wide = (jnp.zeros((M, 2048)), jnp.zeros((G, 2048, N)), jnp.zeros(G, jnp.int32))
    v6e = functools.partial(grouped_matmul, implementation="megablox", chip="TPU v6 lite")
    assert _kernel_tiles(v6e, *wide) == [(56, 2048), (2048, 256)]
    default = functools.partial(grouped_matmul, implementation="megablox")
    assert _kernel_tiles(default, *wide) == [(56, 1024), (1024, 256)]


def test_bad_arguments_raise_sentences_with_the_values():
    lhs, rhs = jnp.zeros((8, 4)), jnp.zeros((3, 4, 2))
    sizes = jnp.zeros(3, jnp.int32)
    with pytest.raises(ValueError, match=r"implementation='pallas' is not one of"):
        grouped_matmul(lhs, rhs, sizes, implementation="pallas")
    with pytest.raises(ValueError, match=r"rhs holds 2 groups but group_sizes has 3"):
        grouped_matmul(lhs, rhs[:2], sizes)
    with pytest.raises(ValueError, match=r"group_offset=2 must lie in \[0, 1\]"):
        grouped_matmul(lhs, rhs[:2], sizes, 2)
    with pytest.raises(ValueError, match=r"must share K: lhs's second dimension 5 is not"):
        grouped_matmul(jnp.zeros((8, 5)), rhs, sizes)
    with pytest.raises(ValueError, match=r"rhs holds 3 groups, more than group_sizes' 2"):
        grouped_matmul(lhs, rhs, sizes[:2], 0)
    with pytest.raises(ValueError, match=r"group_sizes must be integers, but its dtype is float"):
        grouped_matmul(lhs, rhs, jnp.zeros(3))
    with pytest.raises(ValueError, match=r"megablox takes bf16 or f32, but lhs is float16"):
        grouped_matmul(lhs.astype(jnp.float16), rhs, sizes, implementation="megablox")
    with pytest.raises(ValueError, match=r"3 groups do not split evenly over the 2 devices"):
        expert_parallel_matmul(jax.sharding.AbstractMesh((2,), ("e",)), "e", lhs, rhs, sizes)


# Tiles: pure functions of the shape and chip.

QWEN3_30B = {"gate_up": (2048, 1536), "down": (768, 2048)}  # (K, N); 128 experts, 8 per token


def _tiles(tokens, matmul, chip, dtype=jnp.bfloat16):
    k, n = QWEN3_30B[matmul]
    return tuning.megablox_tiling(
        tokens * 8, k, n, 128, lhs_dtype=dtype, rhs_dtype=dtype, out_dtype=dtype, chip=chip
    )


def test_tiles_for_qwen3_30b_worked_from_the_rule():
    """- 1 token: M = 8 rows, one bf16 tile of 16 rows.
    - 128 tokens: M = 1024 over 128 experts is 8 rows a group: the 128-row floor.
    - 8192 tokens: 512 rows a group: the row's tm, 256 on v5e and 512 on v6e.
    - gate_up (K 2048, N 1536) on v5e: tk 1024 divides 2048, tn 1024 does not divide 1536 but 768
      does. On v6e at 8192 tokens the whole K and N (the row allows 2048) take, in MiB, lhs
      2 x 512 x 2048 x 2 B = 4, rhs 2 x 2048 x 1536 x 2 B = 12, out 2 x 512 x 1536 x 2 B = 3,
      the f32 accumulator and temporaries 2 x 3: 25 of the 28.8 budgeted (0.9 of 32).
    - down (K 768, N 2048): K whole; N 1024 on v5e, 2048 on v6e.
    """
    assert _tiles(1, "gate_up", "v5e")[0] == 16
    assert _tiles(128, "gate_up", "v6e")[0] == 128
    assert _tiles(8192, "gate_up", "v5e")[0] == 256
    assert _tiles(8192, "gate_up", "v6e")[0] == 512
    assert _tiles(1024, "gate_up", "v5e")[1:] == (1024, 768)
    assert _tiles(1024, "down", "v5e")[1:] == (768, 1024)
    assert _tiles(1024, "down", "v6e")[1:] == (768, 2048)
    assert _tiles(8192, "gate_up", "v6e") == (512, 2048, 1536)


def test_tn_shrinks_before_tk():
    """f32 K = N = 2048 on v6e at tm 512 (512 rows a group), in MiB: the whole rhs tile alone is
    2 x 2048 x 2048 x 4 B = 32. With tk 2048, tn 1024 needs lhs 8 + rhs 16 + out 4 + 4 = 32,
    over the 28.8 budget; tn 512 needs 8 + 8 + 2 + 2 = 20."""
    tiles = tuning.megablox_tiling(
        4096, 2048, 2048, 8, lhs_dtype=jnp.float32, rhs_dtype=jnp.float32,
        out_dtype=jnp.float32, chip="v6e",
    )  # fmt: skip
    assert tiles == (512, 2048, 512)


@pytest.mark.parametrize("chip", [None, "v5e", "v6e", "v4", "v5p", "tpu7x"])
@pytest.mark.parametrize("tokens", [1, 16, 128, 1024, 8192])
@pytest.mark.parametrize("matmul", list(QWEN3_30B))
def test_tiles_fit_the_budget_and_divide_the_shape(chip, tokens, matmul):
    for dtype in (jnp.bfloat16, jnp.float32):
        tm, tk, tn = _tiles(tokens, matmul, chip, dtype)
        k, n = QWEN3_30B[matmul]
        assert tm % tuning.sublane_rows(dtype) == 0 and tm <= max(16, tokens * 8)
        assert k % tk == 0 and n % tn == 0 and tk % 128 == 0 and tn % 128 == 0
        need = tuning.vmem_bytes((tm, tk, tn), dtype, dtype, dtype)
        assert need <= tuning.vmem_budget_bytes(chip)


def test_a_tile_that_cannot_fit_raises_a_sentence():
    """K = N = 2047 in f32 on v6e: no multiple of 128 divides 2047, and the whole [2047, 2047]
    rhs tile, double-buffered, is 33.5 MB against the 30.2 MB budget."""
    with pytest.raises(ValueError, match=r"No megablox tile fits 30198988 bytes of VMEM on v6e"):
        tuning.megablox_tiling(
            8, 2047, 2047, 1, lhs_dtype=jnp.float32, rhs_dtype=jnp.float32,
            out_dtype=jnp.float32, chip="v6e",
        )  # fmt: skip


# Expert parallelism on 4 simulated devices.

DEVICES = 4


@pytest.mark.parametrize("implementation", KERNELS)
def test_expert_parallel_matches_one_device(implementation):
    """8 experts split 4 ways under shard_map (2 each, offset axis_index * 2) give what one
    device holding all 8 gives."""
    if jax.device_count() < DEVICES:
        _rerun_with_devices(
            f"{__file__}::test_expert_parallel_matches_one_device[{implementation}]"
        )
        return
    rng = np.random.default_rng(3)
    lhs = rng.normal(size=(M, K)).astype(np.float32)
    rhs = rng.normal(size=(8, K, N)).astype(np.float32)
    sizes = np.asarray([7, 0, 12, 5, 0, 9, 3, 1], np.int32)  # sum 37 of 50
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("expert",))
    kwargs = dict(implementation=implementation, interpret=True, tiling=SMALL)
    split = jax.jit(lambda *a: expert_parallel_matmul(mesh, "expert", *a, **kwargs))(
        lhs, rhs, sizes
    )
    whole = jax.jit(lambda *a: grouped_matmul(*a, **kwargs))(lhs, rhs, sizes)
    np.testing.assert_allclose(np.asarray(split), np.asarray(whole), rtol=1e-5, atol=1e-5)
    _check(split, lhs, rhs, sizes, None, jnp.float32)


def _rerun_with_devices(node: str) -> None:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={DEVICES}")
    env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
