"""Both ragged paged attention kernels against the reference, in Pallas interpret mode on the CPU.

Interpret mode is slow (the TPU interpreter simulates every DMA and semaphore), so shapes are tiny
and each case covers several things at once: the sweep over batch kinds, page sizes, GQA ratios,
head dims and dtypes is spread across a few cases rather than multiplied out. Every pool slot no
sequence has written (unused pages, the tail of last pages, and all of layer 0, since the cases
read layer 1) holds NaN, so any out-of-bounds read shows up as NaN in the output. The TPU
kernel runs with the interpreter's race detector on two simulated cores (`tpu_interpret`).

On a GPU, `python -m pallas_kernels.gpu_check` runs the GPU kernel's tests here natively
(JAXSERVE_GPU_NATIVE=1 turns interpret mode off for them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import common, gpu_kernel, reference, tpu_kernel, tuning

# bf16 rounds probabilities before the PV matmul, in a different order in each implementation.
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}

# Small blocks so that tiny shapes still take several query blocks (some mixing sequences, some
# only padding) and several key blocks with double buffering across sequence boundaries.
SMALL_TPU = tuning.TpuBlockSizes(q_rows=8, kv_tokens=8)
SMALL_GPU = tuning.GpuBlockSizes(
    q_rows=16, kv_tokens=8, num_warps=4, num_stages=2, num_sms=16, max_kv_splits=4
)


# The TPU interpreter with its race detector on, over two simulated TensorCores that split the
# grid's parallel dimensions between them (as a megacore chip does): a DMA that lands in a buffer
# while the kernel still reads it, or two cores writing one block, is reported.
RACE_CHECKED = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)


def tpu_interpret(*args, **kwargs):
    """The TPU kernel in interpret mode, failing if the race detector found a race in the call.

    JAX 0.10.2 reports races only through the interpreter module's global `races` (a
    RaceDetectionState made afresh for each kernel run, `races_found` set on a race, the race
    printed): no public API reads it, so the private module is read here. The state is reset
    before the call, so a state left by an earlier call cannot pass for this one's.
    The detector costs ~1.7x (the 7 TPU cases: 21 s without, 36 s with, on 2 shared cores), so
    every case keeps it on.
    """
    pltpu.reset_tpu_interpret_mode_state()
    out = jax.block_until_ready(
        tpu_kernel.ragged_paged_attention(*args, interpret=RACE_CHECKED, **kwargs)
    )
    races = tpu_interpreter.races
    assert races is not None, "The TPU interpreter ran without its race detector."
    assert not races.races_found, "The TPU interpreter found a data race (printed above)."
    return out


GPU_NATIVE = os.environ.get("JAXSERVE_GPU_NATIVE") == "1"


def gpu_interpret(*args, **kwargs):
    return gpu_kernel.ragged_paged_attention(*args, interpret=not GPU_NATIVE, **kwargs)


@dataclasses.dataclass(frozen=True)
class Case:
    chunks: tuple[tuple[int, int], ...]  # (q_len, kv_len) of each real sequence
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: type
    num_tokens: int  # bucket: >= sum of q_len; the rest is padding
    num_slots: int  # bucket: >= len(chunks)
    sliding_window: int | None = None
    lane_align: int = 1  # the pool's lanes padded to a multiple of this (128 on TPU)


def make_inputs(case: Case, seed: int = 0) -> tuple:
    """Reference-signature arguments for `case`, layer 1 of a 2-layer pool, NaN wherever unused."""
    rng = np.random.default_rng(seed)
    pages_per_seq = max(-(-kv // case.page_size) for _, kv in case.chunks)
    num_pages = sum(-(-kv // case.page_size) for _, kv in case.chunks) + 2  # 2 never used
    shape = (2, num_pages, case.page_size, case.num_kv_heads, case.head_dim)
    k_pool, v_pool = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    query_start = np.zeros(case.num_slots + 1, np.int32)
    kv_lens = np.zeros(case.num_slots, np.int32)
    page_tables = np.zeros((case.num_slots, pages_per_seq), np.int32)
    free = list(rng.permutation(num_pages))  # scattered pages, not in sequence order
    offset = 0
    for s, (q_len, kv_len) in enumerate(case.chunks):
        pages = [free.pop() for _ in range(-(-kv_len // case.page_size))]
        page_tables[s, : len(pages)] = pages
        # Keys no query sees (before every query's sliding window) stay NaN, like recycled pages.
        first_seen = kv_len - q_len - case.sliding_window + 1 if case.sliding_window else 0
        for pos in range(max(0, first_seen), kv_len):
            page, slot = pages[pos // case.page_size], pos % case.page_size
            k_pool[1, page, slot] = rng.normal(size=(case.num_kv_heads, case.head_dim))
            v_pool[1, page, slot] = rng.normal(size=(case.num_kv_heads, case.head_dim))
        query_start[s] = offset
        kv_lens[s] = kv_len
        offset += q_len
    query_start[len(case.chunks) :] = offset
    q = rng.normal(size=(case.num_tokens, case.num_heads, case.head_dim))
    lanes = common.kv_lanes(case.num_kv_heads, case.head_dim, align=case.lane_align)
    # Padding lanes hold NaN too: no kernel may read them.
    kv_pool = np.array(common.fuse_kv(k_pool, v_pool, lanes))
    kv_pool[..., 2 * case.num_kv_heads * case.head_dim :] = np.nan
    return (
        jnp.asarray(q, case.dtype),
        jnp.asarray(kv_pool, case.dtype),
        jnp.int32(1),
        jnp.asarray(query_start),
        jnp.asarray(kv_lens),
        jnp.asarray(page_tables),
        jnp.int32(len(case.chunks)),
    )


CASES = {
    # 5 decode tokens, GQA 2, head_dim 64, pages of 4, f32; 3 padding rows and 1 padding slot.
    "decode": Case(((1, 9), (1, 1), (1, 16), (1, 4), (1, 7)), 4, 4, 2, 64, jnp.float32, 8, 6),
    # Two whole prompts, GQA 4 (one KV head), head_dim 128, pages of 8, bf16.
    "prefill": Case(((7, 7), (12, 12)), 8, 4, 1, 128, jnp.bfloat16, 24, 2),
    # A later prefill chunk, decode tokens, a first chunk, no GQA (ratio 1), pages of 2, bf16.
    "mixed": Case(((5, 13), (1, 6), (4, 4), (1, 11)), 2, 2, 2, 64, jnp.bfloat16, 16, 4),
    # Mistral-style sliding window over a mixed batch, f32.
    "mixed_window": Case(((6, 14), (1, 9), (3, 3)), 4, 4, 2, 64, jnp.float32, 12, 4, 5),
    # 3 KV heads of head_dim 16: 96 lanes of keys and values padded to 128, as on TPU.
    "padded_lanes": Case(((3, 7), (1, 5)), 4, 6, 3, 16, jnp.float32, 8, 3, lane_align=128),
}

KERNELS = {
    "tpu": (tpu_interpret, SMALL_TPU),
    "gpu": (gpu_interpret, SMALL_GPU),
}


def assert_matches_reference(kernel, case: Case, block_sizes) -> None:
    args = make_inputs(case)
    kwargs = dict(
        sm_scale=case.head_dim**-0.5,
        num_kv_heads=case.num_kv_heads,
        sliding_window=case.sliding_window,
    )
    want = np.asarray(reference.ragged_paged_attention(*args, **kwargs), np.float32)
    got = kernel(*args, block_sizes=block_sizes, **kwargs)
    assert got.shape == want.shape and got.dtype == case.dtype
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any(), "NaN in the output: a kernel read an unused slot or page"
    total = sum(q for q, _ in case.chunks)
    np.testing.assert_array_equal(got[total:], 0.0)  # padding rows
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", list(CASES), ids=str)
@pytest.mark.parametrize("kernel", list(KERNELS), ids=str)
def test_kernel_matches_reference(kernel: str, case: str):
    fn, block_sizes = KERNELS[kernel]
    assert_matches_reference(fn, CASES[case], block_sizes)


@pytest.mark.parametrize("kernel", list(KERNELS), ids=str)
def test_default_block_sizes(kernel: str):
    """The tuning table's default row (one query block, no key splits at these sizes) too."""
    assert_matches_reference(KERNELS[kernel][0], CASES["mixed"], None)


def test_gpu_kernel_without_key_splits():
    """SMALL_GPU splits the keys of small batches; this bucket is big enough for one split."""
    no_splits = dataclasses.replace(SMALL_GPU, max_kv_splits=1)
    assert_matches_reference(gpu_interpret, CASES["prefill"], no_splits)


def tiny_case() -> tuple:
    """One 2-token prefill chunk, one decode token, one padding row; every number small.

    head_dim 2, one head, sm_scale 1, pages of 2 tokens. Sequence 0 holds 3 tokens in pages [2, 0]:
      k0 = [0, 0],     v0 = [4, 0]     (page 2, slot 0)
      k1 = [ln 3, 0],  v1 = [0, 4]     (page 2, slot 1)
      k2 = [0, 0],     v2 = [0, 0]     (page 0, slot 0; page 0 slot 1 is unused: NaN)
    Its queries are both [1, 0], at positions 1 and 2 (kv_len 3, q_len 2). Scores q . k are
    0, ln 3, 0, so exp(score) is 1, 3, 1:
      row 0 (position 1) sees k0, k1: weights 1/4, 3/4  -> 1/4 v0 + 3/4 v1 = [1, 3]
      row 1 (position 2) sees k0..k2: weights 1/5, 3/5, 1/5 -> [4/5, 12/5] = [0.8, 2.4]
    Sequence 1 has one token (page 1, slot 0: k = [5, 5], v = [7, -1]); its one query sees only it,
    weight 1 -> [7, -1]. Row 3 is padding -> [0, 0]. Page 3 is unused (NaN), as is layer 0.
    """
    k = np.full((2, 4, 2, 1, 2), np.nan, np.float32)
    v = np.full((2, 4, 2, 1, 2), np.nan, np.float32)
    k[1, 2, 0, 0], v[1, 2, 0, 0] = [0, 0], [4, 0]
    k[1, 2, 1, 0], v[1, 2, 1, 0] = [np.log(3), 0], [0, 4]
    k[1, 0, 0, 0], v[1, 0, 0, 0] = [0, 0], [0, 0]
    k[1, 1, 0, 0], v[1, 1, 0, 0] = [5, 5], [7, -1]
    q = np.array([[[1, 0]], [[1, 0]], [[0.5, -2]], [[9, 9]]], np.float32)
    return (
        jnp.asarray(q),
        common.fuse_kv(jnp.asarray(k), jnp.asarray(v), lanes=4),  # [k0 k1 v0 v1] per token
        jnp.int32(1),
        jnp.array([0, 2, 3, 3], jnp.int32),  # 3 slots: two sequences and a padding one
        jnp.array([3, 1, 0], jnp.int32),
        jnp.array([[2, 0], [1, 0], [0, 0]], jnp.int32),
        jnp.int32(2),
    )


TINY_ANSWER = np.array([[[1, 3]], [[0.8, 2.4]], [[7, -1]], [[0, 0]]], np.float32)


@pytest.mark.parametrize(
    "fn",
    [reference.ragged_paged_attention, tpu_interpret, gpu_interpret],
    ids=["reference", "tpu", "gpu"],
)
def test_tiny_case_worked_by_hand(fn):
    out = fn(*tiny_case(), sm_scale=1.0)
    np.testing.assert_allclose(np.asarray(out), TINY_ANSWER, rtol=1e-5, atol=1e-6)


def gpu_target(kind: str = "NVIDIA H100"):
    """Names the GPU a lowering without one is for: since JAX 0.11, Pallas's Triton lowering reads
    the compute capability from the abstract mesh's device when no GPU is attached (JAX 0.10 fell
    back to sm90 by itself and ignores this). An H100 is sm90, as 0.10's fallback."""
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


@pytest.mark.parametrize(
    ("kernel", "platform", "marker", "block_sizes"),
    [
        (tpu_kernel.ragged_paged_attention, "tpu", "tpu_custom_call", None),
        (gpu_kernel.ragged_paged_attention, "cuda", "xla.gpu.triton", None),
        (gpu_kernel.ragged_paged_attention, "cuda", "xla.gpu.triton", SMALL_GPU),  # key splits
    ],
    ids=["mosaic_tpu", "triton", "triton_split"],
)
def test_lowers_for_the_accelerator(kernel, platform, marker, block_sizes):
    """Lowering (not compiling) for the real backend catches ops Mosaic or Triton cannot take.

    Shapes as in serving: head_dim 128, pages of 16, bf16, GQA 4.
    """
    case = Case(((9, 40), (1, 17), (1, 3)), 16, 8, 2, 128, jnp.bfloat16, 16, 4)
    fn = functools.partial(kernel, sm_scale=0.1, block_sizes=block_sizes)
    args = make_inputs(case)
    with gpu_target() if platform == "cuda" else contextlib.nullcontext():
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
    assert marker in lowered.as_text()
