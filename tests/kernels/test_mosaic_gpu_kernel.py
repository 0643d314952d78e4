"""The Mosaic GPU kernel against the reference, in Mosaic GPU interpret mode on the CPU.

Interpret mode simulates the kernel's TMA copies (page by page, into the staged SMEM slots),
its barriers, SMEM, and the PV wgmma, with uninitialised SMEM and every unwritten pool slot NaN,
so a read of a slot no copy filled, or of a key no row may see, shows in the output. Tracing it
costs ~10 s per shape, so two cases cover the ground: a mixed bf16 batch without key splits and
an f32 decode batch with key splits and a sliding window.

What interpret mode does not check, and where it is covered instead:
- S = Q K^T runs as a plain dot there (its wgmma cannot read the transposed K tile); the wgmma
  with `transpose_ref` is only lowered (test_lowers_for_sm90), not run;
- register layouts (`layout_cast`, layouted iotas) are hints interpret mode has no rule for, and
  the SMEM swizzle is simulated, not the hardware's: lowering checks them, a GPU runs them;
- bf16 wgmma rounding and timing: only a GPU (`python -m pallas_kernels.gpu_check` runs this
  file natively, JAXSERVE_GPU_NATIVE=1, the f32 case in bf16 since wgmma takes no f32 K^T).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.attention import get_attention_fn
from pallas_kernels.ragged_paged_attention import (
    common,
    gpu_common,
    mosaic_gpu_kernel,
    reference,
    tuning,
)
from tests.kernels.test_ragged_paged_attention import Case, make_inputs

GPU_NATIVE = os.environ.get("JAXSERVE_GPU_NATIVE") == "1"
TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


def sizes(*, kv_tokens: int, stages: int, max_kv_splits: int) -> tuning.GpuBlockSizes:
    # num_sms 16: few enough programs that small decode batches split their keys.
    return tuning.GpuBlockSizes(
        q_rows=64,
        kv_tokens=kv_tokens,
        num_warps=4,
        num_stages=stages,
        num_sms=16,
        max_kv_splits=max_kv_splits,
    )


CASES = {
    # A later prefill chunk over 3 key blocks (64 keys, 4 pages of 16), a decode token, a first
    # chunk, a kv_len 0 padding slot and padding rows; GQA 4 (one KV head: interpret mode's time
    # grows with the programs); 3 stages (2 blocks in flight).
    "mixed_bf16": (
        Case(((5, 140), (1, 70), (4, 4), (0, 0)), 16, 4, 1, 64, jnp.bfloat16, 16, 5),
        sizes(kv_tokens=64, stages=3, max_kv_splits=1),
    ),
    # Decode only, GQA 4, pages of 8 (4 per 32-key block), 2 key splits (one sequence too short
    # to give both a block: its second split writes an empty partial) and a sliding window whose
    # first block starts mid-block.
    "decode_split_window": (
        Case(
            ((1, 100), (1, 45), (1, 1)),
            8,
            4,
            1,
            64,
            jnp.bfloat16 if GPU_NATIVE else jnp.float32,
            4,
            4,
            sliding_window=50,
        ),
        sizes(kv_tokens=32, stages=2, max_kv_splits=2),
    ),
}


def mosaic(*args, **kwargs):
    interpret = None if GPU_NATIVE else mosaic_gpu_kernel.interpret_params()
    return mosaic_gpu_kernel.ragged_paged_attention(*args, interpret=interpret, **kwargs)


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """Interpret mode keeps simulator state that an exception leaves broken: one failing case must
    not fail the next ones."""
    yield
    mosaic_gpu_kernel.reset_interpret_state()


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_mosaic_matches_reference(name: str):
    case, block_sizes = CASES[name]
    args = make_inputs(case)
    kwargs = dict(sm_scale=case.head_dim**-0.5, sliding_window=case.sliding_window)
    want = np.asarray(reference.ragged_paged_attention(*args, **kwargs), np.float32)
    got = mosaic(*args, block_sizes=block_sizes, **kwargs)
    assert got.shape == want.shape and got.dtype == case.dtype
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any(), "NaN in the output: the kernel read an unused slot or page"
    total = sum(q for q, _ in case.chunks)
    np.testing.assert_array_equal(got[total:], 0.0)  # padding rows
    np.testing.assert_allclose(got, want, atol=TOLERANCE[case.dtype], rtol=TOLERANCE[case.dtype])


def test_launch_shapes_of_the_cases():
    """The split case really splits (else the merge path would go untested), the mixed case does
    not, and both pipeline several key blocks."""
    for name, splits, stages in (("decode_split_window", 2, 2), ("mixed_bf16", 1, 3)):
        case, block_sizes = CASES[name]
        block_kv = 32 if case.dtype == jnp.float32 else 64  # wgmma's K tile: 128 bytes
        args = make_inputs(case)
        bucket = gpu_common.Bucket(
            case.num_tokens,
            case.num_slots,
            case.num_kv_heads,
            case.num_heads // case.num_kv_heads,
            args[5].shape[1],  # page_tables [S, P]
            case.page_size,
            case.head_dim,
            case.dtype,
        )
        shape = mosaic_gpu_kernel.launch_shape(bucket, block_sizes)
        assert (shape.splits, shape.stages, shape.block_kv) == (splits, stages, block_kv), name
        assert max(kv for _, kv in case.chunks) > block_kv  # several blocks


def test_work_items_and_span_worked_by_hand():
    """Sequences of 5, 1 and 0 tokens in blocks of 2 tokens: items (0, 0), (0, 2), (0, 4), (1, 5).

    Item (0, 2) holds tokens 2 and 3 of a 5-token chunk with kv_len 12 (positions 7..11): tokens
    2, 3 sit at positions 9, 10, so it sees keys [0, 11); with a window of 4, keys [6, 11). In
    blocks of 4 keys that is blocks [1, 3); split 1 of 2 gets block 2 alone.
    """
    query_start = jnp.array([0, 5, 6, 6], jnp.int32)
    seq, start = common.work_items(query_start, jnp.int32(2), block_tokens=2, num_items=6)
    np.testing.assert_array_equal(seq[:4], [0, 0, 0, 1])
    np.testing.assert_array_equal(start, [0, 2, 4, 5, -1, -1])
    span = common.item_span(
        jnp.int32(2),
        jnp.int32(5),
        jnp.int32(12),
        jnp.int32(1),
        block_tokens=2,
        block_kv=4,
        num_splits=2,
        sliding_window=4,
    )
    got = [span.t_hi, span.pos_offset, span.kv_start, span.kv_end, span.block_lo, span.block_hi]
    assert [int(x) for x in got] == [4, 7, 6, 11, 2, 3]


def test_merge_splits_is_the_whole_softmax():
    """Partial softmaxes over key ranges, merged, equal the softmax over all keys (an empty split,
    max -1e30 and sum 0, included)."""
    rng = np.random.default_rng(0)
    scores, values = rng.normal(size=(3, 10)), rng.normal(size=(10, 2))
    parts = [(0, 4), (4, 10), (10, 10)]
    acc, row_max, row_sum = [], [], []
    for lo, hi in parts:
        s = scores[:, lo:hi]
        m = s.max(axis=1) if hi > lo else np.full(3, -1e30)
        p = np.exp(s - m[:, None])
        acc.append(p @ values[lo:hi]), row_max.append(m), row_sum.append(p.sum(axis=1))
    got = common.merge_splits(
        *(jnp.asarray(np.stack(x), jnp.float32) for x in (acc, row_max, row_sum))
    )
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    want = (probs / probs.sum(axis=1, keepdims=True)) @ values
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_gather_tokens_undoes_the_tiles():
    """Token t of item w holds rows (t - start_w) * group + g of w's tile, for each KV head."""
    group, rows, head_dim = 2, 4, 3
    item_start = jnp.array([0, 2, 3, -1], jnp.int32)  # items: tokens {0, 1}, {2}, {3, 4}
    tiles = jnp.arange(4 * 2 * rows * head_dim, dtype=jnp.float32).reshape(4, 2, rows, head_dim)
    got = np.asarray(mosaic_gpu_kernel._gather_tokens(tiles, item_start, 5, group))
    for t, (w, first) in enumerate([(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)]):
        for h in range(2):
            want = tiles[w, h, first * group : first * group + group]
            np.testing.assert_array_equal(got[t, h * group : (h + 1) * group], want)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="names the CPU's refusals")
def test_backend_names_on_the_cpu():
    for backend in ("pallas_gpu_mosaic", "pallas_gpu_triton"):
        with pytest.raises(ValueError, match="interpret"):
            get_attention_fn(backend)
    fn = get_attention_fn("pallas_gpu_mosaic_interpret")
    assert fn.func is mosaic_gpu_kernel.ragged_paged_attention
    assert fn.keywords["interpret"] is not None and fn.keywords["interpret"] is not True
    # pallas_gpu_interpret keeps meaning the Triton kernel.
    assert get_attention_fn("pallas_gpu_interpret").keywords["interpret"] is True
    assert get_attention_fn("pallas_gpu_triton_interpret").keywords["interpret"] is True


def test_f32_pool_is_refused_natively():
    case, _ = CASES["mixed_bf16"]
    args = make_inputs(dataclasses.replace(case, dtype=jnp.float32))
    with pytest.raises(NotImplementedError, match="16-bit"):
        mosaic_gpu_kernel.ragged_paged_attention(*args, sm_scale=0.1)


LOWERING_CASES = {
    # Serving's mixed step: head_dim 128, pages of 16, bf16, GQA 4, one split.
    "mixed": (
        Case(((9, 40), (1, 17), (1, 3)), 16, 8, 2, 128, jnp.bfloat16, 16, 4),
        sizes(kv_tokens=64, stages=3, max_kv_splits=1),
    ),
    # One decode sequence: the H200 row's 16 key splits; 17 tokens of queries, padded to whole
    # 64-row tiles for the query copy.
    "decode_one": (
        Case(((1, 2048),), 16, 32, 8, 128, jnp.bfloat16, 1, 1),
        tuning.gpu_block_sizes("NVIDIA H200"),
    ),
    # Pages of 128 make 128-key blocks: the stages drop to 2 to fit SMEM; no GQA.
    "big_pages": (
        Case(((1, 300), (1, 70)), 128, 8, 8, 128, jnp.bfloat16, 2, 2),
        tuning.gpu_block_sizes("NVIDIA H200"),
    ),
}


@pytest.mark.parametrize("name", list(LOWERING_CASES))
def test_lowers_for_sm90(name: str):
    """Lowering (not compiling) to Mosaic GPU for CUDA runs the whole Pallas -> Mosaic GPU
    lowering on the CPU: TMA descriptors, barriers, wgmma shapes, register layouts and the SMEM
    budget (decode_one failed on the query copy's tiling, big_pages on SMEM, before their fixes)."""
    pytest.importorskip("jax.experimental.mosaic.gpu")
    case, block_sizes = LOWERING_CASES[name]
    fn = functools.partial(
        mosaic_gpu_kernel.ragged_paged_attention, sm_scale=0.1, block_sizes=block_sizes
    )
    lowered = jax.jit(fn).trace(*make_inputs(case)).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    # The serialized Mosaic GPU module names its TMA copies and wgmmas.
    assert "mosaic_gpu" in text
    assert "wgmma" in text and "cp.async.bulk.tensor" in text


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="needs a kernel that fails to compile")
def test_gpu_check_records_a_kernel_that_fails_and_goes_on():
    """gpu_check's sweep on the CPU: the Mosaic kernel without interpret mode cannot compile here
    (a real compile failure), which the point records while the next kernel (Triton, interpreted)
    is still timed and checked against the reference; the default kernel keeps the old keys."""
    from pallas_kernels import gpu_check
    from pallas_kernels.ragged_paged_attention import gpu_kernel

    kernels = {
        "mosaic": mosaic_gpu_kernel.ragged_paged_attention,
        "triton": functools.partial(gpu_kernel.ragged_paged_attention, interpret=True),
    }
    point = gpu_check.bench_point(
        2,
        64,
        None,
        None,
        shape=gpu_check.DRY,
        kernels=kernels,
        default="triton",
        timing=dict(iters=1, reps=1),
    )
    assert "interpret" in point["kernels"]["mosaic"]["error"]
    triton = point["kernels"]["triton"]
    assert triton["us"] > 0 and triton["max_abs_error_vs_reference"] < 2e-2
    assert point["kernel_name"] == "triton" and point["kernel"]["us"] == triton["us"]
    assert point["max_abs_error_vs_reference"] == triton["max_abs_error_vs_reference"]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="on a GPU it would run the sweep")
def test_gpu_check_without_a_gpu_runs_nothing(tmp_path):
    from pallas_kernels import gpu_check

    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    assert not out.exists()
