"""The target: the platform and chip a step is built for, resolved in one place.

Every choice that depends on the hardware reads it from here: the attention backend, the
kernels' block sizes and VMEM limits, the layer loop, the default dtype, the device kind a cost
model is keyed by. Serving builds for the process's own devices (`current()` with nothing in
use). `jaxserve compile --target v5e:2x2` builds for chips this process does not have:
`use(resolve("v5e:2x2"))` around the tracing, with the abstract devices of libtpu's topology API
(or the CUDA plugin's, for "h100" / "h200"), so nothing that decides a shape or a kernel ever
asks `jax.default_backend()` itself (docs/architecture.md, Decision 5).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import re
from collections.abc import Iterator

from pallas_kernels import chips

# Platforms as JAX's devices and plugins spell them, to ours.
_PLATFORM = {"cpu": "cpu", "tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """Where a step runs: its platform, its chip, and the devices to build for."""

    platform: str  # "cpu", "tpu" or "gpu"
    device_kind: str  # as jax.Device.device_kind reports it: "cpu", "TPU v5 lite", ...
    compute_capability: str | None = None  # GPUs: "9.0"
    name: str | None = None  # the name it was resolved from ("v5e:2x2", "h100"); None: this host
    devices: tuple = ()  # the devices to build for (abstract ones when compile_only)
    compile_only: bool = False  # True: topology devices that can compile but never run

    def __post_init__(self):
        if self.platform not in ("cpu", "tpu", "gpu"):
            raise ValueError(f"Target platform {self.platform!r} must be cpu, tpu or gpu.")

    @property
    def chip(self) -> chips.TpuChip | chips.GpuChip | None:
        """The chip's published facts (HBM, bandwidth, peaks, VMEM), or None on the CPU or for
        a chip the table does not list."""
        if self.platform == "cpu":
            return None
        try:
            return chips.lookup(self.device_kind)
        except ValueError:
            return None


_ACTIVE: contextvars.ContextVar[Target | None] = contextvars.ContextVar("jaxserve_target")


def current() -> Target:
    """The target in use (`use`), else the process's own default backend."""
    target = _ACTIVE.get(None)
    return target if target is not None else local()


@contextlib.contextmanager
def use(target: Target) -> Iterator[Target]:
    """Builds (traces, lowers, compiles) inside the block for `target` instead of this host."""
    token = _ACTIVE.set(target)
    try:
        yield target
    finally:
        _ACTIVE.reset(token)


@functools.cache
def local() -> Target:
    """The process's own default backend and its first device (JAX's devices do not change)."""
    import jax

    device = jax.devices()[0]
    return Target(
        platform=_PLATFORM.get(device.platform, device.platform),
        device_kind=device.device_kind,
        compute_capability=getattr(device, "compute_capability", None),
        devices=tuple(jax.devices()),
    )


def resolve(name: str | None, *, min_devices: int = 1) -> Target:
    """The target named `name`: None or "local" for this host; a TPU topology as libtpu names
    it ("v5e:2x2", "v5e:1x1", "v6e:2x2", "v5p:2x2x1", "tpu7x:2x2x1", "v4:2x2x1"); a GPU as
    "h100" / "h200", optionally with a device count ("h100:4", else `min_devices`).

    TPU targets need libtpu (`pip install -e ".[tpu]"`), GPU targets the CUDA compile set
    (`".[cuda-compile]"`); both work with JAX_PLATFORMS=cpu on a machine without the accelerator.
    """
    if name in (None, "", "local"):
        return local()
    if re.fullmatch(r"(h100|h200)(:\d+)?", name):
        return _gpu(name, min_devices)
    generation = name.partition(":")[0]
    if generation in chips.TPU_CHIPS and ":" in name:
        return _tpu(name)
    raise ValueError(
        f"Unknown target {name!r}: give a TPU topology such as 'v5e:2x2' or 'v5e:1x1' "
        f"(generations {sorted(chips.TPU_CHIPS)}), 'h100' or 'h200' (optionally ':N' devices), "
        "or 'local'."
    )


@functools.cache
def _tpu(name: str) -> Target:
    # libtpu takes /tmp/libtpu_lockfile even to describe a topology; compile-only use touches no
    # chip, so several processes (parallel tests, a compile beside a serve) may share it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies
    except ImportError as e:  # pragma: no cover - part of every jax
        raise ValueError(f"This jax has no topology API to target {name!r}: {e}") from e
    options = {}
    shape = name.partition(":")[2]
    if all(d == "1" for d in shape.split("x")):  # one chip: its host bounds must say so
        options["chips_per_host_bounds"] = (1, 1, 1)
    try:
        devices = tuple(
            topologies.get_topology_desc(topology_name=name, platform="tpu", **options).devices
        )
    except Exception as e:  # libtpu missing, or a topology it does not know
        raise ValueError(
            f"Cannot build TPU topology {name!r} ({type(e).__name__}: {e}). TPU targets need "
            'libtpu: pip install -e ".[tpu]".'
        ) from e
    return Target(
        platform="tpu",
        device_kind=devices[0].device_kind,
        name=name,
        devices=devices,
        compile_only=True,
    )


@functools.cache
def _gpu(name: str, min_devices: int) -> Target:
    from pallas_kernels import gpu_targets

    model, _, count = name.partition(":")
    num = int(count) if count else max(1, min_devices)
    try:
        devices = tuple(gpu_targets.compile_only_devices(model, num_devices=num))
    except Exception as e:  # the CUDA plugin missing
        raise ValueError(
            f"Cannot build GPU target {name!r} ({type(e).__name__}: {e}). GPU targets need the "
            'CUDA compile set: pip install -e ".[cuda-compile]".'
        ) from e
    return Target(
        platform="gpu",
        device_kind=devices[0].device_kind,
        compute_capability=gpu_targets.compute_capability(model),
        name=f"{model}:{num}",
        devices=devices,
        compile_only=True,
    )
