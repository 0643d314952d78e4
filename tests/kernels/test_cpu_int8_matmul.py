"""The CPU's matmuls over int8 weights (cpu_matmul_int8.cc through cpu_ffi, issue 43).

The quantization against a numpy reference written out here (per-column symmetric scales, round
half to even, zero columns), the packed layout, and the round trip's error bound. Weight-only:
bit for bit the float32 kernel's chains of FMAs on the int8 values, times the scale, and close
to the float32 kernel on the dequantized weights. W8A8: exactly a numpy int64 reference of the
same per-row quantization (its integers are exact), near int32's limit too. For both: integer
inputs whose scales are 1, where every element must equal numpy's (a misplaced panel, row, column
or scale shows as a wrong value, not as rounding); padding rows; a row's bits alone as in any
batch; the grouped variant's runs; the refusals, as sentences naming the shapes.
"""

from __future__ import annotations

import functools
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

MODES = ("float", "int8")
# Rows across the 6-row register tiles and the 48-row work items; K odd, not a multiple of 4 or
# 16 (W8A8's groups of four k and its 16-lane quantization), and even; 1-48 panels.
SHAPES = [(1, 64, 64), (5, 7, 128), (6, 576, 960), (13, 33, 192), (49, 101, 320), (97, 64, 3072)]


def _quantize_columns(w):  # f32[..., K, N] -> q int64[..., K, N], scales f32[..., N]
    """The scheme written out in numpy's float32: scale = max |w| / 127 per column (1 where
    that is 0), q = round half to even (np.rint) of w / scale, within [-127, 127]."""
    w = np.asarray(w, np.float32)
    s = np.max(np.abs(w), axis=-2) / np.float32(127)
    s = np.where(s == 0, np.float32(1), s).astype(np.float32)
    return np.clip(np.rint(w / s[..., None, :]), -127, 127).astype(np.int64), s


def _w8a8_reference(x, q, s):  # x f32[M, K], q int[K, N], s f32[N] -> f32[M, N]
    """W8A8 in numpy: each row quantized as the weights' columns are, int64 sums (exact), then
    float32(acc) * sx * scale in that order."""
    xq, sx = _quantize_columns(np.asarray(x, np.float32).T)  # a row of x is a column of x.T
    acc = xq.T @ np.asarray(q, np.int64)
    return (acc.astype(np.float32) * sx[:, None]) * np.asarray(s, np.float32)[None, :]


def _case(m, k, n, seed=0):
    """x [m, k] and w [k, n] with columns of different sizes (so a scale in the wrong column
    shows), and w's int8 packing."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, n), np.float32) * rng.uniform(0.1, 3.0, n).astype(np.float32)
    wq, scales = cpu_ffi.pack_weight_int8(jnp.asarray(w))
    return x, w, wq, scales


def _mm(x, wq, scales, valid=None, activations="float"):
    out = cpu_ffi.packed_matmul_int8(jnp.asarray(x), wq, scales, valid, activations=activations)
    return np.asarray(out)


def test_the_library_builds_here():
    """The build's own error (the compiler's message) rather than a failure of every case."""
    cpu_ffi._build()
    assert cpu_ffi.available()


# ---- The quantization ----


def test_quantization_is_the_numpy_scheme_and_keeps_leading_axes():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 40, 192), np.float32) * rng.uniform(0.01, 5, (3, 1, 192))
    wq, scales = cpu_ffi.pack_weight_int8(jnp.asarray(w, jnp.float32))
    q, s = _quantize_columns(w)
    assert wq.dtype == jnp.int8 and wq.shape == (3, 3, 40, 64)
    assert scales.dtype == jnp.float32 and scales.shape == (3, 192)
    np.testing.assert_array_equal(np.asarray(scales), s)
    np.testing.assert_array_equal(np.asarray(cpu_ffi.unpack_weight(wq)), q)
    # Under jit too, where XLA would turn a division by a broadcast into a multiply.
    jitted = jax.jit(cpu_ffi.pack_weight_int8)(jnp.asarray(w, jnp.float32))
    np.testing.assert_array_equal(np.asarray(jitted[1]), s)
    np.testing.assert_array_equal(np.asarray(jitted[0]), np.asarray(wq))
    # Each layer's own scales: its largest weight in each column is +-127.
    np.testing.assert_array_equal(np.abs(q).max(axis=-2), 127)


def test_the_packed_layout_is_columns_in_panels_of_64():
    w = np.zeros((5, 128), np.float32)
    w[:, 64 + 3] = [127, -2.5, 1, 0, 3.5]  # column 67: scale 1, so q is w rounded
    w[2, 0] = 7.0  # column 0: scale 7 / 127, q 127
    wq, scales = cpu_ffi.pack_weight_int8(jnp.asarray(w))
    wq = np.asarray(wq)
    assert wq.shape == (2, 5, 64)
    np.testing.assert_array_equal(wq[1, :, 3], [127, -2, 1, 0, 4])  # panel 1, column 3
    assert wq[0, 2, 0] == 127 and float(scales[0]) == np.float32(7) / np.float32(127)
    assert float(scales[67]) == 1.0


def test_rounding_is_half_to_even():
    """A column whose largest weight is 127 has scale 1: its weights' halves round to even.
    One whose largest is 889 has scale 7, whose reciprocal is inexact: 885.5 / 7 is 126.5 exactly
    (126), where 885.5 * float32(1 / 7) rounds to just above it (127), so a multiply by the
    reciprocal in place of the division shows."""
    col = np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 3.49], np.float32)
    w = np.tile(col[:, None], (1, 128))
    w[:, 64:] *= 7
    wq, scales = cpu_ffi.pack_weight_int8(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(scales)[[0, 64]], [1.0, 7.0])
    want = [127, 0, 2, 2, 0, -2, -2, 126, 3]
    np.testing.assert_array_equal(np.asarray(wq)[0, :, 0], want)
    np.testing.assert_array_equal(np.asarray(wq)[1, :, 0], want)


def test_the_round_trip_is_within_half_a_scale():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 300, 256), np.float32) * rng.uniform(1e-3, 10, (2, 1, 256))
    wq, scales = cpu_ffi.pack_weight_int8(jnp.asarray(w, jnp.float32))
    deq = np.asarray(cpu_ffi.dequantize_int8(wq, scales), np.float64)
    err = np.abs(w.astype(np.float64) - deq)
    half = np.asarray(scales, np.float64)[:, None, :] / 2
    assert np.all(err <= half * (1 + 1e-5))  # 1e-5: the float32 quotient's and product's rounding
    assert err.max() > 0.4 * half.max()  # not trivially small: the rounding does cost that


def test_a_zero_column_has_scale_one_and_zeros():
    w = np.ones((10, 128), np.float32)
    w[:, 5] = 0.0
    w[:, 100] = 0.0
    wq, scales = cpu_ffi.pack_weight_int8(jnp.asarray(w))
    q = np.asarray(cpu_ffi.unpack_weight(wq))
    assert not np.isnan(np.asarray(scales)).any()
    np.testing.assert_array_equal(np.asarray(scales)[[5, 100]], [1.0, 1.0])
    assert not q[:, [5, 100]].any() and (q[:, 0] == 127).all()
    out = _mm(np.ones((3, 10), np.float32), wq, scales)
    assert not out[:, [5, 100]].any() and not np.isnan(out).any()


def test_pack_refuses_a_width_that_does_not_fill_panels():
    with pytest.raises(ValueError, match="100 output columns does not fill panels of 64"):
        cpu_ffi.pack_weight_int8(jnp.zeros((4, 100)))


# ---- The matmuls ----


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_weight_only_is_the_float_kernel_on_the_int8_values_bit_for_bit(m, k, n):
    """The same chain of FMAs over k in order as packed_matmul's whole-K tiles, on float(wq)
    (exact), then one multiply by the scale: the same bits. On the dequantized weights the
    float32 kernel rounds each wq * scale first, so the two differ by float32 rounding only."""
    x, _, wq, scales = _case(m, k, n, seed=m + k)
    out = np.asarray(jax.jit(cpu_ffi.packed_matmul_int8)(jnp.asarray(x), wq, scales))
    assert out.shape == (m, n) and out.dtype == np.float32
    on_values = cpu_ffi.packed_matmul(jnp.asarray(x), wq.astype(jnp.float32), k_block=0)
    np.testing.assert_array_equal(out, np.asarray(on_values) * np.asarray(scales))
    deq = cpu_ffi.dequantize_int8(wq, scales)
    on_deq = np.asarray(cpu_ffi.packed_matmul(jnp.asarray(x), cpu_ffi.pack_weight(deq)))
    ref = x.astype(np.float64) @ np.asarray(deq, np.float64)
    bound = np.abs(x).astype(np.float64) @ np.abs(np.asarray(deq, np.float64))
    assert np.all(np.abs(out - ref) <= 1e-6 * bound + 1e-30)
    assert np.all(np.abs(out - on_deq) <= 1e-6 * bound + 1e-30)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_w8a8_is_the_numpy_int64_reference_exactly(m, k, n):
    x, w, wq, scales = _case(m, k, n, seed=m * k)
    out = np.asarray(
        jax.jit(functools.partial(cpu_ffi.packed_matmul_int8, activations="int8"))(
            jnp.asarray(x), wq, scales
        )
    )
    q, s = _quantize_columns(w)
    np.testing.assert_array_equal(out, _w8a8_reference(x, q, s))
    # And near the float matmul: per-row int8 activations cost about 1% of a sum's magnitude.
    ref = x.astype(np.float64) @ np.asarray(cpu_ffi.dequantize_int8(wq, scales), np.float64)
    bound = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert np.all(np.abs(out - ref) <= 0.02 * bound)


@pytest.mark.parametrize("activations", MODES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_every_element_lands_in_its_place(m, k, n, activations):
    """Integers whose scales are 1 (each row of x and column of w reaches 127): the quantization
    is exact and every float32 sum is too, so both modes must equal numpy's x @ w bit for bit;
    a mix-up of panels, rows, columns, k or scales shows."""
    rng = np.random.default_rng(k + n)
    x = rng.integers(-9, 10, (m, k)).astype(np.float32)
    w = rng.integers(-9, 10, (k, n)).astype(np.float32)
    x[np.arange(m), rng.integers(0, k, m)] = 127
    w[rng.integers(0, k, n), np.arange(n)] = -127
    wq, scales = cpu_ffi.pack_weight_int8(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(scales), 1.0)
    np.testing.assert_array_equal(_mm(x, wq, scales, activations=activations), x @ w)


def test_a_tiny_case_worked_by_hand():
    """K = 3, one panel. Column j's weights are [127, 63.5, -2.5] * t, t = 2 ** (j % 4 - 1): its
    scale is t (exact) and its int8 values [127, 64, -2] (63.5 and -2.5 round to even). With
    x = [[0.5, 1.5, 127]], weight-only gives (0.5 * 127 + 1.5 * 64 - 127 * 2) * t = -94.5 t.
    W8A8 quantizes x by sx = 127 / 127 = 1 to [0, 2, 127] (0.5 and 1.5 round to even), so its
    int32 sum is 0 * 127 + 2 * 64 - 127 * 2 = -126: -126 t."""
    t = 2.0 ** (np.arange(64) % 4 - 1)
    w = (np.array([127, 63.5, -2.5])[:, None] * t).astype(np.float32)
    wq, scales = cpu_ffi.pack_weight_int8(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(scales), t)
    np.testing.assert_array_equal(np.asarray(wq)[0], np.tile([[127], [64], [-2]], (1, 64)))
    x = np.array([[0.5, 1.5, 127]], np.float32)
    np.testing.assert_array_equal(_mm(x, wq, scales)[0], -94.5 * t)
    np.testing.assert_array_equal(_mm(x, wq, scales, activations="int8")[0], -126 * t)


def test_w8a8_rounds_the_activations_half_to_even():
    """A row whose largest value is 127 has sx = 1: its halves round to even (2.5 -> 2, 3.5 -> 4,
    -0.5 -> 0, 126.5 -> 126). Column 64k's only weight is k's, 127 (scale 1), so it is
    127 xq[k] sx.
    K = 23: the halves at k < 16 go through the kernel's 16-lane loop, those after through its
    scalar tail."""
    halves = [2.5, 3.5, -0.5, -1.5, 124.5, 126.5, -126.5]
    want = 127 * np.array([2, 4, 0, -2, 124, 126, -126])
    # Row 1 is row 0 times 7: sx = 7, whose reciprocal is inexact (see the weights' test), so
    # its quotients are the same halves only if the kernel divides; its outputs are 7 times.
    x = np.zeros((2, 23), np.float32)
    x[0, 0] = 127
    x[0, 1:8], x[0, 16:23] = halves, halves
    x[1] = 7 * x[0]
    w = np.zeros((23, 23 * 64), np.float32)
    w[np.arange(23), np.arange(23) * 64] = 127.0
    wq, scales = cpu_ffi.pack_weight_int8(jnp.asarray(w))
    out = _mm(x, wq, scales, activations="int8")[:, np.arange(23) * 64]
    for row, sx in ((0, 1), (1, 7)):
        np.testing.assert_array_equal(out[row, 1:8], sx * want, err_msg=f"row {row}")
        np.testing.assert_array_equal(out[row, 16:23], sx * want, err_msg=f"row {row}")


def test_w8a8_sums_stay_exact_up_to_the_largest_k():
    """All +-127 at the largest K the call takes: the true sums stay within int32
    (127 * 127 * K < 2**31), while the biased ones, (xq + 128) * wq, wrap: still exact."""
    k = cpu_ffi.W8A8_MAX_K
    rng = np.random.default_rng(2)
    x = np.where(rng.random((2, k)) < 0.5, -127.0, 127.0).astype(np.float32)  # sx = 1
    x[1] = 127.0
    q = np.where(rng.random((k, 64)) < 0.5, -127, 127).astype(np.int8)
    q[:, 0] = 127  # row 1, column 0: every product 127 * 127, the largest sum there is
    wq, scales = cpu_ffi.pack_weight(jnp.asarray(q)), jnp.ones(64, jnp.float32)
    out = _mm(x, wq, scales, activations="int8")
    np.testing.assert_array_equal(out, _w8a8_reference(x, q.astype(np.int64), np.ones(64)))
    assert out[1, 0] == np.float32(127 * 127 * k) > 2**30


def _stale_output(x, wq, scales):
    """A call whose every row is computed, freed again: the next call's output is likely this
    memory, so a row the kernel does not write shows as a stale value rather than as 0."""
    _mm(x, wq, scales + 1.0)


@pytest.mark.parametrize("activations", MODES)
@pytest.mark.parametrize("valid", [0, 1, 5, 6, 47, 48, 49, 96, 97, 200])
def test_rows_past_the_real_ones_come_back_zero_and_the_rest_are_unchanged(valid, activations):
    x, _, wq, scales = _case(97, 100, 192, seed=4)
    whole = _mm(x, wq, scales, activations=activations)
    _stale_output(x, wq, scales)
    call = jax.jit(functools.partial(cpu_ffi.packed_matmul_int8, activations=activations))
    out = np.asarray(call(jnp.asarray(x), wq, scales, jnp.int32(valid)))
    cut = min(valid, 97)
    np.testing.assert_array_equal(out[:cut], whole[:cut])
    assert not out[cut:].any()


@pytest.mark.parametrize("activations", MODES)
def test_a_rows_result_does_not_depend_on_its_batch(activations):
    x, _, wq, scales = _case(100, 576, 1536, seed=3)
    whole = _mm(x, wq, scales, activations=activations)
    for rows in ([0], [5, 6, 7], list(range(40, 89)), [99]):
        part = _mm(x[rows], wq, scales, activations=activations)
        np.testing.assert_array_equal(part, whole[rows], err_msg=f"rows {rows[0]}..")


@pytest.mark.parametrize("activations", MODES)
def test_no_k_is_zeros(activations):
    wq, scales = jnp.zeros((2, 5, 64), jnp.int8), jnp.ones(128)
    _stale_output(np.ones((300, 5), np.float32), wq, scales)
    out = _mm(
        np.ones((300, 0), np.float32), jnp.zeros((2, 0, 64), jnp.int8), scales, None, activations
    )
    assert out.shape == (300, 128) and not out.any()


def test_leading_axes_of_x_are_kept():
    x, _, wq, scales = _case(12, 33, 128, seed=5)
    out = np.asarray(cpu_ffi.packed_matmul_int8(jnp.asarray(x).reshape(3, 4, 33), wq, scales))
    np.testing.assert_array_equal(out.reshape(12, 128), _mm(x, wq, scales))


def test_under_jit_valid_is_data_and_the_call_is_in_the_program():
    traces = []

    def step(x, wq, scales, valid):
        traces.append(1)
        return cpu_ffi.packed_matmul_int8(x, wq, scales, valid, activations="int8")

    x, w, wq, scales = _case(20, 64, 128, seed=6)
    jitted = jax.jit(step)
    q, s = _quantize_columns(w)
    for valid in (20, 7, 0):
        out = np.asarray(jitted(jnp.asarray(x), wq, scales, jnp.int32(valid)))
        np.testing.assert_array_equal(out[:valid], _w8a8_reference(x[:valid], q, s))
    assert len(traces) == 1
    lowered = jitted.lower(jnp.asarray(x), wq, scales, jnp.int32(3)).as_text()
    assert cpu_ffi._INT8_MATMUL_TARGET in lowered


def test_bad_shapes_are_sentences_naming_them():
    x, wq, s = jnp.zeros((2, 8)), jnp.zeros((1, 8, 64), jnp.int8), jnp.ones(64)
    mm = cpu_ffi.packed_matmul_int8
    with pytest.raises(ValueError, match=r"got x \(2, 8\) and weights \(1, 9, 64\)\."):
        mm(x, jnp.zeros((1, 9, 64), jnp.int8), s)
    with pytest.raises(ValueError, match=r"got x \(2, 8\) and weights \(1, 8, 32\)\."):
        mm(x, jnp.zeros((1, 8, 32), jnp.int8), s)
    with pytest.raises(ValueError, match=r"float8_e4m3fn weights; got float32\."):
        mm(x, jnp.zeros((1, 8, 64)), s)
    fp8_w8a8 = r"weight-only \(activations='float'\); got activations='int8'\."
    with pytest.raises(ValueError, match=fp8_w8a8):
        mm(x, jnp.zeros((1, 8, 64), jnp.float8_e4m3fn), s, activations="int8")
    with pytest.raises(ValueError, match=r"\(64,\) for weights \(1, 8, 64\); got scales \(128,\)"):
        mm(x, wq, jnp.ones(128))
    with pytest.raises(ValueError, match=r"one of \('float', 'int8'\); got 'int4'\."):
        mm(x, wq, s, activations="int4")
    with pytest.raises(ValueError, match=r"one int32; got \(2,\)\."):
        mm(x, wq, s, jnp.zeros(2, jnp.int32))
    big = cpu_ffi.W8A8_MAX_K + 1  # shapes alone: nothing of that size is allocated
    big_x = jax.ShapeDtypeStruct((1, big), jnp.float32)
    big_w = jax.ShapeDtypeStruct((1, big, 64), jnp.int8)
    with pytest.raises(ValueError, match=rf"K = {big} could overflow; K must be at most"):
        mm(big_x, big_w, s, activations="int8")


MODE = {"int8_activations": np.int64(0)}


def test_the_kernel_refuses_bad_shapes_itself_naming_them():
    """Past the wrapper (a call built by hand), the kernel's own InvalidArgument shows every
    operand's dimensions rather than reading out of bounds."""
    assert cpu_ffi.available()
    call = jax.ffi.ffi_call(cpu_ffi._INT8_MATMUL_TARGET, jax.ShapeDtypeStruct((2, 64), jnp.float32))
    x, v = jnp.zeros((2, 8)), jnp.int32(2)
    with pytest.raises(Exception, match=r"weights \[1, 8, 64\], scales \[32\], out \[2, 64\]\."):
        call(x, jnp.zeros((1, 8, 64), jnp.int8), jnp.ones(32), v, **MODE)
    with pytest.raises(Exception, match=r"got x \[2, 8\], weights \[1, 9, 64\]"):
        call(
            x,
            jnp.zeros((1, 9, 64), jnp.int8),
            jnp.ones(64),
            v,
            **{**MODE, "int8_activations": np.int64(1)},
        )
    w8 = jnp.zeros((1, 8, 64), jnp.float8_e4m3fn)
    with pytest.raises(Exception, match=r"weight-only here: int8_activations must be 0\."):
        call(x, w8, jnp.ones(64), v, int8_activations=np.int64(1))
    with pytest.raises(Exception, match=r"take int8 or float8_e4m3fn weights; got element type"):
        call(x, jnp.zeros((1, 8, 64), jnp.int16), jnp.ones(64), v, **MODE)


# ---- e4m3 weights (weight-only) ----


def _every_e4m3_value() -> jax.Array:  # f8e4m3[254]: every byte but the two NaNs
    """Every finite e4m3 value, from its 256 bytes (0x7F and 0xFF are e4m3fn's NaNs)."""
    bytes_ = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)
    return jax.lax.bitcast_convert_type(jnp.asarray(bytes_), jnp.float8_e4m3fn)


def test_every_e4m3_byte_widens_to_its_exact_value():
    """Row i of the identity times a panel whose column 0 holds every finite e4m3 value:
    each comes back exactly (normals, the 7 subnormals, both zeros' sign aside)."""
    values = _every_e4m3_value()
    n = values.shape[0]
    w = jnp.zeros((n, 64), jnp.float8_e4m3fn).at[:, 0].set(values).at[:, 5].set(values[::-1])
    out = cpu_ffi.packed_matmul_int8(jnp.eye(n), cpu_ffi.pack_weight(w), jnp.ones(64))
    np.testing.assert_array_equal(out[:, 0], values.astype(jnp.float32))
    np.testing.assert_array_equal(out[:, 5], values[::-1].astype(jnp.float32))
    magnitudes = jnp.abs(values.astype(jnp.float32))
    assert float(jnp.min(jnp.where(magnitudes > 0, magnitudes, 1.0))) == 2.0**-9  # subnormals


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_e4m3_weight_only_is_the_float_kernel_on_the_e4m3_values_bit_for_bit(m, k, n):
    x = jax.random.normal(jax.random.key(m + k), (m, k), jnp.float32)
    w = jax.random.normal(jax.random.key(n), (k, n)) * jnp.logspace(-3, 2, n)
    w8 = jnp.clip(w, -448, 448).astype(jnp.float8_e4m3fn)
    scales = jnp.linspace(0.5, 2.0, n, dtype=jnp.float32)
    out = jax.jit(cpu_ffi.packed_matmul_int8)(x, cpu_ffi.pack_weight(w8), scales)
    on_values = cpu_ffi.packed_matmul(x, cpu_ffi.pack_weight(w8.astype(jnp.float32)), k_block=0)
    np.testing.assert_array_equal(out, np.asarray(on_values) * np.asarray(scales))
    sizes = jnp.array([m // 2, m - m // 2], jnp.int32)
    grouped = cpu_ffi.grouped_packed_matmul_int8(
        x, cpu_ffi.pack_weight(jnp.stack([w8, w8])), jnp.stack([scales, scales]), sizes
    )
    np.testing.assert_array_equal(grouped, out)


# ---- Grouped (a mixture of experts' rows, sorted by expert) ----


def _runs(sizes, m):
    """Each group's [start, end) rows: negative sizes count as 0 and the runs stop at m."""
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), m)
    starts = np.concatenate([[0], ends[:-1]])
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def _grouped_case(m, k, n, sizes, seed=0):
    """x [m, k], experts' wq [G, n / 64, k, 64] and scales [G, n]; the scales of experts
    without rows are NaN, so a read of them that reached an output would show."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((len(sizes), k, n), np.float32)
    wq, scales = cpu_ffi.pack_weight_int8(jnp.asarray(w))
    empty = [g for g, (s, e) in enumerate(_runs(sizes, m)) if s == e]
    return x, wq, scales.at[jnp.asarray(empty, jnp.int32)].set(jnp.nan)


@pytest.mark.parametrize("activations", MODES)
@pytest.mark.parametrize(
    "sizes", [[1], [3, 0, 5, 2], [47, 48, 49], [0, 97, 0, 0, 11, 0], [30, -4, 2**31 - 1, 5]]
)
def test_each_grouped_row_is_packed_matmul_int8s_of_that_row_alone(sizes, activations):
    """A row's bits are packed_matmul_int8's of the row alone against its expert's weights and
    scales, whichever rows share the call; rows past the runs are 0; no NaN leaks in."""
    m = 150
    x, wq, scales = _grouped_case(m, 37, 128, sizes, seed=len(sizes))
    out = np.asarray(
        cpu_ffi.grouped_packed_matmul_int8(
            jnp.asarray(x), wq, scales, jnp.asarray(sizes, jnp.int32), activations=activations
        )
    )
    assert out.shape == (m, 128) and not np.isnan(out).any()
    runs = _runs(sizes, m)
    for g, (s, e) in enumerate(runs):
        for r in sorted({s, (s + e) // 2, e - 1}) if e > s else []:
            alone = _mm(x[r : r + 1], wq[g], scales[g], activations=activations)
            np.testing.assert_array_equal(out[r : r + 1], alone, err_msg=f"row {r}, group {g}")
    assert not out[runs[-1][1] :].any()


def test_grouped_every_row_against_numpy():
    sizes = [13, 0, 40, 2]
    x, wq, scales = _grouped_case(60, 70, 192, sizes, seed=8)
    got = {
        a: np.asarray(
            cpu_ffi.grouped_packed_matmul_int8(
                jnp.asarray(x), wq, scales, jnp.asarray(sizes), activations=a
            )
        )
        for a in MODES
    }
    for g, (s, e) in enumerate(_runs(sizes, 60)):
        if s == e:
            continue
        q = np.asarray(cpu_ffi.unpack_weight(wq[g]), np.int64)
        np.testing.assert_array_equal(got["int8"][s:e], _w8a8_reference(x[s:e], q, scales[g]))
        ref = x[s:e].astype(np.float64) @ (q * np.asarray(scales[g], np.float64))
        bound = np.abs(x[s:e]).astype(np.float64) @ np.abs(q * np.asarray(scales[g], np.float64))
        assert np.all(np.abs(got["float"][s:e] - ref) <= 1e-6 * bound)
    assert not got["float"][55:].any() and not got["int8"][55:].any()


def test_grouped_bad_shapes_are_sentences_naming_them():
    x, wq = jnp.zeros((4, 8)), jnp.zeros((3, 2, 8, 64), jnp.int8)
    s, sizes = jnp.ones((3, 128)), jnp.zeros(3, jnp.int32)
    gmm = cpu_ffi.grouped_packed_matmul_int8
    with pytest.raises(ValueError, match=r"got x \(4, 9\) and weights \(3, 2, 8, 64\)\."):
        gmm(jnp.zeros((4, 9)), wq, s, sizes)
    with pytest.raises(ValueError, match=r"got float32\."):
        gmm(x, jnp.zeros((3, 2, 8, 64)), s, sizes)
    with pytest.raises(ValueError, match=r"\(3, 128\) for weights .* got scales \(128,\)\."):
        gmm(x, wq, jnp.ones(128), sizes)
    with pytest.raises(ValueError, match=r"one size per group of the weights, 3; got .* \(2,\)\."):
        gmm(x, wq, s, jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match=r"got 'fp8'\."):
        gmm(x, wq, s, sizes, activations="fp8")


def test_the_vector_kernels_follow_the_cpus_flags(monkeypatch):
    """Weight-only's vector path needs AVX-512F; W8A8's also BW and VNNI (vpdpbusd)."""
    assert cpu_ffi.available()
    for flags, want in [
        ("avx2 avx512f avx512bw avx512_vnni", (True, True)),
        ("avx2 avx512f avx512bw", (True, False)),
        ("avx2 avx_vnni", (False, False)),
    ]:
        monkeypatch.setattr(cpu_ffi, "_cpu_flags", lambda flags=flags: f"x86_64 flags : {flags}")
        got = tuple(cpu_ffi.int8_matmul_available(a) for a in MODES)
        assert got == want, flags
