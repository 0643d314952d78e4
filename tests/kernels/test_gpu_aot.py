"""The GPU kernels compiled ahead of time for Hopper (sm_90a) on the CPU, no GPU needed.

The CUDA plugin builds compile-only H100 devices from pallas_kernels/gpu_targets/h100.txtpb;
`jax.jit(f).trace(...).lower().compile()` on arrays placed there runs the whole GPU compile: XLA,
Triton, and Mosaic GPU down to PTX and ptxas's sm_90a machine code. That catches what lowering
alone does not (issue 28's defect 5, the Mosaic GPU kernel's wgmma swizzle mismatch for head
dims below 64, failed here; Triton's shared memory beyond the 227 KiB a block has, too). Each
shape's kernel is the one kernel_choice.py picks for it, so the choice and the kernels are
checked together: a picked kernel that does not compile fails here.

Compiling is a few seconds per shape on 2 cores, so the cases cover the ground together rather
than multiplied out: bf16/f16 on Mosaic GPU, f32 and the shapes Mosaic refuses on Triton, head
dims 8-256, pages 1-128, GQA 1-4, 1-16384 query tokens, key splits and sliding windows.

Needs jax-cuda12-plugin, jax-cuda12-pjrt and nvidia-cuda-nvcc-cu12 (ptxas); without them the
compile tests skip. The cost-estimate tests only trace, and run anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels import gpu_targets
from pallas_kernels.ragged_paged_attention import gpu_common, gpu_kernel, mosaic_gpu_kernel, tuning
from pallas_kernels.ragged_paged_attention.kernel_choice import (
    MOSAIC_GPU,
    TRITON,
    choose_gpu_kernel,
)


def _installed(module: str) -> bool:
    """Whether `module` can be imported; a missing parent package (no `jax_plugins` or `nvidia`
    namespace at all, as in a venv without libtpu or any CUDA wheel) is not installed either."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


_MISSING = [
    package
    for package, module in (
        ("jax-cuda12-plugin", "jax_plugins.xla_cuda12"),
        ("nvidia-cuda-nvcc-cu12", "nvidia.cuda_nvcc"),
    )
    if not _installed(module)
]
needs_cuda_plugin = pytest.mark.skipif(
    bool(_MISSING),
    reason=(
        f"Compiling for a GPU without one needs the CUDA plugin and ptxas; not installed: "
        f"{', '.join(_MISSING)} (pip install -e '.[cuda-compile]', "
        f"or as .ci/run does, into a folder of its own)."
    ),
)

H100 = tuning.GPU_TABLE["H100"]
NUM_LAYERS, NUM_KV_HEADS = 2, 2


@dataclasses.dataclass(frozen=True)
class Shape:
    """One bucket of one model: what the kernel is traced with."""

    dtype: type
    head_dim: int
    page_size: int
    group: int  # query heads per KV head
    num_tokens: int
    num_slots: int
    pages_per_seq: int
    sliding_window: int | None = None
    capability: str = "9.0"  # the GPU the choice is made for (compiled for the H100 target)
    soft_cap: float | None = None  # Gemma 2's attention-logit cap

    def args(self, sharding=None) -> tuple:
        """The kernel's positional arguments as ShapeDtypeStructs (on `sharding`'s devices)."""

        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        num_pages = self.num_slots * self.pages_per_seq + 1
        lanes = 2 * NUM_KV_HEADS * self.head_dim  # keys and values side by side (common.fuse_kv)
        pool = sds((NUM_LAYERS, num_pages, self.page_size, lanes), self.dtype)
        num_heads = NUM_KV_HEADS * self.group
        return (
            sds((self.num_tokens, num_heads, self.head_dim), self.dtype),
            pool,
            sds((), jnp.int32),  # layer
            sds((self.num_slots + 1,), jnp.int32),  # query_start
            sds((self.num_slots,), jnp.int32),  # kv_lens
            sds((self.num_slots, self.pages_per_seq), jnp.int32),  # page_tables
            sds((), jnp.int32),  # num_seqs
        )

    def choice(self) -> str | None:
        return choose_gpu_kernel(
            self.capability,
            self.dtype,
            head_dim=self.head_dim,
            page_size=self.page_size,
            num_q_heads=NUM_KV_HEADS * self.group,
            num_kv_heads=NUM_KV_HEADS,
            block_sizes=H100,
            num_tokens=self.num_tokens,
            num_slots=self.num_slots,
            pages_per_seq=self.pages_per_seq,
        )

    def kernel(self, name: str):
        """The picked kernel, with the arguments the attention module gives it."""
        kwargs = dict(
            sm_scale=self.head_dim**-0.5,
            sliding_window=self.sliding_window,
            soft_cap=self.soft_cap,
            block_sizes=H100,
        )
        if name == TRITON:
            return functools.partial(
                gpu_kernel.ragged_paged_attention, compute_capability=self.capability, **kwargs
            )
        return functools.partial(mosaic_gpu_kernel.ragged_paged_attention, **kwargs)


# name: (shape, the kernel the choice must pick)
CASES = {
    # Mosaic GPU: 16-bit pools on Hopper.
    "bf16_d128_mixed_gqa4": (Shape(jnp.bfloat16, 128, 16, 4, 64, 8, 64), MOSAIC_GPU),
    # One decode sequence: the H100 row's 16 key splits; pages of 8.
    "f16_d64_decode_one": (Shape(jnp.float16, 64, 8, 1, 1, 1, 256), MOSAIC_GPU),
    # Defect 5: head_dim 32 and 16 (llama-tiny's) in bf16, GQA 3 and 2, pages of 64 and 128.
    "bf16_d32_gqa3": (Shape(jnp.bfloat16, 32, 64, 3, 96, 8, 16), MOSAIC_GPU),
    "bf16_d16_pages128": (Shape(jnp.bfloat16, 16, 128, 2, 128, 2, 8), MOSAIC_GPU),
    # head_dim 256 fits Mosaic's SMEM only without key splits: a bucket with many programs.
    "bf16_d256_no_splits": (Shape(jnp.bfloat16, 256, 32, 2, 16384, 8, 128), MOSAIC_GPU),
    "bf16_d128_window_pages128": (
        Shape(jnp.bfloat16, 128, 128, 4, 512, 16, 32, sliding_window=1024),
        MOSAIC_GPU,
    ),
    "f16_d80": (Shape(jnp.float16, 80, 16, 1, 16, 16, 32), MOSAIC_GPU),
    # Gemma 2's local layers (head_dim 256 without splits, a window, the soft cap of 50).
    "bf16_d256_gemma2_local": (
        Shape(jnp.bfloat16, 256, 32, 2, 16384, 8, 128, sliding_window=4096, soft_cap=50.0),
        MOSAIC_GPU,
    ),
    "f32_d256_gemma2_local": (
        Shape(jnp.float32, 256, 16, 2, 64, 4, 64, sliding_window=100, soft_cap=50.0),
        TRITON,
    ),
    # Triton: f32 pools, and what Mosaic GPU refuses.
    "f32_d128_mixed_gqa4": (Shape(jnp.float32, 128, 16, 4, 64, 8, 64), TRITON),
    "f32_d64_decode_one": (Shape(jnp.float32, 64, 8, 1, 1, 1, 256), TRITON),
    # Defect 4: models/loaded.abstract_params' trace, llama-tiny's heads on a page_size=1 pool.
    "bf16_d16_abstract_params": (Shape(jnp.bfloat16, 16, 1, 2, 1, 1, 1), TRITON),
    # f32 head_dim 256: the launch halves its key blocks to fit SMEM.
    "f32_d256_fitted": (Shape(jnp.float32, 256, 16, 2, 64, 4, 64), TRITON),
    # bf16 head_dim 256 with key splits (Mosaic's SMEM refuses), pages of 128: one stage.
    "bf16_d256_pages128_fitted": (Shape(jnp.bfloat16, 256, 128, 1, 32, 2, 8), TRITON),
    "f32_d32_window_gqa3": (
        Shape(jnp.float32, 32, 32, 3, 512, 8, 16, sliding_window=100),
        TRITON,
    ),
    # stories260k's head_dim 8: rows of 16 bytes, which wgmma cannot read.
    "bf16_d8": (Shape(jnp.bfloat16, 8, 16, 2, 16, 4, 8), TRITON),
    # What an A100 (8.0) runs: Triton in bf16, within its 163 KiB (compiled for the H100).
    "bf16_d128_sm80": (Shape(jnp.bfloat16, 128, 16, 4, 64, 8, 64, capability="8.0"), TRITON),
}


@pytest.fixture(scope="module")
def h100():
    """NamedSharding on one compile-only H100 (sm_90a)."""
    devices = gpu_targets.compile_only_devices("h100")
    return NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec())


@needs_cuda_plugin
@pytest.mark.parametrize("name", list(CASES))
def test_chosen_kernel_compiles_for_sm90a(name, h100):
    shape, want = CASES[name]
    kernel = shape.choice()
    assert kernel == want
    with gpu_targets.lowering_for(h100.mesh):
        lowered = jax.jit(shape.kernel(kernel)).trace(*shape.args(h100)).lower()
    compiled = lowered.compile()
    text = compiled.as_text()
    # The kernel is in the executable as its custom call, not an XLA fallback.
    assert ("mosaic_gpu" in text) if kernel == MOSAIC_GPU else ("triton" in text)


@needs_cuda_plugin
def test_h200_target_compiles_too():
    """The H200 config builds devices of its own kind that compile the serving shape."""
    devices = gpu_targets.compile_only_devices("h200", num_devices=2)
    assert len(devices) == 2 and "H200" in devices[0].device_kind
    sharding = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())
    shape, kernel = CASES["bf16_d128_mixed_gqa4"]
    with gpu_targets.lowering_for(sharding.mesh):
        lowered = jax.jit(shape.kernel(kernel)).trace(*shape.args(sharding)).lower()
    lowered.compile()


@needs_cuda_plugin
def test_fp8_w8a8_model_compiles_for_the_h100_and_int8_w8a8_is_refused(tmp_path):
    """`jaxserve compile --target h100 --quantization fp8`: the H100 has fp8 matmuls, so the
    scheme is W8A8 with e4m3 kernels; int8-w8a8 asks for an int8 dot no GPU path has here and
    is refused, naming the scheme and the chip."""
    import json
    import subprocess
    import sys

    common = ["--target", "h100", "--model", "llama-tiny", "--max-num-seqs", "4",
              "--max-num-batched-tokens", "16", "--buckets", "1,16"]  # fmt: skip
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "jaxserve.cli", "compile", *common, "--json", str(out)]
    proc = subprocess.run(
        [*cmd, "--quantization", "fp8"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["quantization"] == "fp8 W8A8" and report["quantization_note"] is None
    assert "float8_e4m3fn" in report["param_bytes_by_dtype"]
    assert all(b["compiled"] for b in report["buckets"])
    proc = subprocess.run(
        [*cmd, "--quantization", "int8-w8a8"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode != 0 and "int8-w8a8" in proc.stderr and "H100" in proc.stderr


@needs_cuda_plugin
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_an_8_bit_kv_pool_compiles_for_the_h100_through_the_triton_kernel(tmp_path, kv):
    """`jaxserve compile --target h100 --kv-cache-dtype int8|fp8 --attention-backend pallas`:
    the step with its 8-bit pool (scale exponents in the page's lanes) goes to the Triton
    kernel, which dequantizes as it loads, and compiles for sm_90a."""
    import json
    import subprocess
    import sys

    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "jaxserve.cli", "compile", "--target", "h100", "--model",
           "qwen3-tiny", "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--buckets",
           "1,16", "--kv-cache-dtype", kv, "--attention-backend", "pallas",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["kv_cache_dtype"] == {"int8": "int8", "fp8": "float8_e4m3fn"}[kv]
    assert report["attention_backend"] == "pallas_gpu"
    assert all(b["compiled"] for b in report["buckets"])


# Triton launches whose SMEM need is read off the compiler: (shape, tuning row).
SMEM_CALIBRATION = [
    (Shape(jnp.bfloat16, 256, 128, 4, 64, 4, 8), H100),  # 3 stages, 128-key blocks
    (Shape(jnp.float32, 128, 64, 8, 256, 2, 8), dataclasses.replace(H100, q_rows=128)),
    (Shape(jnp.bfloat16, 64, 1, 1, 4, 4, 8), dataclasses.replace(H100, num_stages=1)),
    (Shape(jnp.float32, 16, 16, 1, 4, 4, 8), H100),
]


@needs_cuda_plugin
def test_triton_smem_model_bounds_what_triton_asks_for():
    """gpu_kernel.smem_bound is an upper bound on Triton's real need. Against a copy of the H100
    target with 1 KiB of SMEM per block every compile fails, and XLA's error says how many bytes
    the kernel requested; the model must be at least that (and not absurdly more)."""
    text = gpu_targets.target_config("h100")
    tiny, count = re.subn(
        r"shared_memory_per_block_optin: \d+", "shared_memory_per_block_optin: 1024", text
    )
    assert count == 1
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        topology_name="h100-1k-smem", platform="cuda", target_config=tiny, topology="1x1x1"
    )
    sharding = NamedSharding(Mesh(np.array(topology.devices), ("x",)), PartitionSpec())
    for shape, sizes in SMEM_CALIBRATION:
        launch = gpu_kernel.launch_shape(
            gpu_common.Bucket(
                shape.num_tokens,
                shape.num_slots,
                NUM_KV_HEADS,
                shape.group,
                shape.pages_per_seq,
                shape.page_size,
                shape.head_dim,
                shape.dtype,
            ),
            sizes,
            "9.0",
        )
        bound = gpu_kernel.smem_bound(
            launch.rows,
            launch.block_kv,
            shape.head_dim,
            shape.dtype,
            launch.stages,
        )
        fn = functools.partial(gpu_kernel.ragged_paged_attention, sm_scale=0.1, block_sizes=sizes)
        with gpu_targets.lowering_for(sharding.mesh):
            lowered = jax.jit(fn).trace(*shape.args(sharding)).lower()
        with pytest.raises(Exception, match="requested") as failure:
            lowered.compile()
        requested = int(re.search(r"requested (\d+)", str(failure.value)).group(1))
        assert requested <= bound < 4 * requested, (shape, launch, requested, bound)


@pytest.mark.parametrize("kernel", [MOSAIC_GPU, TRITON])
def test_cost_estimate_rides_on_the_kernel_and_bounds_the_work(kernel):
    """Each kernel's pallas call carries a pl.CostEstimate (found in the traced program), at
    least what a full batch does: every token attends its whole page table of keys, and every
    sequence's K and V pages are read."""
    shape = Shape(jnp.bfloat16, 128, 16, 4, 16, 16, 64)
    jaxpr = jax.make_jaxpr(shape.kernel(kernel))(*shape.args())
    estimates = _cost_estimates(jaxpr.jaxpr)
    assert len(estimates) == 1, estimates
    estimate = estimates[0]
    num_heads, keys = NUM_KV_HEADS * shape.group, shape.pages_per_seq * shape.page_size
    assert estimate.flops >= 4 * shape.num_tokens * num_heads * keys * shape.head_dim
    assert estimate.transcendentals >= shape.num_tokens * num_heads * keys
    kv_bytes = 2 * shape.num_slots * NUM_KV_HEADS * keys * shape.head_dim * 2
    assert estimate.bytes_accessed >= kv_bytes


def test_mosaic_gpu_estimate_counts_whole_wgmma_tiles():
    """The Mosaic GPU kernel's dots run 64-row wgmma tiles whatever a decode item's real rows:
    its estimate counts 64 rows per (program, key block), not the stored rows."""
    shape = Shape(jnp.bfloat16, 64, 16, 1, 16, 16, 4)  # 16 decode tokens, group 1
    bucket = gpu_common.Bucket(16, 16, NUM_KV_HEADS, 1, 4, 16, 64, jnp.dtype(jnp.bfloat16))
    launch = mosaic_gpu_kernel.launch_shape(bucket, H100)
    assert launch.rows < 64
    estimate = _cost_estimates(jax.make_jaxpr(shape.kernel(MOSAIC_GPU))(*shape.args()).jaxpr)[0]
    blocks = -(-4 * 16 // launch.block_kv)
    block_steps = launch.num_items * NUM_KV_HEADS * blocks
    assert estimate.flops == block_steps * 4 * 64 * launch.block_kv * 64


def test_cost_estimate_with_a_window_counts_fewer_keys():
    """A sliding window bounds the keys each item reads: its estimate is smaller."""
    full = Shape(jnp.float32, 64, 16, 2, 64, 4, 128)
    windowed = dataclasses.replace(full, sliding_window=128)
    costs = []
    for shape in (full, windowed):
        costs.append(_cost_estimates(jax.make_jaxpr(shape.kernel(TRITON))(*shape.args()).jaxpr))
    assert costs[1][0].flops < costs[0][0].flops / 4
    assert costs[1][0].bytes_accessed < costs[0][0].bytes_accessed


def _cost_estimates(jaxpr) -> list:
    """The cost estimates of the kernel calls in `jaxpr`, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.params.get("cost_estimate") is not None:
            found.append(eqn.params["cost_estimate"])
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                found += _cost_estimates(inner)
    return found
