"""The CPU's native attention (cpu_decode.cc through cpu_ffi) against the dense reference.

Decode rows at contexts that cross pages, GQA ratios 1-4, a sliding window, padding slots, and
head sizes both of the vectorised path (32, 64, 128, 256) and of the scalar one (16, 80), and pages
longer than the 16 keys the vectorised path scores at once. Pools are
NaN wherever no query may look (make_inputs), so a read past a row's context or outside its
window shows. Each case also checks that the step really lowered to the native call: a silent
fall back to the jnp loop would pass the numbers and fail here.
"""

from __future__ import annotations

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import cpu_ffi, xla_blocked
from tests.kernels.test_ragged_paged_attention import Case, make_inputs
from tests.kernels.test_xla_blocked import _check

F32 = jnp.float32

# Skipped only where there is no compiler: where there is one, a library that fails to build
# fails here (test_the_library_builds_here) rather than skipping every case.
pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler (g++ or $CXX)"
)


def test_the_library_builds_here():
    """The build's own error (the compiler's message) rather than a skip of every case."""
    cpu_ffi._build()
    assert cpu_ffi.available()


CASES = {
    # head_dim 64 (4 vectors), GQA 3 as in smollm2-135m, pages of 16; decodes of 1..40 keys.
    "d64_gqa3": Case(((1, 1), (1, 17), (1, 40), (1, 16), (1, 33)), 16, 9, 3, 64, F32, 8, 7),
    # head_dim 128, GQA 4, pages of 4: many page boundaries per row, a padding slot.
    "d128_gqa4": Case(((1, 9), (1, 23), (1, 2)), 4, 8, 2, 128, F32, 4, 4),
    # head_dim 256 (Gemma's), no GQA.
    "d256_mha": Case(((1, 5), (1, 12)), 4, 2, 2, 256, F32, 2, 2),
    # A window of 7 over decodes longer and shorter than it (d64, GQA 2).
    "window": Case(((1, 30), (1, 3), (1, 8), (1, 7)), 4, 4, 2, 64, F32, 4, 4, 7),
    # head_dim 32 (the `tiny` benchmark model's), GQA 2, pages of 40: each page is scored in
    # blocks of 16, 16 and 8 keys, the online softmax carried across blocks and pages.
    "d32_pages40": Case(((1, 97), (1, 40), (1, 41), (1, 1)), 40, 8, 4, 32, F32, 4, 5),
    # The scalar path: head_dim 16 and 80 (the vectorised one takes 32, 64, 128 and 256).
    "d16_scalar": Case(((1, 10), (1, 3)), 4, 4, 2, 16, F32, 2, 3),
    "d80_scalar": Case(((1, 21), (1, 6)), 8, 2, 1, 80, F32, 2, 2, 11),
    # Decodes beside a prefill chunk: the native call runs the decode rows, the tiles the rest.
    "beside_prefill": Case(((6, 14), (1, 9), (1, 20)), 4, 4, 2, 64, F32, 12, 4),
    # Enough keys for two workers on the intra-op pool (8 rows x 2 KV heads x ~300 keys).
    "two_workers": Case(tuple((1, 280 + 7 * i) for i in range(8)), 16, 4, 2, 64, F32, 8, 8),
}


# Prefill chunks through the native prefill call (head sizes 32-256): first and later chunks,
# chunks longer than its 16-row items and not aligned to them, chunks crossing pages of 4, 16 and
# 40 keys, GQA 1-4, windows shorter and longer than a chunk, decodes beside them.
PREFILL_CASES = {
    "d64_gqa3_later_chunks": Case(((37, 50), (1, 9), (16, 16), (2, 30)), 16, 9, 3, 64, F32, 64, 6),
    "d32_pages40": Case(((21, 21), (19, 100), (1, 41)), 40, 8, 4, 32, F32, 48, 4),
    "d128_gqa4_pages4": Case(((9, 13), (3, 3), (1, 7)), 4, 8, 2, 128, F32, 16, 4),
    "d256_mha": Case(((5, 5), (4, 11)), 4, 2, 2, 256, F32, 12, 2),
    "window_short": Case(((30, 44), (1, 20), (6, 6)), 8, 4, 2, 64, F32, 40, 4, 5),
    "window_long": Case(((20, 20), (9, 33)), 4, 4, 1, 64, F32, 32, 2, 25),
}


@pytest.mark.parametrize("name", list(PREFILL_CASES), ids=str)
def test_native_prefill_matches_reference(name: str):
    case = PREFILL_CASES[name]
    args = make_inputs(case)
    fn = _attention(case)
    assert "jaxserve_ragged_attention" in fn.lower(*args).as_text(), "fell back to the tiles"
    _check(case, np.asarray(fn(*args)))


def test_native_prefill_matches_the_tiles_it_replaces(monkeypatch):
    """The same prefill rows through both paths: they differ by float summation order only."""
    case = PREFILL_CASES["d64_gqa3_later_chunks"]
    args = make_inputs(case, seed=5)
    native = np.asarray(_attention(case)(*args))
    monkeypatch.setattr(xla_blocked.cpu_ffi, "ragged_available", lambda head_dim: False)
    tiles = _attention(case)
    assert "jaxserve_ragged_attention" not in tiles.lower(*args).as_text()
    np.testing.assert_allclose(native, np.asarray(tiles(*args)), atol=1e-6, rtol=1e-6)


def _attention(case: Case):
    return jax.jit(
        functools.partial(
            xla_blocked.ragged_paged_attention,
            sm_scale=case.head_dim**-0.5,
            sliding_window=case.sliding_window,
        )
    )


@pytest.mark.parametrize("call", ["ragged", "decode"])
@pytest.mark.parametrize("name", list(CASES), ids=str)
def test_native_decode_matches_reference(name: str, call: str, monkeypatch):
    """Through the one ragged call where it takes the head size, and through the decode call
    beside the jnp tiles (the ragged call switched off, and for the other head sizes)."""
    case = CASES[name]
    if call == "decode":
        monkeypatch.setattr(xla_blocked.cpu_ffi, "ragged_available", lambda head_dim: False)
    ragged = call == "ragged" and case.head_dim in cpu_ffi.RAGGED_HEAD_DIMS
    args = make_inputs(case)
    fn = _attention(case)
    text = fn.lower(*args).as_text()
    want = "jaxserve_ragged_attention" if ragged else "jaxserve_decode_attention"
    assert want in text, "fell back to the jnp loop"
    _check(case, np.asarray(fn(*args)))  # NaN-free, padding 0, the reference's values


def test_native_call_matches_the_jnp_loop_it_replaces():
    """The same decode rows through both: they differ by float summation order only."""
    case = CASES["d64_gqa3"]
    q, kv_pool, layer, query_start, kv_lens, page_tables, num_seqs = make_inputs(case, seed=3)
    kv_pool = jnp.nan_to_num(kv_pool)  # the loop masks V, not K: keep its scores finite
    plan = xla_blocked.plan_step(q.shape[0], query_start, kv_lens, num_seqs)
    pool = xla_blocked._Pool(kv_pool, layer, page_tables, kv_lens, 3, case.head_dim)
    native = jax.jit(lambda q: xla_blocked._decode(q, pool, plan, 0.125, None))(q)
    loop = jax.jit(lambda q: xla_blocked._decode_loop(q, pool, plan, 0.125, None))(q)
    np.testing.assert_allclose(np.asarray(native), np.asarray(loop), atol=1e-6, rtol=1e-6)


def test_switched_off_by_the_environment(monkeypatch):
    """JAXSERVE_CPU_FFI=0 runs the jnp loop: the lowered step has no native call."""
    monkeypatch.setenv("JAXSERVE_CPU_FFI", "0")
    cpu_ffi.available.cache_clear()
    try:
        case = CASES["d64_gqa3"]
        assert not cpu_ffi.available()
        text = _attention(case).lower(*make_inputs(case)).as_text()
        assert "jaxserve_decode_attention" not in text
        assert "jaxserve_ragged_attention" not in text
    finally:
        monkeypatch.delenv("JAXSERVE_CPU_FFI")
        cpu_ffi.available.cache_clear()
        assert cpu_ffi.available()


def test_build_without_a_compiler_says_so(monkeypatch, tmp_path):
    """No compiler: the build raises a sentence naming what is missing (available() logs it and
    falls back); a library already in the cache is reused without one."""
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-jaxserve")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu_ffi._build()
    monkeypatch.delenv("CXX")
    built = cpu_ffi._build()
    assert built.parent == tmp_path / "ffi" and built.stat().st_size > 0
    monkeypatch.setenv("CXX", "no-such-compiler-jaxserve")
    assert cpu_ffi._build() == built  # cached: no compiler needed


@pytest.mark.parametrize("name", ["d64_gqa3_later_chunks", "d32_pages40", "window_short"])
def test_rope_write_attention_is_rope_then_write_then_attention(name: str):
    """The fused call (what the model runs on the CPU) against its three parts in jnp: the pool
    rows it writes are bit for bit write_kv's of the same RoPE, the rows it leaves are untouched,
    padding tokens write nothing, and the output is the ragged call's on the roped queries."""
    from jaxserve.models.attention import write_kv
    from jaxserve.models.llama import _rope

    case = PREFILL_CASES[name]
    q, kv_pool, layer, query_start, kv_lens, page_tables, num_seqs = make_inputs(case, seed=7)
    rng = np.random.default_rng(8)
    t, hkv, d = case.num_tokens, case.num_kv_heads, case.head_dim
    q = jnp.asarray(rng.normal(size=(t, case.num_heads, d)), F32)
    k = jnp.asarray(rng.normal(size=(t, hkv, d)), F32)
    v = jnp.asarray(rng.normal(size=(t, hkv, d)), F32)
    angles = rng.normal(size=(t, d // 2)) * 3
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.asarray(np.cos(angles), F32), jnp.asarray(np.sin(angles), F32)
    slots = np.full(t, kv_pool.shape[1] * case.page_size, np.int32)  # padding: out of range
    for s, (q_len, kv_len) in enumerate(case.chunks):
        for i, pos in enumerate(range(kv_len - q_len, kv_len)):
            page = int(page_tables[s, pos // case.page_size])
            slots[int(query_start[s]) + i] = page * case.page_size + pos % case.page_size
    slots = jnp.asarray(slots)
    window, scale = case.sliding_window, d**-0.5

    @jax.jit
    def fused(kv_pool):
        return cpu_ffi.rope_write_attention(
            q.reshape(t, hkv, -1, d),
            k,
            v,
            cos,
            sin,
            slots,
            kv_pool,
            layer,
            query_start,
            kv_lens,
            page_tables,
            num_seqs,
            scale,
            window,
        )

    @jax.jit
    def parts(kv_pool):
        kv_pool = write_kv(kv_pool, layer, _rope(k, cos, sin), v, slots)
        out = cpu_ffi.ragged_attention(
            _rope(q, cos, sin).reshape(t, hkv, -1, d),
            kv_pool,
            layer,
            query_start,
            kv_lens,
            page_tables,
            num_seqs,
            scale,
            window,
        )
        return out, kv_pool

    (out, pool), (want_out, want_pool) = fused(kv_pool), parts(kv_pool)
    np.testing.assert_array_equal(np.asarray(pool), np.asarray(want_pool))  # NaN == NaN here
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    assert not np.array_equal(np.asarray(pool), np.asarray(kv_pool), equal_nan=True)


def test_a_prefill_row_does_not_depend_on_the_rows_computed_beside_it():
    """A row's output, bit for bit, whether its chunk starts at 0 or at position 30: the rows its
    work item and tile share change (items start every 16 rows from the chunk's first), and a
    pair's arithmetic must stay one chain as if alone (what batch invariance needs)."""
    hkv, g, d, page, kv_len, tail = 3, 3, 64, 16, 37, 7
    assert cpu_ffi.ragged_available(d)  # built and registered
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((1, 4, page, 2 * hkv * d), dtype=np.float32)
    table = jnp.asarray([[2, 0, 3]], jnp.int32)
    q = rng.standard_normal((kv_len, hkv, g, d), dtype=np.float32)

    def rows(first: int) -> np.ndarray:  # the chunk of positions [first, kv_len)
        out = cpu_ffi.ragged_attention(
            jnp.asarray(q[first:]),
            jnp.asarray(pool),
            0,
            jnp.asarray([0, kv_len - first], jnp.int32),
            jnp.asarray([kv_len], jnp.int32),
            table,
            1,
            d**-0.5,
            None,
        )
        return np.asarray(out)

    whole, late = rows(0), rows(kv_len - tail)
    assert np.isfinite(whole).all() and np.abs(whole).max() > 0
    np.testing.assert_array_equal(whole[kv_len - tail :], late)
