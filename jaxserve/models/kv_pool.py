"""The paged KV pool on the device: one preallocated array each for keys and values.

Layers are stacked on the leading axis so the model scans over them (one compiled layer body,
whatever the depth) and the step donates the pool, updating it in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxserve.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class KVPages:
    """Keys and values of every cached token, addressed by (layer, page, offset)."""

    k: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]
    v: jax.Array  # [num_layers, num_pages, page_size, num_kv_heads, head_dim]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


jax.tree_util.register_dataclass(KVPages, data_fields=["k", "v"], meta_fields=[])


def init_kv_pages(
    config: ModelConfig,
    *,
    num_pages: int,
    page_size: int,
    dtype: jnp.dtype = jnp.float32,
    sharding: jax.sharding.Sharding | None = None,
) -> KVPages:
    """Allocates a zeroed pool of `num_pages` pages of `page_size` tokens for every layer.

    With `sharding` (split by KV head over a mesh) each device allocates only its own heads.
    """
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"The KV pool needs {num_pages=} >= 1 and {page_size=} >= 1.")
    shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
    return KVPages(
        k=jnp.zeros(shape, dtype, device=sharding), v=jnp.zeros(shape, dtype, device=sharding)
    )


def kv_bytes_per_page(config: ModelConfig, page_size: int, dtype: jnp.dtype) -> int:
    """Bytes one page takes over all layers, keys and values: to size the pool from a budget."""
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * itemsize


def free_device_bytes(devices: Sequence[jax.Device]) -> int | None:
    """The least free memory over `devices` (bytes), or None where JAX does not report it (CPU)."""
    free = []
    for device in devices:
        if device.process_index != jax.process_index():
            continue  # other hosts measure their own devices; the engine takes the least of all
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free) if free else None


def pages_that_fit(
    bytes_per_page: int, devices: Sequence[jax.Device], *, fraction: float, fallback_gb: float
) -> int:
    """Pages whose per-device share (`bytes_per_page` on each device) fits the free memory.

    Call it after the params are placed, so what they take is already in use. Where the platform
    reports no memory (the CPU), the budget is `fallback_gb` per device.
    """
    free = free_device_bytes(devices)
    budget = int(fallback_gb * 2**30) if free is None else int(free * fraction)
    return max(budget // bytes_per_page, 0)
