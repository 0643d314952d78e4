"""The CPU's grouped matmul over packed weights (cpu_matmul.cc's GroupedPackedMatmul through
cpu_ffi.grouped_packed_matmul): a mixture-of-experts layer's rows, sorted by expert, each run of
rows times its own expert's weights.

Against float64 numpy per group, and on integer-valued inputs (every float32 partial sum exact)
element for element, so a wrong group start, expert or panel shows as a wrong value rather than
as rounding. The weights of groups without rows are NaN: a read of them that reached an output
would show. The sizes are data: zero, negative, past M. Each row's bits are packed_matmul's of
that row alone against its expert's weights (batch invariance), under every k_block.
"""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import cpu_ffi

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler (g++ or $CXX)"
)

GROUP_ROWS = 48  # cpu_matmul.cc's kGroupRows: rows per work item


def _runs(sizes, m):
    """Each group's [start, end) rows as the kernel defines them: negative sizes count as 0 and
    the runs stop at m (written out independently of the kernel's loop)."""
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), m)
    starts = np.concatenate([[0], ends[:-1]])
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def _reference(x, w, sizes):  # x [M, K], w [G, K, N] -> float64 [M, N], rows past the runs 0
    out = np.zeros((x.shape[0], w.shape[2]), np.float64)
    for g, (s, e) in enumerate(_runs(sizes, x.shape[0])):
        out[s:e] = x[s:e].astype(np.float64) @ w[g].astype(np.float64)
    return out


def _case(m, k, n, sizes, seed=0, integers=False):
    """x [m, k], w [G, k, n] and its packing; the weights of groups without rows are NaN."""
    rng = np.random.default_rng(seed)
    g = len(sizes)
    if integers:
        x = rng.integers(-4, 5, (m, k)).astype(np.float32)
        w = rng.integers(-4, 5, (g, k, n)).astype(np.float32)
    else:
        x = rng.standard_normal((m, k), np.float32)
        w = rng.standard_normal((g, k, n), np.float32)
    for i, (s, e) in enumerate(_runs(sizes, m)):
        if s == e:
            w[i] = np.nan
    return x, w, cpu_ffi.pack_weight(jnp.asarray(w))


def _gmm(x, wp, sizes, **kw):
    out = cpu_ffi.grouped_packed_matmul(jnp.asarray(x), wp, jnp.asarray(sizes, jnp.int32), **kw)
    return np.asarray(out)


# (M, K, N, sizes): groups across the 6-row tiles and the 48-row work items (a group of 47, 48,
# 49 and 97 rows), K odd and not a multiple of 6 or 16, 1-5 panels.
CASES = [
    (1, 64, 64, [1]),
    (10, 33, 128, [3, 0, 5, 2]),
    (40, 100, 192, [7, 13, 0, 20]),
    (47 + 48 + 49, 37, 320, [47, 48, 49]),
    (97 + 11, 129, 128, [0, 97, 0, 0, 11, 0]),
    (200, 70, 64, [50, 50, 50, 50]),
]


@pytest.mark.parametrize("m,k,n,sizes", CASES)
def test_each_group_is_its_rows_times_its_weights(m, k, n, sizes):
    x, w, wp = _case(m, k, n, sizes)
    out = _gmm(x, wp, sizes)
    ref = _reference(x, w, sizes)
    scale = _reference(np.abs(x), np.nan_to_num(np.abs(w)), sizes)
    assert out.shape == (m, n) and out.dtype == np.float32
    assert np.all(np.abs(out - ref) <= 1e-6 * scale + 1e-30)


@pytest.mark.parametrize("m,k,n,sizes", CASES)
def test_every_element_lands_in_its_place(m, k, n, sizes):
    """Small integers: every partial sum is exact in float32, so numpy's answer exactly; a row
    against a neighbouring group's weights, a shifted start or a swapped panel shows."""
    x, w, wp = _case(m, k, n, sizes, seed=k, integers=True)
    np.testing.assert_array_equal(_gmm(x, wp, sizes), _reference(x, w, sizes))


def test_a_tiny_case_worked_by_hand():
    """Three rows, two experts of K = 1 and one panel: rows 0-1 are expert 0's (weights 2), row 2
    expert 1's (weights 3): [1, 2, 3] * [2, 2, 3] = [2, 4, 9] in every column; row 3 is padding."""
    x = np.array([[1.0], [2.0], [3.0], [5.0]], np.float32)
    w = np.stack([np.full((1, 64), 2.0), np.full((1, 64), 3.0)]).astype(np.float32)
    out = _gmm(x, cpu_ffi.pack_weight(jnp.asarray(w)), [2, 1])
    np.testing.assert_array_equal(out[:, 0], [2.0, 4.0, 9.0, 0.0])
    np.testing.assert_array_equal(out, np.repeat(out[:, :1], 64, axis=1))


def test_all_rows_in_one_group_are_a_packed_matmul_against_it():
    x, _, wp = _case(100, 64, 192, [0, 0, 100, 0], seed=1)
    want = np.asarray(cpu_ffi.packed_matmul(jnp.asarray(x), wp[2]))
    np.testing.assert_array_equal(_gmm(x, wp, [0, 0, 100, 0]), want)


def _stale_output(x, wp):
    """A call whose every row is computed, freed again: the next call's output buffer is likely
    to be this memory, so a row the kernel does not write shows as a stale value, not as 0."""
    full = cpu_ffi.grouped_packed_matmul(
        jnp.asarray(x), jnp.nan_to_num(wp) + 1.0, jnp.full(wp.shape[0], x.shape[0], jnp.int32)
    )
    full.block_until_ready()
    del full


@pytest.mark.parametrize("sizes", [[5, 0, 7], [0, 0, 0], [48, 1, 0], [30, 30, 30]])
def test_rows_past_the_groups_come_back_zero(sizes):
    """sum(sizes) < M: the rows from the sum on are the bucket's padding, 0; the rest as numpy's."""
    m = 97
    x, w, wp = _case(m, 40, 128, sizes, seed=2, integers=True)
    _stale_output(x, wp)
    out = _gmm(x, wp, sizes)
    used = sum(sizes)
    assert not out[used:].any()
    np.testing.assert_array_equal(out, _reference(x, w, sizes))


def test_no_k_is_zeros():
    """K = 0: every sum is empty, so every row is 0, not whatever the output's memory held."""
    x, wp = np.ones((97, 0), np.float32), jnp.ones((2, 3, 0, 64), jnp.float32)
    _stale_output(np.ones((97, 1), np.float32), jnp.ones((2, 3, 1, 64), jnp.float32))
    out = _gmm(x, wp, [50, 47])
    assert out.shape == (97, 192) and not out.any()


@pytest.mark.parametrize("sizes", [[30, 40], [60, 5, 9], [10, 2**31 - 1, 2**31 - 1, 3]])
def test_sizes_summing_past_m_stop_at_m(sizes):
    """A run that passes M is cut at M, and the groups after it have no rows (their weights are
    NaN: a read of them shows); sizes near int32's limit do not overflow the sum."""
    m = 50
    x, w, wp = _case(m, 24, 64, sizes, seed=3, integers=True)
    out = _gmm(x, wp, sizes)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out, _reference(x, w, sizes))
    last = next(g for g, (s, e) in enumerate(_runs(sizes, m)) if e == m)
    np.testing.assert_array_equal(out[-1], x[-1] @ w[last])


@pytest.mark.parametrize("sizes", [[5, -3, 4], [-7, 6, 1], [2, 3, -(2**31)]])
def test_a_negative_size_is_no_rows(sizes):
    m = 12
    x, w, wp = _case(m, 24, 64, sizes, seed=4, integers=True)
    _stale_output(x, wp)
    out = _gmm(x, wp, sizes)
    np.testing.assert_array_equal(out, _reference(x, w, sizes))
    assert not out[sum(max(s, 0) for s in sizes) :].any()


@pytest.mark.parametrize("k_block", [0, 64])
def test_a_rows_bits_are_packed_matmuls_of_that_row_alone(k_block):
    """Batch invariance: whichever rows share the call (its tiles, work items and threads), a
    row's result is packed_matmul's of that row alone against its expert's weights, bit for bit."""
    sizes = [3, 0, 61, 1, 100, 0, 7, 20]
    m = sum(sizes) + 4
    x, _, wp = _case(m, 576, 192, sizes, seed=5)
    out = _gmm(x, wp, sizes, k_block=k_block)
    runs = _runs(sizes, m)
    for r in (0, 2, 3, 50, 63, 64, 64 + 47, 64 + 48, 164, 170, m - 5):
        g = next(g for g, (s, e) in enumerate(runs) if s <= r < e)
        alone = cpu_ffi.packed_matmul(jnp.asarray(x[r : r + 1]), wp[g], k_block=k_block)
        np.testing.assert_array_equal(out[r : r + 1], np.asarray(alone), err_msg=f"row {r}")


@pytest.mark.parametrize("k_block", [1, 64, 100, 576])
def test_every_k_block_gives_whole_k_tiles_bits(k_block):
    """How a panel is cut along k is the CPU's speed choice (cpu_ffi.matmul_k_block): every cut
    runs each element's chain of FMAs in the same order, whole-K tiles' (0) bits."""
    sizes = [13, 0, 40, 2]
    x, w, wp = _case(60, 576, 192, sizes, seed=6)
    want = _gmm(x, wp, sizes, k_block=0)
    np.testing.assert_array_equal(_gmm(x, wp, sizes, k_block=k_block), want)
    assert np.abs(want - _reference(x, w, sizes)).max() < 1e-3


def test_traced_sizes_under_jit_run_one_compiled_call():
    """The sizes are the router's counts, data on the device: new counts do not retrace, and a
    call of lax.platform_dependent (as the model chooses its CPU kernels) takes this one."""
    traces = []

    def grouped(x, wp, sizes):
        traces.append(1)
        return cpu_ffi.grouped_packed_matmul(x, wp, sizes)

    def chosen(x, wp, sizes):
        def dense(x):  # what an accelerator would run; never taken on the CPU
            return jnp.full((x.shape[0], wp.shape[1] * cpu_ffi.PANEL), -1.0, jnp.float32)

        return jax.lax.platform_dependent(
            x, cpu=lambda x: cpu_ffi.grouped_packed_matmul(x, wp, sizes), default=dense
        )

    step, platform_step = jax.jit(grouped), jax.jit(chosen)
    for seed, sizes in enumerate([[10, 20, 0, 5], [0, 40, 1, 1], [1, 1, 1, 1], [-2, 60, 0, 0]]):
        x, w, wp = _case(50, 40, 128, [1, 1, 1, 1], seed=seed, integers=True)
        want = _reference(x, w, sizes)
        args = (jnp.asarray(x), wp, jnp.asarray(sizes, jnp.int32))
        np.testing.assert_array_equal(np.asarray(step(*args)), want)
        np.testing.assert_array_equal(np.asarray(platform_step(*args)), want)
    assert len(traces) == 1
    lowered = jax.jit(chosen).lower(*args).as_text()
    assert cpu_ffi._GROUPED_MATMUL_TARGET in lowered


def test_it_agrees_with_ragged_dot():
    """The call it stands in for: jax.lax.ragged_dot over the same sorted rows and sizes, padding
    rows included."""
    sizes = [9, 0, 30, 4]
    x, w, wp = _case(50, 70, 128, sizes, seed=8)
    w = np.nan_to_num(w)
    want = jax.lax.ragged_dot(
        jnp.asarray(x),
        jnp.asarray(w),
        jnp.asarray(sizes, jnp.int32),
        precision=jax.lax.Precision.HIGHEST,
    )
    np.testing.assert_allclose(_gmm(x, wp, sizes), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_bad_shapes_are_sentences_naming_them():
    x, wp, sizes = jnp.zeros((4, 8)), jnp.zeros((3, 2, 8, 64)), jnp.zeros(3, jnp.int32)
    with pytest.raises(ValueError, match=r"got x \(4, 9\) and weights \(3, 2, 8, 64\)\."):
        cpu_ffi.grouped_packed_matmul(jnp.zeros((4, 9)), wp, sizes)
    # x [T, top_k, K] unflattened: its second axis happens to be K, yet it is refused.
    with pytest.raises(ValueError, match=r"got x \(4, 8, 8\) and weights"):
        cpu_ffi.grouped_packed_matmul(jnp.zeros((4, 8, 8)), wp, sizes)
    with pytest.raises(ValueError, match=r"weights \(2, 8, 64\)\."):  # one expert's, unstacked
        cpu_ffi.grouped_packed_matmul(x, wp[0], sizes)
    with pytest.raises(ValueError, match=r"weights \(3, 2, 8, 32\)\."):
        cpu_ffi.grouped_packed_matmul(x, jnp.zeros((3, 2, 8, 32)), sizes)
    with pytest.raises(ValueError, match=r"one size per group of the weights, 3; got .* \(2,\)\."):
        cpu_ffi.grouped_packed_matmul(x, wp, jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match=r"shape \(\)\."):
        cpu_ffi.grouped_packed_matmul(x, wp, jnp.int32(4))
    with pytest.raises(ValueError, match=r"k_block is 0 .* got -1\."):
        cpu_ffi.grouped_packed_matmul(x, wp, sizes, k_block=-1)


def test_the_kernel_refuses_bad_shapes_itself_naming_them():
    """Past the wrapper (a call built by hand), the kernel's own InvalidArgument shows every
    operand's dimensions rather than reading out of bounds."""
    assert cpu_ffi.available()
    call = jax.ffi.ffi_call(
        cpu_ffi._GROUPED_MATMUL_TARGET, jax.ShapeDtypeStruct((4, 128), jnp.float32)
    )
    x, wp = jnp.zeros((4, 8)), jnp.zeros((3, 2, 8, 64))
    with pytest.raises(Exception, match=r"group sizes \[2\], out \[4, 128\]\."):
        call(x, wp, jnp.zeros(2, jnp.int32), k_block=np.int64(0))
    with pytest.raises(Exception, match=r"got x \[4, 8\], weights \[3, 2, 9, 64\]"):
        call(x, jnp.zeros((3, 2, 9, 64)), jnp.zeros(3, jnp.int32), k_block=np.int64(0))
    with pytest.raises(Exception, match=r"k_block is 0 .* got -2\."):
        call(x, wp, jnp.zeros(3, jnp.int32), k_block=np.int64(-2))
