"""The tiled jnp attention (the CPU's production path) against the dense reference.

Small tiles (4 query rows, 8 keys) make tiny batches cross every boundary the real sizes cross
at scale: chunks longer than a tile and not aligned to tiles, tiles whose padding rows belong to
the next sequence, several key blocks with the online softmax carried between them, and windows
that start mid-block. Pools are NaN wherever no query may look (see make_inputs), so a stray read
shows. Each test jits one function at a handful of shapes to keep compiles few.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import reference, xla_blocked
from tests.kernels.test_ragged_paged_attention import (
    TINY_ANSWER,
    Case,
    make_inputs,
    tiny_case,
)

F32 = jnp.float32

# (q_len, kv_len) per sequence; each case mixes prefill chunks (first and later ones) and decodes.
RAGGED = {
    # GQA 2, pages of 4: a 9-row chunk (3 tiles, the last one row), decodes, a 2-row first chunk.
    "gqa2": Case(((9, 21), (1, 7), (1, 30), (2, 2), (5, 12)), 4, 4, 2, 16, F32, 24, 8),
    # GQA 4 (one KV head), pages of 2: decodes first, a long later chunk, a padding slot after.
    "gqa4": Case(((1, 3), (1, 17), (7, 19), (3, 3), (1, 1)), 2, 4, 1, 16, F32, 16, 6),
    # MHA (GQA 1), pages of 8: one chunk spanning several key blocks, no decodes, padding tokens.
    "mha": Case(((13, 29), (6, 6)), 8, 2, 2, 16, F32, 24, 4),
    # Mistral-style window of 5 over a mixed batch: blocks before each tile's window are skipped.
    "window": Case(((10, 26), (1, 19), (4, 4), (1, 3)), 4, 4, 2, 16, F32, 16, 6, 5),
}


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(xla_blocked, "_TILE_ROWS", 4)
    monkeypatch.setattr(xla_blocked, "_TILE_KEYS", 8)
    monkeypatch.setattr(xla_blocked, "_DECODE_KEYS", 8)
    monkeypatch.setattr(xla_blocked, "_DECODE_KEYS_ONE_SEQ", 12)


@pytest.fixture(params=["native", "loop"])
def decode_path(request, monkeypatch):
    """Decode rows through the CPU's native call (cpu_ffi, where it builds) or the jnp loop
    (accelerators, and the CPU without a compiler): both must match the reference."""
    if request.param == "loop":
        monkeypatch.setattr(xla_blocked.cpu_ffi, "available", lambda: False)
    elif not xla_blocked.cpu_ffi.available():
        pytest.skip("the native CPU attention could not be built (no g++?)")
    return request.param


def _check(case: Case, got: np.ndarray) -> None:
    args = make_inputs(case)
    kwargs = dict(sm_scale=case.head_dim**-0.5, sliding_window=case.sliding_window)
    want = np.asarray(reference.ragged_paged_attention(*args, **kwargs))
    assert not np.isnan(got).any(), "NaN in the output: the tiled path read an unwritten slot"
    total = sum(q for q, _ in case.chunks)
    np.testing.assert_array_equal(got[total:], 0.0)  # padding tokens
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("name", list(RAGGED), ids=str)
def test_tiled_matches_reference(name: str, small_tiles, decode_path):
    case = RAGGED[name]
    fn = functools.partial(
        xla_blocked.ragged_paged_attention,
        sm_scale=case.head_dim**-0.5,
        sliding_window=case.sliding_window,
    )
    _check(case, np.asarray(jax.jit(fn)(*make_inputs(case))))


def test_default_sizes_match_reference():
    """The production tile sizes: every chunk fits one tile and one key block here."""
    case = RAGGED["gqa2"]
    fn = functools.partial(xla_blocked.ragged_paged_attention, sm_scale=case.head_dim**-0.5)
    _check(case, np.asarray(jax.jit(fn)(*make_inputs(case))))


def test_small_step_takes_tiles_of_its_own_size():
    """A step of 8 tokens (a speculative verification's bucket): 3 decodes and a 5-token chunk
    at the step's end, whose one tile is 8 rows, not _TILE_ROWS (64); it matches the reference
    with the production key blocks, and a step of 512 tokens still takes 64-row tiles."""
    assert (xla_blocked._tile_rows(8), xla_blocked._tile_rows(512)) == (8, xla_blocked._TILE_ROWS)
    case = Case(((1, 30), (1, 9), (1, 17), (5, 21)), 4, 4, 2, 16, F32, 8, 4)
    args = make_inputs(case)
    plan = xla_blocked.plan_step(8, args[3], args[4], args[6])
    assert plan.tile_rows.shape == (4,)  # at most min(1 + 4 slots, 8 // 2) tiles of 8 rows
    np.testing.assert_array_equal(plan.tile_rows, [5, 0, 0, 0])
    fn = functools.partial(xla_blocked.ragged_paged_attention, sm_scale=case.head_dim**-0.5)
    _check(case, np.asarray(jax.jit(fn)(*args)))


# One sequence slot: the decode loop's larger blocks (_DECODE_KEYS_ONE_SEQ), over a context that
# ends mid-block, with and without a window that starts past the first blocks.
ONE_SLOT = {
    "long": Case(((1, 41),), 4, 4, 2, 16, F32, 1, 1),
    "window": Case(((1, 41),), 4, 4, 2, 16, F32, 1, 1, 15),
    "production": Case(((1, 300),), 16, 9, 3, 64, F32, 1, 1),  # default sizes: 3 blocks of 128
}


@pytest.mark.parametrize("name", list(ONE_SLOT), ids=str)
def test_one_slot_decode_blocks_match_reference(name: str, monkeypatch):
    case = ONE_SLOT[name]
    monkeypatch.setattr(xla_blocked.cpu_ffi, "available", lambda: False)  # the loop's blocks
    if name != "production":  # 12 keys: three pages of 4 a block, four blocks for 41 keys
        monkeypatch.setattr(xla_blocked, "_DECODE_KEYS_ONE_SEQ", 12)
    fn = functools.partial(
        xla_blocked.ragged_paged_attention,
        sm_scale=case.head_dim**-0.5,
        sliding_window=case.sliding_window,
    )
    _check(case, np.asarray(jax.jit(fn)(*make_inputs(case))))


def test_tiny_case_worked_by_hand(small_tiles):
    fn = functools.partial(xla_blocked.ragged_paged_attention, sm_scale=1.0)
    out = jax.jit(fn)(*tiny_case())
    np.testing.assert_allclose(np.asarray(out), TINY_ANSWER, rtol=1e-5, atol=1e-6)


def test_plan_lists_each_chunks_tiles(small_tiles):
    """Tiles stay inside one sequence; decodes get no tile; padding slots get nothing."""
    query_start = jnp.array([0, 9, 10, 12, 13, 13, 13], jnp.int32)  # q_len 9, 1, 2, 1, 0, 0
    kv_lens = jnp.array([20, 5, 2, 8, 0, 0], jnp.int32)
    plan = xla_blocked.plan_step(16, query_start, kv_lens, jnp.int32(4))
    n = int(plan.num_tiles)
    assert n == 4  # 9 rows: 4 + 4 + 1; 2 rows: 2
    np.testing.assert_array_equal(plan.tile_seq[:n], [0, 0, 0, 2])
    np.testing.assert_array_equal(plan.tile_start[:n], [0, 4, 8, 10])
    np.testing.assert_array_equal(plan.tile_rows[:n], [4, 4, 1, 2])
    np.testing.assert_array_equal(plan.tile_rows[n:], 0)
    np.testing.assert_array_equal(plan.decode_rows, [16, 9, 16, 12, 16, 16])  # 16: not decoding
    assert int(plan.decode_kv_max) == 8


def test_prefill_tiles_read_each_key_block_once_per_tile(small_tiles, monkeypatch):
    """The loops run over the real work: tiles x their own key blocks, not rows x longest context.

    One 12-row chunk at context 20 (positions 8..19; tiles of 4 rows, blocks of 8 keys) and one
    decode at context 40, with a window of 6. Tile 0 (positions 8..11) sees keys 3..11: blocks
    0-1; tile 1 (12..15) keys 7..15: blocks 0-1; tile 2 (16..19) keys 11..19: blocks 1-2. The
    decode (position 39) sees keys 34..39: block 4 alone. The outer loop runs the 3 real tiles.
    """
    case = Case(((12, 20), (1, 40)), 4, 2, 1, 16, F32, 16, 2, 6)
    visits = {}  # loop (in trace order) -> indices it ran, recorded as the compiled step runs
    real_loop = jax.lax.fori_loop

    def recording_loop(lower, upper, body, init):
        name = len(visits)
        visits[name] = []

        def recorded(i, carry):
            jax.debug.callback(lambda i: visits[name].append(int(i)), i, ordered=True)
            return body(i, carry)

        return real_loop(lower, upper, recorded, init)

    monkeypatch.setattr(xla_blocked.jax.lax, "fori_loop", recording_loop)
    monkeypatch.setattr(xla_blocked.cpu_ffi, "available", lambda: False)  # the jnp decode loop
    fn = functools.partial(
        xla_blocked.ragged_paged_attention, sm_scale=case.head_dim**-0.5, sliding_window=6
    )
    got = jax.block_until_ready(jax.jit(fn)(*make_inputs(case)))
    _check(case, np.asarray(got))
    # Trace order: the decode loop, the tile loop, the key loop nested in it (run once per tile).
    assert visits == {0: [4], 1: [0, 1, 2], 2: [0, 1, 0, 1, 1, 2]}


def test_cost_model_counts_the_loops_this_attention_runs():
    # The cost model prices steps by these loops' trips without importing JAX: its copies of
    # the loop sizes must be the attention's.
    from jaxserve.scheduling import cost_model

    assert (cost_model.DECODE_KEYS, cost_model.DECODE_KEYS_ONE_SEQ) == (
        xla_blocked._DECODE_KEYS,
        xla_blocked._DECODE_KEYS_ONE_SEQ,
    )
    assert (cost_model.TILE_ROWS, cost_model.TILE_KEYS) == (
        xla_blocked._TILE_ROWS,
        xla_blocked._TILE_KEYS,
    )
