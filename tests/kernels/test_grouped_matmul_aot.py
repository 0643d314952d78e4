"""The grouped matmul compiled ahead of time for real chips on this CPU: TPUs and Hopper GPUs.

TPU (needs libtpu, the tpu extra; `jax.experimental.topologies` gives abstract devices): megablox
in bf16 at Qwen3-30B-A3B's two expert matmuls (gate_up [128, 2048, 1536], down
[128, 768, 2048]) for 1, 128 and 8192 tokens (M = 8, 1024, 65536 rows: 8 experts a token), on
v5e and v6e, through implementation="auto", so the lowering's platform choice is checked too;
then under shard_map with the experts split 4 ways over a v6e 2x2 and 8 ways over a v5e 2x4.
The real Mosaic compiler checks what interpret mode cannot: tiles it takes, VMEM (the compiler's
scoped allocation must stay within tuning.py's estimate, which stays within the budget), HBM.

GPU (needs the CUDA compile set, as tests/kernels/test_gpu_aot.py): "auto" is ragged_dot there;
compiled for compile-only H100 and H200 devices (pallas_kernels/gpu_targets), and over two H100s
with the experts split 2 ways. XLA:GPU (jaxlib 0.12) rewrites ragged_dot to a dense dot over
[M, G_local * K] (every expert's weights read, an [M, G_local, K] temporary): the tests check it
fits the chip and record its size; see xla.py.

Run with JAX_PLATFORMS=cpu (tests/conftest.py sets it): the topology APIs need no chip. Each
compile takes ~3-20 s on 2 shared cores.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from pallas_kernels import chips, gpu_targets
from pallas_kernels.grouped_matmul import tuning
from pallas_kernels.grouped_matmul.ops import expert_parallel_matmul, grouped_matmul

EXPERTS, TOP_K = 128, 8
MATMULS = {"gate_up": (2048, 1536), "down": (768, 2048)}  # (K, N) of Qwen3-30B-A3B
TOKENS = (1, 128, 8192)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # no parent namespace package at all
        return False


needs_libtpu = pytest.mark.skipif(
    not _installed("libtpu"),
    reason="libtpu (pip install -e '.[tpu]') is needed to compile for TPUs.",
)
_NO_CUDA = [
    package
    for package, module in (
        ("jax-cuda12-plugin", "jax_plugins.xla_cuda12"),
        ("nvidia-cuda-nvcc-cu12", "nvidia.cuda_nvcc"),
    )
    if not _installed(module)
]
needs_cuda_plugin = pytest.mark.skipif(
    bool(_NO_CUDA),
    reason=(
        f"Compiling for a GPU without one needs the CUDA plugin and ptxas; not installed: "
        f"{', '.join(_NO_CUDA)} (as .ci/run does, into a folder of its own)."
    ),
)


@functools.cache
def _tpu_devices(topology: str) -> tuple:
    """Abstract devices of a TPU topology. libtpu's lockfile guards a chip this machine lacks,
    so it is skipped (ALLOW_MULTIPLE_LIBTPU_LOAD) while the topology is made, then restored."""
    from jax.experimental import topologies

    previous = os.environ.get("ALLOW_MULTIPLE_LIBTPU_LOAD")
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    try:
        options = {"chips_per_host_bounds": (1, 1, 1)} if topology.endswith(":1x1") else {}
        desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", **options)
    finally:
        if previous is None:
            del os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"]
        else:
            os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = previous
    return tuple(desc.devices)


def _args(m: int, matmul: str, lhs_sharding, rhs_sharding=None) -> tuple:
    k, n = MATMULS[matmul]
    return (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=lhs_sharding),
        jax.ShapeDtypeStruct((EXPERTS, k, n), jnp.bfloat16, sharding=rhs_sharding or lhs_sharding),
        jax.ShapeDtypeStruct((EXPERTS,), jnp.int32, sharding=lhs_sharding),
    )


def _gmm_calls(compiled) -> list[dict]:
    """The backend configs of the compiled program's Mosaic custom calls."""
    configs = []
    for line in compiled.as_text().splitlines():
        if 'custom_call_target="tpu_custom_call"' in line:
            start = line.index("backend_config=") + len("backend_config=")
            configs.append(json.JSONDecoder().raw_decode(line[start:])[0])
    return configs


def _check_tpu(compiled, chip: str, m: int, matmul: str) -> None:
    """One megablox call whose scoped VMEM the estimate bounds, and HBM that fits the chip."""
    calls = _gmm_calls(compiled)
    assert len(calls) == 1, f"want one megablox kernel, got {len(calls)} Mosaic calls"
    used = sum(int(c["size"]) for c in calls[0]["used_scoped_memory_configs"])
    k, n = MATMULS[matmul]
    tiling = tuning.megablox_tiling(
        m,
        k,
        n,
        EXPERTS,
        lhs_dtype=jnp.bfloat16,
        rhs_dtype=jnp.bfloat16,
        out_dtype=jnp.bfloat16,
        chip=chip,
    )
    estimate = tuning.vmem_bytes(tiling, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)
    assert used <= estimate <= tuning.vmem_budget_bytes(chip), (
        f"{chip} {matmul} M={m} at {tiling}: the compiler allocated {used} bytes of scoped VMEM, "
        f"the estimate is {estimate}, the budget {tuning.vmem_budget_bytes(chip)}."
    )
    memory = compiled.memory_analysis()
    hbm = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    assert hbm <= chips.tpu_chip(chip).hbm_bytes_per_device


@needs_libtpu
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("matmul", list(MATMULS))
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_megablox_compiles_for_tpu(chip, matmul, tokens):
    device = _tpu_devices(f"{chip}:1x1")[0]
    m = tokens * TOP_K
    fn = functools.partial(
        grouped_matmul, chip=device.device_kind, preferred_element_type=jnp.bfloat16
    )
    compiled = jax.jit(fn).trace(*_args(m, matmul, SingleDeviceSharding(device))).lower().compile()
    _check_tpu(compiled, chip, m, matmul)


@needs_libtpu
@pytest.mark.parametrize(("topology", "shape"), [("v6e:2x2", 4), ("v5e:2x4", 8)])
def test_expert_parallel_compiles_for_tpu(topology, shape):
    """128 experts over 4 (v6e) or 8 (v5e) chips: 32 or 16 each, 512 tokens' 4096 rows on every
    chip; one megablox call per chip and the all-reduce that assembles the rows."""
    devices = _tpu_devices(topology)
    assert len(devices) == shape
    mesh = Mesh(np.array(devices), ("expert",))
    replicated = NamedSharding(mesh, PartitionSpec())
    split = NamedSharding(mesh, PartitionSpec("expert"))
    fn = functools.partial(
        expert_parallel_matmul,
        mesh,
        "expert",
        chip=devices[0].device_kind,
        preferred_element_type=jnp.bfloat16,
    )
    m = 512 * TOP_K
    compiled = jax.jit(fn).trace(*_args(m, "gate_up", replicated, split)).lower().compile()
    assert "all-reduce" in compiled.as_text()
    _check_tpu(compiled, topology.partition(":")[0], m, "gate_up")


def _gpu_mesh(name: str, count: int) -> Mesh:
    return Mesh(np.array(gpu_targets.compile_only_devices(name, num_devices=count)), ("expert",))


def _check_gpu(compiled, name: str) -> int:
    """Temporary bytes of a GPU program with no TPU kernel in it, checked to fit the chip."""
    assert "tpu_custom_call" not in compiled.as_text()
    memory = compiled.memory_analysis()
    hbm = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    assert hbm <= chips.gpu_chip(name).hbm_bytes
    return memory.temp_size_in_bytes


@needs_cuda_plugin
@pytest.mark.parametrize("tokens", [1, 8192])
@pytest.mark.parametrize("matmul", list(MATMULS))
@pytest.mark.parametrize("name", list(gpu_targets.TARGETS))
def test_ragged_dot_compiles_for_gpu(name, matmul, tokens):
    """At 8192 tokens the dense rewrite's [M, 128, K] bf16 temporary is 32 GiB for gate_up (of
    the H100's 80) and 12 GiB for down."""
    sharding = NamedSharding(_gpu_mesh(name, 1), PartitionSpec())
    m = tokens * TOP_K
    fn = functools.partial(grouped_matmul, preferred_element_type=jnp.bfloat16)
    with gpu_targets.lowering_for(sharding.mesh):
        lowered = jax.jit(fn).trace(*_args(m, matmul, sharding)).lower()
    temp = _check_gpu(lowered.compile(), name)
    k = MATMULS[matmul][0]
    assert temp >= m * EXPERTS * k * 2, "XLA no longer expands ragged_dot densely: see xla.py"


@needs_cuda_plugin
def test_expert_parallel_compiles_for_two_h100s():
    mesh = _gpu_mesh("h100", 2)
    replicated = NamedSharding(mesh, PartitionSpec())
    split = NamedSharding(mesh, PartitionSpec("expert"))
    fn = functools.partial(
        expert_parallel_matmul, mesh, "expert", preferred_element_type=jnp.bfloat16
    )
    with gpu_targets.lowering_for(mesh):
        lowered = jax.jit(fn).trace(*_args(512 * TOP_K, "gate_up", replicated, split)).lower()
    compiled = lowered.compile()
    assert "all-reduce" in compiled.as_text()
    _check_gpu(compiled, "h100")
