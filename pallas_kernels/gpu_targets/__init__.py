"""GPU compile targets, for building and checking GPU programs on a machine without the GPU.

The CUDA PJRT plugin (jax-cuda12-plugin) can describe a topology of GPUs it does not have from a
`GpuTargetConfigProto` in text form; `jax.jit(f).trace(...).lower().compile()` on arrays placed on
those compile-only devices then runs the whole GPU compile (XLA, Triton and Mosaic GPU down to
machine code) on the CPU. That is how the build machines check that the Pallas GPU kernels compile
for Hopper (tests/kernels/test_gpu_aot.py) and how jaxserve's compile tool can build GPU
executables ahead of time. One `<name>.txtpb` file per target, shipped as package data.
"""

from __future__ import annotations

import re
from importlib import resources

TARGETS = ("h100", "h200")


def parse_compute_capability(compute_capability: str | None) -> tuple[int, int] | None:
    """(major, minor) of a capability spelled like `jax.Device.compute_capability` ("9.0", "8.6",
    also "9.0a" or "90"); None for None or anything else (a ROCm "gfx90a", an empty string)."""
    if compute_capability is None:
        return None
    text = str(compute_capability).strip()
    if match := re.fullmatch(r"(\d+)\.(\d+)[a-z]?", text):
        return int(match.group(1)), int(match.group(2))
    if match := re.fullmatch(r"(\d+)(\d)[a-z]?", text):  # "90", "120": sm_XY without the dot
        return int(match.group(1)), int(match.group(2))
    return None


def target_config(name: str) -> str:
    """The text `GpuTargetConfigProto` of target `name` (one of TARGETS)."""
    if name not in TARGETS:
        raise ValueError(f"Unknown GPU target {name!r}; the known ones are {TARGETS}.")
    return resources.files(__name__).joinpath(f"{name}.txtpb").read_text()


def compute_capability(name: str) -> str:
    """The target's compute capability as `jax.Device.compute_capability` spells it ("9.0").

    Read from the config rather than from a device, because that is what the kernel choice
    (pallas_kernels.ragged_paged_attention.kernel_choice) must be given when compiling ahead of
    time.
    """
    text = target_config(name)
    block = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", text)
    if block is None:
        raise ValueError(f"The GPU target {name!r} has no cuda_compute_capability block.")
    fields = dict(re.findall(r"(major|minor)\s*:\s*(\d+)", block.group(1)))
    return f"{fields.get('major', '0')}.{fields.get('minor', '0')}"


def lowering_for(mesh):
    """A context in which Pallas lowers for the GPUs of `mesh` (compile-only devices included).

    Since JAX 0.11, Pallas's Triton lowering reads the GPU's kind (hence its compute capability)
    from the abstract mesh in context, and from the default device only without one: on a
    machine without a GPU that is the CPU, and the lowering fails ("No supported GPU devices
    found"). JAX 0.10 fell back to sm90 by itself and ignores the context. Trace and lower a
    program for compile-only GPUs inside this.
    """
    import jax

    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def compile_only_devices(name: str, num_devices: int = 1) -> list:
    """`num_devices` compile-only GPUs of target `name` on one host, from the CUDA plugin.

    They compile but cannot run anything. Needs jax-cuda12-plugin (and jax-cuda12-pjrt); without
    it JAX raises. Works with JAX_PLATFORMS=cpu: the plugin is asked for a topology, not a client.
    """
    from jax.experimental import topologies

    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be at least 1.")
    topology = topologies.get_topology_desc(
        topology_name=name,
        platform="cuda",
        target_config=target_config(name),
        topology=f"1x1x{num_devices}",  # one process holding num_devices GPUs
    )
    return list(topology.devices)
