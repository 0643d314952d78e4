"""The 8-bit KV cache (--kv-cache-dtype int8 | fp8) at the kernels: the quantization, the pool
layout with its scale lanes, the write, and every attention path on quantized pages against the
reference over the dequantized pool (the float pool of the very same keys and values).

Unused slots of a quantized pool hold random bytes (scale exponents that overflow to inf, e4m3
NaNs), the quantized counterpart of the float tests' NaN: a read of a slot no query sees shows
up in the output.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.attention import write_kv
from pallas_kernels.ragged_paged_attention import common, cpu_ffi, reference, xla_blocked
from tests.kernels.test_ragged_paged_attention import CASES, Case, make_inputs

KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": 448.0}


def quantized_inputs(case: Case, kv_dtype, seed: int = 0, shards: int = 1) -> tuple:
    """make_inputs(case) with its pool quantized to `kv_dtype` (scale lanes, the case's lane
    alignment) and every slot the float pool left NaN filled with random bytes."""
    args = make_inputs(dataclasses.replace(case, dtype=jnp.float32), seed)
    q, pool = args[0].astype(case.dtype), np.asarray(args[1])
    hkv, d = case.num_kv_heads, case.head_dim
    k, v = common.split_kv(jnp.asarray(pool), hkv, d)
    lanes = common.kv_lanes(hkv, d, shards, case.lane_align, quantized=True)
    qpool = np.array(common.fuse_kv(k, v, lanes, shards, kv_dtype))
    unused = np.isnan(pool[..., 0])
    rng = np.random.default_rng(seed + 1)
    garbage = rng.integers(0, 256, size=(int(unused.sum()), lanes), dtype=np.uint8)
    qpool.view(np.uint8)[unused] = garbage
    return (q, jnp.asarray(qpool), *args[2:])


def assert_dequantizes_near(got, x, name: str) -> None:
    """|got - x| within what `name` loses of each (token, head) row: half an int8 step (at most
    max|x| / 127), or e4m3's relative 2^-4 (at most max|x| / 16)."""
    x = np.asarray(x, np.float32)
    bound = np.abs(x).max(-1, keepdims=True) / (127.0 if name == "int8" else 16.0)
    assert np.all(np.abs(np.asarray(got, np.float32) - x) <= bound + 1e-7)


def _kwargs(case: Case) -> dict:
    return dict(
        sm_scale=case.head_dim**-0.5,
        num_kv_heads=case.num_kv_heads,
        sliding_window=case.sliding_window,
    )


def _float_reference(case: Case, args) -> np.ndarray:
    """The reference over the dequantized pool: what every path on quantized pages must give."""
    q, qpool, *rest = args
    fpool = common.dequantize_pool(qpool, case.num_kv_heads, case.head_dim, jnp.float32)
    return np.asarray(
        reference.ragged_paged_attention(q.astype(jnp.float32), fpool, *rest, **_kwargs(case))
    )


@pytest.mark.parametrize("name", list(KV_DTYPES))
def test_quantize_error_and_exponents(name):
    dtype, qmax = KV_DTYPES[name], QMAX[name]
    rng = np.random.default_rng(0)
    # Rows of very different magnitudes, one of zeros, one past the exponent range.
    x = (
        rng.normal(size=(6, 3, 64)).astype(np.float32)
        * np.array([1e-3, 0.1, 1, 7, 300, 0])[:, None, None]
    )
    x[5, 1] = 1e9  # saturates at the largest exponent
    vals, e = common.quantize(jnp.asarray(x), dtype)
    assert vals.dtype == dtype and e.dtype == jnp.int32 and e.shape == (6, 3)
    e = np.asarray(e)
    scale = 2.0 ** e[..., None]
    deq = np.asarray(vals, np.float32) * scale
    amax = np.abs(x).max(-1)
    inside = (amax > 0) & (amax < qmax * 2.0**common.SCALE_EXP_MAX)
    # The least exponent that fits: max|x| / 2^e in (qmax / 2, qmax] where not clipped.
    ratio = amax[inside] / 2.0 ** e[inside]
    clipped = e[inside] == common.SCALE_EXP_MIN
    assert np.all(ratio <= qmax) and np.all((ratio > qmax / 2) | clipped)
    assert np.all(e >= common.SCALE_EXP_MIN) and np.all(e <= common.SCALE_EXP_MAX)
    err = np.abs(deq - x)[inside]
    if name == "int8":  # round to nearest: half a step
        assert np.all(err <= 0.5 * scale[inside] + 1e-12)
    else:  # e4m3: 3 mantissa bits, a relative error under 2^-4 in its normal range
        normal = np.abs(x[inside]) / scale[inside] >= 2.0**-6
        assert np.all(err[normal] <= 2.0**-4 * np.abs(x[inside][normal]))
        assert np.all(err[~normal] <= 2.0**-10 * np.broadcast_to(scale[inside], err.shape)[~normal])
    np.testing.assert_array_equal(deq[5, 0], 0.0)  # zeros stay zeros
    assert np.isfinite(deq).all() and np.abs(np.asarray(vals, np.float32)).max() <= qmax


@pytest.mark.parametrize("name", list(KV_DTYPES))
def test_layout_puts_each_shards_exponents_at_its_block_end(name):
    """Two shards of 2 KV heads, lanes padded to 128: each block ends with its own heads'
    (key, value) exponents and split_kv of each block alone returns its heads."""
    dtype = KV_DTYPES[name]
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.normal(size=(5, 4, 16)) * 3, jnp.float32)
    v = jnp.asarray(rng.normal(size=(5, 4, 16)) / 5, jnp.float32)
    lanes = common.kv_lanes(4, 16, shards=2, align=128, quantized=True)
    assert lanes == 256 and common.kv_lanes(4, 16, quantized=True) == 4 * 2 * 16 + 8
    rows = np.asarray(common.fuse_kv(k, v, lanes, shards=2, dtype=dtype))
    assert rows.dtype == np.dtype(dtype)
    for shard in range(2):
        block = rows[:, shard * 128 : (shard + 1) * 128]
        heads = slice(2 * shard, 2 * shard + 2)
        _, ek = common.quantize(k[:, heads], dtype)
        _, ev = common.quantize(v[:, heads], dtype)
        want = np.stack([ek, ev], -1).reshape(5, 4)
        np.testing.assert_array_equal(block[:, -4:].astype(np.float32), want)
        np.testing.assert_array_equal(block[:, 64:-4].astype(np.float32), 0)  # the gap
        kd, vd = common.split_kv(jnp.asarray(block), 2, 16)
        assert_dequantizes_near(kd, k[:, heads], name)
        assert_dequantizes_near(vd, v[:, heads], name)
    assert common.kv_heads_of(jnp.zeros((1, 1, 1, 4 * 32 + 8), dtype), 16, None) == 4


@pytest.mark.parametrize("name", list(KV_DTYPES))
def test_write_kv_quantizes_each_row_and_drops_padding(name):
    dtype = KV_DTYPES[name]
    hkv, d, page_size = 2, 32, 4
    lanes = common.kv_lanes(hkv, d, quantized=True)
    pool = jnp.zeros((2, 3, page_size, lanes), dtype)
    rng = np.random.default_rng(2)
    k = jnp.asarray(rng.normal(size=(3, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(3, hkv, d)) * 10, jnp.float32)
    slots = jnp.asarray([5, 2, 3 * page_size], jnp.int32)  # the last is padding: dropped
    out = jax.jit(write_kv)(pool, jnp.int32(1), k, v, slots)
    assert out.dtype == dtype
    got_k, got_v = common.split_kv(out[1].reshape(-1, lanes), hkv, d)
    for row, slot in ((0, 5), (1, 2)):
        want = common.fuse_kv(k[row], v[row], lanes, 1, dtype)
        np.testing.assert_array_equal(
            np.asarray(out[1].reshape(-1, lanes)[slot]).view(np.uint8),
            np.asarray(want).view(np.uint8),
        )
        assert_dequantizes_near(got_k[slot], k[row], name)
        assert_dequantizes_near(got_v[slot], v[row], name)
    written = np.zeros(3 * page_size, bool)
    written[[5, 2]] = True
    assert not np.asarray(out[1].reshape(-1, lanes)[~written]).view(np.uint8).any()
    assert not np.asarray(out[0]).view(np.uint8).any()  # the other layer untouched


@pytest.mark.skipif(not cpu_ffi.available(), reason="the CPU kernels' library did not build")
def test_an_e4m3_pool_is_written_in_place_on_the_cpu_never_widened():
    """XLA:CPU has no float8 scatter: it widened the whole e4m3 pool to float16 and back around
    each write (50x a decode step). The CPU's step writes the rows in C++ on the pool's own
    buffer; the bytes are those of the scatter, padding dropped, a slot past the end too."""
    dtype = jnp.float8_e4m3fn
    hkv, d, page_size = 2, 32, 4
    lanes = common.kv_lanes(hkv, d, quantized=True)
    rng = np.random.default_rng(3)
    raw = rng.integers(-120, 120, size=(2, 3, page_size, lanes)).astype(np.int8)
    pool = jax.lax.bitcast_convert_type(jnp.asarray(raw), dtype)
    k = jnp.asarray(rng.normal(size=(4, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(4, hkv, d)), jnp.float32)
    slots = jnp.asarray([5, 0, 11, 3 * page_size + 7], jnp.int32)
    write = jax.jit(write_kv, donate_argnums=0)
    text = write.lower(pool, jnp.int32(1), k, v, slots).compile().as_text()
    assert "jaxserve_write_rows" in text
    assert f"f16[2,3,{page_size},{lanes}]" not in text, "the pool was widened to float16"
    rows = common.fuse_kv(k, v, lanes, 1, dtype)
    want = pool.at[1, slots // page_size, slots % page_size].set(rows, mode="drop")
    got = write(jnp.array(pool), jnp.int32(1), k, v, slots)
    np.testing.assert_array_equal(
        np.asarray(jax.lax.bitcast_convert_type(got, jnp.int8)),
        np.asarray(jax.lax.bitcast_convert_type(want, jnp.int8)),
    )
    with pytest.raises(ValueError, match=r"8-bit pool and rows of its dtype; got a float32 pool"):
        cpu_ffi.write_rows(jnp.zeros((1, 1, 1, 4)), jnp.int32(0), jnp.zeros((1, 4)), slots[:1])


CPU_CASES = ["decode", "mixed", "mixed_window", "padded_lanes"]


@pytest.mark.parametrize("name", list(KV_DTYPES))
@pytest.mark.parametrize("case_name", CPU_CASES)
def test_reference_and_xla_on_quantized_pages_match_the_dequantized_pool(name, case_name):
    """The reference and the CPU's XLA path (its C++ decode call for f32 decode rows, the jnp
    tiles for the rest, the jnp decode loop for bf16) on the quantized pool, against the
    reference over the float pool of the same values."""
    case = CASES[case_name]
    args = quantized_inputs(case, KV_DTYPES[name])
    want = _float_reference(case, args)
    tol = 2e-5 if case.dtype == jnp.float32 else 3e-2
    got_ref = np.asarray(reference.ragged_paged_attention(*args, **_kwargs(case)), np.float32)
    got_xla = jax.jit(lambda *a: xla_blocked.ragged_paged_attention(*a, **_kwargs(case)))(*args)
    got_xla = np.asarray(got_xla, np.float32)
    total = sum(q for q, _ in case.chunks)
    for got in (got_ref, got_xla):
        assert np.isfinite(got).all(), "a read of an unused slot (its garbage bytes)"
        np.testing.assert_array_equal(got[total:], 0.0)
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.mark.skipif(not cpu_ffi.available(), reason="the C++ CPU kernels did not build")
@pytest.mark.parametrize("name", list(KV_DTYPES))
def test_cpu_decode_call_dequantizes_as_the_jnp_loop(name):
    """cpu_ffi.decode_attention's 8-bit call against the jnp decode loop on the same quantized
    pool and plan, sliding window included, and against the float pool through the float call."""
    case = Case(((1, 9), (1, 1), (1, 16), (1, 4), (1, 7)), 4, 8, 2, 64, jnp.float32, 8, 6)
    q, qpool, layer, query_start, kv_lens, page_tables, num_seqs = quantized_inputs(
        case, KV_DTYPES[name]
    )
    fpool = common.dequantize_pool(qpool, 2, 64, jnp.float32)
    plan = xla_blocked.plan_step(8, query_start, kv_lens, num_seqs)
    for window in (None, 3):
        outs = []
        for pool in (qpool, fpool):
            p = xla_blocked._Pool(pool, layer, page_tables, kv_lens, 2, 64, jnp.float32)
            outs.append(xla_blocked._decode_loop(q, p, plan, 0.125, window))
            is_decode = plan.decode_rows < 8
            kv_len = jnp.where(is_decode, kv_lens, 0)
            lowest = jnp.zeros_like(kv_len) if window is None else kv_len - window
            qd = q[jnp.minimum(plan.decode_rows, 7)].reshape(6, 2, 4, 64)
            native = cpu_ffi.decode_attention(qd, pool, layer, page_tables, kv_len, lowest, 0.125)
            outs.append(np.asarray(native).reshape(6, 8, 64))
        loop_q, native_q, loop_f, native_f = map(np.asarray, outs)
        assert np.isfinite(native_q).all()
        for got in (native_q, loop_f, native_f):
            np.testing.assert_allclose(got, loop_q, atol=2e-5, rtol=2e-5)


TPU_CASES = {
    # Decode rows of 2 KV heads, head_dim 64, f32, the lanes unpadded (2 * 2 * 64 + 4).
    "decode": CASES["decode"],
    # A mixed bf16 batch with a sliding window, lanes padded to 128 (the exponents end the
    # tile after the gap), head_dim 16 as the tiny shapes.
    "padded_window": Case(
        ((6, 14), (1, 9), (3, 3)), 4, 4, 2, 16, jnp.bfloat16, 12, 4, 5, lane_align=128
    ),
}


@pytest.mark.parametrize("name", list(KV_DTYPES))
@pytest.mark.parametrize("case_name", list(TPU_CASES))
def test_tpu_kernel_on_quantized_pages_matches_the_dequantized_pool(name, case_name):
    """The Pallas TPU kernel in interpret mode (race detector on, two simulated cores), reading
    8-bit pages and dequantizing each key block, against the reference over the float pool."""
    from tests.kernels.test_ragged_paged_attention import SMALL_TPU, tpu_interpret

    case = TPU_CASES[case_name]
    args = quantized_inputs(case, KV_DTYPES[name])
    want = _float_reference(case, args)
    got = np.asarray(tpu_interpret(*args, block_sizes=SMALL_TPU, **_kwargs(case)), np.float32)
    assert np.isfinite(got).all(), "a read of an unused slot (its garbage bytes)"
    np.testing.assert_array_equal(got[sum(q for q, _ in case.chunks) :], 0.0)
    tol = 2e-5 if case.dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


GPU_CASES = ["decode", "mixed", "mixed_window"]


@pytest.mark.parametrize("name", list(KV_DTYPES))
@pytest.mark.parametrize("case_name", GPU_CASES)
def test_triton_kernel_on_quantized_pages_matches_the_dequantized_pool(name, case_name):
    """The Triton kernel in interpret mode, loading 8-bit keys and values with their exponents,
    with key splits (SMALL_GPU), against the reference over the float pool."""
    from tests.kernels.test_ragged_paged_attention import SMALL_GPU, gpu_interpret

    case = CASES[case_name]
    args = quantized_inputs(case, KV_DTYPES[name])
    want = _float_reference(case, args)
    got = np.asarray(gpu_interpret(*args, block_sizes=SMALL_GPU, **_kwargs(case)), np.float32)
    assert np.isfinite(got).all(), "a read of an unused slot (its garbage bytes)"
    np.testing.assert_array_equal(got[sum(q for q, _ in case.chunks) :], 0.0)
    tol = 2e-5 if case.dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_on_a_gpu_8_bit_pools_go_to_triton_or_the_xla_attention_with_a_log_line(caplog):
    """kernel_choice gives 8-bit pools to the Triton kernel (never Mosaic GPU, whose wgmma path
    takes 16-bit pools), e4m3 only from compute capability 8.9; where none takes the pool,
    `pallas_gpu` runs the XLA attention, which dequantizes (logged once, the same values); the
    Mosaic GPU kernel forced by name refuses an 8-bit pool in a sentence."""
    from jaxserve.models import attention
    from pallas_kernels.ragged_paged_attention import kernel_choice

    def choice(capability, dtype):
        return kernel_choice.choose_gpu_kernel(
            capability, dtype, head_dim=64, page_size=16, num_q_heads=8, num_kv_heads=2
        )

    assert choice("8.0", jnp.int8) == choice("9.0", jnp.int8) == kernel_choice.TRITON
    assert choice("9.0", jnp.float8_e4m3fn) == choice("8.9", jnp.float8_e4m3fn) == "triton"
    assert choice("8.0", jnp.float8_e4m3fn) is None
    case = CASES["mixed"]
    args = quantized_inputs(case, jnp.float8_e4m3fn)
    attention._log_quantized_fallback.cache_clear()
    with caplog.at_level("WARNING", logger="jaxserve.models.attention"):
        got = attention._chosen_gpu_kernel("8.0", "NVIDIA A100", *args, **_kwargs(case))
    assert any("XLA attention reads and dequantizes" in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), _float_reference(case, args), atol=3e-2, rtol=3e-2
    )
    with pytest.raises(ValueError, match="The Mosaic GPU kernel cannot read a float8_e4m3fn"):
        attention.get_attention_fn("pallas_gpu_mosaic_interpret")(*args, **_kwargs(case))


@pytest.mark.skipif(not cpu_ffi.available(), reason="the C++ CPU kernels did not build")
@pytest.mark.parametrize("name", list(KV_DTYPES))
def test_cpu_decode_call_reads_every_byte_as_jax_does(name):
    """64 decode slots of one token each, so each slot's output is its token's values exactly:
    value bytes through all 256 codes (every e4m3 subnormal, zero, negative and the largest;
    e4m3's two NaN codes left out), exponents across [-16, 16]. The C++ call's table must decode
    each byte as JAX's conversion does (split_kv of the same rows)."""
    dtype = KV_DTYPES[name]
    hkv, d, page_size, slots = 2, 32, 4, 64
    lanes = common.kv_lanes(hkv, d, quantized=True)
    codes = np.arange(256, dtype=np.uint8)
    if name == "fp8":
        codes = codes[(codes & 0x7F) != 0x7F]
    rng = np.random.default_rng(5)
    raw = rng.choice(codes, size=(1, slots, page_size, lanes))
    exps = rng.integers(common.SCALE_EXP_MIN, common.SCALE_EXP_MAX + 1, (1, slots, page_size, 4))
    pool = raw.view(np.dtype(dtype)).copy()
    pool[..., -2 * hkv :] = exps.astype(np.dtype(dtype))
    table = jnp.asarray(rng.permutation(slots)[:, None], jnp.int32)  # slot s reads one page
    kv_len = jnp.ones(slots, jnp.int32)
    q = jnp.asarray(rng.normal(size=(slots, hkv, 2, d)), jnp.float32)
    got = cpu_ffi.decode_attention(q, jnp.asarray(pool), jnp.int32(0), table, kv_len, 0 * kv_len, 1)
    _, want = common.split_kv(jnp.asarray(pool[0, np.asarray(table[:, 0]), 0]), hkv, d)
    want = np.broadcast_to(np.asarray(want)[:, :, None, :], (slots, hkv, 2, d))
    assert np.unique(raw[0, np.asarray(table[:, 0]), 0, : 2 * hkv * d]).size == codes.size
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("name", list(KV_DTYPES))
def test_triton_kernel_on_quantized_pages_lowers_for_cuda(name):
    """Lowering (not compiling: that needs the CUDA compile set) for sm_90 catches what Triton
    cannot take: an int `other` cast to fp8 did not lower until the e4m3 loads took 0.0."""
    from pallas_kernels.ragged_paged_attention import gpu_kernel
    from tests.kernels.test_ragged_paged_attention import gpu_target

    case = Case(((9, 40), (1, 17), (1, 3)), 16, 8, 2, 128, jnp.bfloat16, 16, 4)
    fn = functools.partial(gpu_kernel.ragged_paged_attention, sm_scale=0.1)
    args = quantized_inputs(case, KV_DTYPES[name])  # eager: before the abstract mesh (JAX 0.12)
    with gpu_target():
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()


def test_the_8_bit_lanes_and_padding_of_llama3_1_8b():
    """8 KV heads of 128: 2048 lanes of keys and values and 16 of exponents, a 17th 128-lane
    tile on TPU (padding 1.0625 over the keys' and values' own bytes), none elsewhere; a page
    is 0.53x the bytes of a bfloat16 one."""
    from checkpoints import NAMED_SHAPES
    from jaxserve.models import kv_pool

    config = NAMED_SHAPES["llama3.1-8b"]
    assert kv_pool.kv_lanes(config, 1, "tpu", jnp.int8) == 2176
    assert kv_pool.kv_lanes(config, 1, "cpu", jnp.float8_e4m3fn) == 2064
    assert kv_pool.kv_lanes(config, 1, "tpu", jnp.bfloat16) == 2048
    assert kv_pool.kv_lanes(config, 2, "tpu", jnp.int8) == 2 * 1152  # 4 heads: 1028 -> 9 tiles
    assert kv_pool.pool_padding(config, 2176, 16, jnp.int8, "tpu") == 2176 / 2048
    int8 = kv_pool.kv_bytes_per_page(config, 16, jnp.int8, 2176)
    bf16 = kv_pool.kv_bytes_per_page(config, 16, jnp.bfloat16, 2048)
    assert int8 / bf16 == 2176 / 4096
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is not one of"):
        kv_pool.resolve_kv_cache_dtype("int4", jnp.bfloat16)
    assert kv_pool.resolve_kv_cache_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert kv_pool.resolve_kv_cache_dtype("fp8", jnp.float32) == jnp.float8_e4m3fn
