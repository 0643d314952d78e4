"""The GPU kernel choice (kernel_choice.py) against the kernels' own limits, without compiling.

Issue 28's defects 4 and 5 at the choice level: on Hopper in 16-bit, a page_size=1 pool (what
models/loaded.abstract_params traces) and head dims below 64 (llama-tiny, qwen3-tiny) used to go
to the Mosaic GPU kernel by dtype alone, which refused the first and failed to compile the second.
That the picked kernel really compiles for sm_90a is tests/kernels/test_gpu_aot.py's part; here
the rule is checked over a grid of shapes: whatever the choice returns, that kernel's launch for
the bucket goes through.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import pytest

from pallas_kernels import gpu_targets
from pallas_kernels.gpu_targets import parse_compute_capability
from pallas_kernels.ragged_paged_attention import gpu_common, gpu_kernel, mosaic_gpu_kernel, tuning
from pallas_kernels.ragged_paged_attention.gpu_common import Bucket
from pallas_kernels.ragged_paged_attention.kernel_choice import (
    MOSAIC_GPU,
    TRITON,
    choose_gpu_kernel,
    gpu_kernel_refusals,
)

H100 = tuning.GPU_TABLE["H100"]


def choose(capability, dtype, head_dim, page_size, group=1, **bucket):
    """The choice for num_kv_heads=2 and `group` query heads each, with the H100 tuning row."""
    return choose_gpu_kernel(
        capability,
        dtype,
        head_dim=head_dim,
        page_size=page_size,
        num_q_heads=2 * group,
        num_kv_heads=2,
        block_sizes=H100,
        **bucket,
    )


def test_page_size_1_on_hopper_is_not_mosaic():
    """Defect 4: abstract_params' page_size=1 pool in bf16/f16 on sm90 goes to Triton."""
    for dtype in (jnp.bfloat16, jnp.float16):
        assert choose("9.0", dtype, 64, 1) == TRITON
        assert choose("9.0", dtype, 64, 1, num_tokens=1, num_slots=1, pages_per_seq=1) == TRITON
    reasons = gpu_kernel_refusals(
        "9.0", jnp.bfloat16, head_dim=64, page_size=1, num_q_heads=4, num_kv_heads=2
    )
    assert "page_size=1" in reasons[MOSAIC_GPU] and reasons[TRITON] is None


@pytest.mark.parametrize("head_dim", [16, 32, 48])
def test_small_head_dims_in_16_bit_get_a_kernel_that_takes_them(head_dim):
    """Defect 5: head dims below 64 in 16-bit. The Mosaic GPU kernel now takes any multiple of 16
    (P's tile follows V's swizzle); its `supports` says so, and the choice follows it."""
    assert (
        mosaic_gpu_kernel.supports(
            gpu_common.Query(
                "9.0",
                jnp.bfloat16,
                head_dim=head_dim,
                page_size=16,
                num_q_heads=8,
                num_kv_heads=4,
                block_sizes=H100,
            )
        )
        is None
    )
    assert choose("9.0", jnp.bfloat16, head_dim, 16, group=2) == MOSAIC_GPU


def test_head_dims_wgmma_cannot_take_go_elsewhere():
    """head_dim 8 (stories260k) has 16-byte rows in bf16, which wgmma cannot read (it swizzles by
    32 bytes or more): Triton; head_dim 72 suits neither kernel: XLA (None)."""
    assert choose("9.0", jnp.bfloat16, 8, 16) == TRITON
    reasons = gpu_kernel_refusals(
        "9.0", jnp.bfloat16, head_dim=72, page_size=16, num_q_heads=2, num_kv_heads=2
    )
    assert "head_dim=72" in reasons[MOSAIC_GPU] and "head_dim=72" in reasons[TRITON]
    assert choose("9.0", jnp.bfloat16, 72, 16) is None


@pytest.mark.parametrize(
    ("capability", "dtype", "want"),
    [
        ("9.0", jnp.bfloat16, MOSAIC_GPU),
        ("9.0", jnp.float16, MOSAIC_GPU),
        ("9.0", jnp.float32, TRITON),  # wgmma takes no f32 K^T
        ("8.0", jnp.bfloat16, TRITON),
        ("8.9", jnp.float16, TRITON),
        # wgmma is sm_90a alone: Blackwell has none (the Mosaic kernel fails to compile there).
        ("10.0", jnp.bfloat16, TRITON),
        ("12.0", jnp.bfloat16, TRITON),
        ("7.5", jnp.bfloat16, None),
        (None, jnp.bfloat16, None),
        ("", jnp.bfloat16, None),
        ("gfx90a", jnp.bfloat16, None),
    ],
)
def test_choice_by_capability_and_dtype(capability, dtype, want):
    assert choose(capability, dtype, 128, 16, group=4) == want


def test_8_bit_pools_go_to_triton_and_others_to_no_kernel():
    """An 8-bit pool (--kv-cache-dtype: int8, e4m3 with exponent lanes) is Triton's, which
    dequantizes it (e4m3 from 8.9, where Triton converts fp8), never Mosaic GPU's; a pool of
    another dtype has no kernel (the XLA attention)."""
    assert choose("9.0", jnp.int8, 128, 16) == choose("8.0", jnp.int8, 128, 16) == TRITON
    assert choose("9.0", jnp.float8_e4m3fn, 128, 16) == TRITON
    assert choose("8.0", jnp.float8_e4m3fn, 128, 16) is None
    assert choose("9.0", jnp.int16, 128, 16) is None


def test_head_dim_256_on_mosaic_depends_on_the_bucket():
    """The Mosaic GPU kernel's SMEM takes head_dim 256 only without key splits (whose f32 output
    tile does not fit beside the K/V stages): without a bucket the choice must assume splits."""
    assert choose("9.0", jnp.bfloat16, 256, 16) == TRITON
    # A bucket with enough programs that it never splits: 16384 tokens of 8 sequences.
    big = dict(num_tokens=16384, num_slots=8, pages_per_seq=2048)
    assert choose("9.0", jnp.bfloat16, 256, 16, **big) == MOSAIC_GPU
    small = dict(num_tokens=8, num_slots=8, pages_per_seq=64)
    assert choose("9.0", jnp.bfloat16, 256, 16, **small) == TRITON


def test_triton_shrinks_its_blocks_to_fit_smem_or_refuses():
    """bf16 head_dim 256 with 128-key pages asks Triton for ~288 KiB with the tuning row's
    launch: the launch drops to one stage and fits; f32 does not fit even then."""
    shape = gpu_kernel.launch_shape(Bucket(64, 4, 2, 4, 8, 128, 256, jnp.bfloat16), H100, "9.0")
    assert (shape.block_kv // 128, shape.stages) == (1, 1)
    need = gpu_kernel.smem_bound(shape.rows, 128, 256, jnp.bfloat16, shape.stages)
    assert need <= gpu_kernel.smem_budget("9.0")
    # f32 head_dim 256, 16-key pages: the key block halves from 64 to 32 keys, 2 stages kept.
    shape = gpu_kernel.launch_shape(Bucket(64, 4, 2, 4, 64, 16, 256, jnp.float32), H100, "9.0")
    assert (shape.block_kv, shape.stages) == (32, 3)
    reason = gpu_kernel.supports(
        gpu_common.Query(
            "9.0",
            jnp.float32,
            head_dim=256,
            page_size=128,
            num_q_heads=8,
            num_kv_heads=2,
            block_sizes=H100,
        )
    )
    assert "SMEM" in reason and "float32" in reason
    assert choose("9.0", jnp.float32, 256, 128, group=4) is None
    # Smaller GPUs have less: L4 (8.9) 99 KiB, A100 (8.0) 163 KiB, H100 (9.0) 227 KiB a block.
    assert gpu_kernel.smem_budget("8.9") < gpu_kernel.smem_budget("8.0")
    assert gpu_kernel.smem_budget("8.0") < gpu_kernel.smem_budget("9.0")


def test_choice_never_picks_a_kernel_that_refuses_the_bucket():
    """Over a grid of shapes and buckets: the kernel chosen for a bucket launches for it, and the
    kernel chosen without a bucket launches for every bucket of the grid."""
    buckets = [
        dict(num_tokens=1, num_slots=1, pages_per_seq=1),
        dict(num_tokens=16, num_slots=16, pages_per_seq=64),
        dict(num_tokens=64, num_slots=4, pages_per_seq=32),
        dict(num_tokens=512, num_slots=8, pages_per_seq=256),
    ]
    grid = itertools.product(
        ("8.0", "9.0", "10.0"),
        (jnp.float32, jnp.bfloat16, jnp.float16),
        (8, 16, 32, 48, 64, 80, 96, 128, 256),
        (1, 8, 16, 24, 32, 64, 128, 256),
        (1, 2, 3, 4, 8),
    )
    picked = set()
    for capability, dtype, head_dim, page_size, group in grid:
        any_bucket = choose(capability, dtype, head_dim, page_size, group)
        for bucket in buckets:
            kernel = choose(capability, dtype, head_dim, page_size, group, **bucket)
            for name in {kernel, any_bucket} - {None}:
                _launch(name, capability, dtype, head_dim, page_size, group, bucket)
                picked.add(name)
    assert picked == {MOSAIC_GPU, TRITON}


def _launch(name, capability, dtype, head_dim, page_size, group, bucket):
    """The launch `name`'s kernel would make (NotImplementedError where it refuses)."""
    args = (
        bucket["num_tokens"],
        bucket["num_slots"],
        2,
        group,
        bucket["pages_per_seq"],
        page_size,
        head_dim,
        dtype,
    )
    if name == MOSAIC_GPU:
        return mosaic_gpu_kernel.launch_shape(Bucket(*args), H100)
    return gpu_kernel.launch_shape(Bucket(*args), H100, capability)


def test_refusals_are_sentences_with_the_values():
    reasons = gpu_kernel_refusals(
        "8.6", jnp.float32, head_dim=96, page_size=12, num_q_heads=4, num_kv_heads=2
    )
    assert "'8.6'" in reasons[MOSAIC_GPU] and reasons[MOSAIC_GPU].endswith(".")
    assert "head_dim=96" in reasons[TRITON] and reasons[TRITON].endswith(".")
    with pytest.raises(ValueError, match="num_q_heads=6"):
        choose_gpu_kernel(
            "9.0", jnp.bfloat16, head_dim=64, page_size=16, num_q_heads=6, num_kv_heads=4
        )
    with pytest.raises(ValueError, match="all of num_tokens"):
        choose("9.0", jnp.bfloat16, 64, 16, num_tokens=8)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("9.0", (9, 0)),
        ("8.6", (8, 6)),
        ("10.0", (10, 0)),
        ("9.0a", (9, 0)),
        ("90", (9, 0)),
        ("120", (12, 0)),
        (None, None),
        ("", None),
        ("gfx90a", None),
        ("nine", None),
    ],
)
def test_parse_compute_capability(text, want):
    assert parse_compute_capability(text) == want


def test_gpu_targets_are_hopper_with_the_accelerated_features():
    """The shipped compile targets: sm_90a (wgmma needs it), the capability the choice is given."""
    for name in gpu_targets.TARGETS:
        text = gpu_targets.target_config(name)
        assert "feature_extension: ACCELERATED_FEATURES" in text
        assert gpu_targets.compute_capability(name) == "9.0"
        assert choose(gpu_targets.compute_capability(name), jnp.bfloat16, 128, 16) == MOSAIC_GPU
    assert "141GB" in gpu_targets.target_config("h200")
    with pytest.raises(ValueError, match="'a100'"):
        gpu_targets.target_config("a100")
