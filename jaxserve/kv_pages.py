"""The paged KV pool on the device: one preallocated array each for keys and values.

Layers are stacked on the leading axis so the model scans over them (one compiled layer body,
whatever the depth) and the step donates the pool, updating it in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig


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
    config: ModelConfig, *, num_pages: int, page_size: int, dtype: jnp.dtype = jnp.float32
) -> KVPages:
    """Allocates a zeroed pool of `num_pages` pages of `page_size` tokens for every layer."""
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"The KV pool needs {num_pages=} >= 1 and {page_size=} >= 1.")
    shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
    return KVPages(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def kv_bytes_per_page(config: ModelConfig, page_size: int, dtype: jnp.dtype) -> int:
    """Bytes one page takes over all layers, keys and values: to size the pool from a budget."""
    itemsize = jnp.dtype(dtype).itemsize
    return 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * itemsize
