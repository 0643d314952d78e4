"""The whole jitted step compiled ahead of time for TPU on this CPU host (runtime/aot.py: XLA:TPU
and Mosaic on a libtpu topology's abstract devices; skipped without libtpu). Nothing runs.

- The KV pool keeps its place (issue 28, defect 3): no compiled step copies, transposes or
  gathers a whole pool. The 5-d [L, pages, page_size, KV heads, head_dim] pool of smollm2-135m's 3
  KV heads x 64 was laid out pages-minor by XLA:TPU, and every step copied it to row-major for
  the kernel and back: 1.9 GiB of temporaries for a 0.7 GiB pool.
- Tensor parallel with the Pallas kernel compiles for every split of the tiny models and of
  smollm2-135m (defect 1), with no pool copy either.
"""

from __future__ import annotations

import importlib.util

import pytest

from jaxserve.engine_config import EngineConfig
from jaxserve.runtime import aot

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='needs libtpu for TPU targets: pip install -e ".[tpu]"',
)


def compile_one_bucket(target: str, model: str, tensor_parallel: int) -> aot.CompileReport:
    """One 16-token bucket of the engine `model` would serve on `target`, Pallas attention."""
    config = EngineConfig(
        model=model,
        tensor_parallel=tensor_parallel,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        attention_backend="pallas",
    )
    report = aot.compile_for_target(config, target, buckets=[16])
    assert report.attention_backend == "pallas_tpu" and report.platform == "tpu"
    [bucket] = report.buckets
    assert bucket.compiled, bucket.error
    return report


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_the_step_never_copies_the_pool(chip):
    """smollm2-135m (30 layers, 3 KV heads of 64), the pool sized from the chip's HBM."""
    report = compile_one_bucket(f"{chip}:1x1", "smollm2-135m", 1)
    [bucket] = report.buckets
    assert bucket.pool_copies == 0
    assert report.pool_padding == 1.0  # 2 * 3 * 64 = 384 lanes: whole 128-lane tiles
    # What the step needs beside the pool: activations, logits, attention buffers, well under
    # a tenth of the pool (it was 2.7 times the pool before).
    assert bucket.temp_bytes < 0.1 * report.pool_bytes_per_device


@pytest.mark.parametrize(
    ("model", "tensor_parallel"),
    [
        # TP 1 of llama-tiny and TP 2 of smollm2-135m: tests/e2e/test_compile.py.
        ("llama-tiny", 2),  # 2 KV heads over 2 devices: one each
        ("llama-tiny", 4),  # 2 KV heads over 4: each KV head on two devices
        ("qwen3-tiny", 4),
        ("smollm2-135m", 4),  # 3 KV heads over 4 devices: not head-local, the pool replicated
    ],
)
def test_tensor_parallel_steps_compile_with_the_pallas_kernel_and_no_pool_copy(
    model, tensor_parallel
):
    report = compile_one_bucket("v5e:2x2", model, tensor_parallel)
    assert report.num_devices == tensor_parallel
    assert report.buckets[0].pool_copies == 0


@pytest.mark.parametrize(("target", "tensor_parallel"), [("v5e:1x1", 1), ("v6e:2x2", 4)])
def test_a_mixture_of_experts_runs_its_experts_through_megablox(target, tensor_parallel):
    """qwen3-moe-tiny's step (the scanned layer body) calls three Pallas kernels on a TPU: the
    attention and megablox's grouped matmul for gate/up and for down, where its dense twin
    calls the attention alone; at TP 4 each device holds 2 of the 8 experts."""
    moe = compile_one_bucket(target, "qwen3-moe-tiny", tensor_parallel)
    dense = compile_one_bucket(target, "qwen3-moe-tiny-dense", tensor_parallel)
    assert (moe.buckets[0].mosaic_calls, dense.buckets[0].mosaic_calls) == (3, 1)
    assert moe.buckets[0].pool_copies == 0
