"""The paged KV pool on the device: ONE preallocated array for keys and values.

    kv: [num_layers, num_pages, page_size, lanes]

Each token's keys and values sit side by side in the minor dimension: KV head h's keys at lanes
[2hD, 2hD + D), its values at [2hD + D, 2hD + 2D) (D = head_dim), and when the pool is split
over devices by KV head, each device's block of heads is contiguous and padded on its own
(`pallas_kernels.ragged_paged_attention.common.fuse_kv`). On TPU the lanes are padded to a
multiple of 128 (`kv_lanes`).

Why this shape: TPU HBM stores the two minor dimensions of an array in (8, 128) tiles (16 rows
of bfloat16). The 5-d [L, pages, page_size, num_kv_heads, head_dim] pool it replaced padded
[3, 64] to [4, 128] (smollm2-135m, 2.67x), so XLA:TPU gave it a pages-minor default layout
instead, which neither the Pallas kernel nor the scatter of new keys can use: every step copied K
and V to row-major and back (1.9 GiB of temporaries for a 0.7 GiB pool). A minor dimension of
whole 128-lane tiles is row-major with no padding (smollm2: 2 * 3 * 64 = 384 lanes), one page is
one contiguous DMA of its keys and values, and one scatter writes both.

Layers are stacked on the leading axis so the model scans over them (one compiled layer body,
whatever the depth) and the step donates the pool, updating it in place.

Hybrid pools (`KVLayout`, vLLM's hybrid allocator): a model with full-attention and
sliding-window layers (Gemma) splits its layers into groups of k; the pool's leading axis is k
(`group_size`), layer i lives at index `layer_slot[i]` and reads and writes through its group's
page table (`layer_group[i]`), and every group shares one page-ID space. A local group's pages
that fall out of its window can then go back to the allocator while the full group keeps its
own, so one page ID holds k layers' tokens of one group. A uniform layout (one group of all
layers, slot = layer) is the pool as it always was.

Quantized pools (`--kv-cache-dtype int8 | fp8`; docs/architecture.md, "Quantized KV cache"): the
same array in int8 or float8_e4m3fn, each token's keys (and, apart, its values) of each KV head
scaled by its own power of two 2^e. The exponents are integers in [-16, 16], stored in the
pool's own dtype (both hold them exactly) in the LAST 2 * heads lanes of each shard's block,
after any padding: head i's key exponent at lanes - 2 * heads + 2i, its value exponent after
it (`common.fuse_kv`). So the scales are part of the page: a device copy, a swap, the host
tier and a forked page move them with their keys and values with no code of their own, one
scatter writes both, and a reader finds them from the block's width alone. The lanes are
2 * heads * (head_dim + 1) per shard, padded to 128 on TPU (llama3.1-8b: 2048 -> 2176, one more
tile; the tiny shapes with head_dim 16 fit the padding they had). Zeros read as zeros. Measured
on v5e/v6e (compiled, memory_analysis): int8 and e4m3 pools of pages of 8-64 tokens take their
bytes with no row padding, as 16-bit ones do.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxserve.models.config import ModelConfig
from jaxserve.quantization import KV_CACHE_DTYPES
from pallas_kernels.ragged_paged_attention import common


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Which pool index and which page table each decoder layer uses (the module docstring).

    Static: it shapes the pool and the model's indexing, so the step compiles once per layout.
    Group 0 is a full-attention group (its table is StepBatch.page_tables, and it covers every
    page of a sequence); the other groups' tables are StepBatch.group_tables.
    """

    group_size: int  # k: layers per page ID, the pool's leading axis
    windows: tuple[int | None, ...]  # per group: None (full attention) or its sliding window
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its index on the pool's leading axis, < group_size

    def __post_init__(self):
        n, g = len(self.layer_group), len(self.windows)
        if len(self.layer_slot) != n or self.group_size < 1 or not self.windows:
            raise ValueError(
                f"A KVLayout needs group_size >= 1, at least one group and a slot per layer; got "
                f"group_size={self.group_size}, {g} groups, {n} layer groups and "
                f"{len(self.layer_slot)} layer slots."
            )
        if self.windows[0] is not None:
            raise ValueError(
                f"Group 0 must be a full-attention group (window None), not window "
                f"{self.windows[0]}: its table is the one that covers every page."
            )
        seen = set()
        for i, (group, slot) in enumerate(zip(self.layer_group, self.layer_slot, strict=True)):
            if not (0 <= group < g and 0 <= slot < self.group_size) or (group, slot) in seen:
                raise ValueError(
                    f"Layer {i} has group {group} and slot {slot}: each layer needs its own "
                    f"(group < {g}, slot < {self.group_size}) pair."
                )
            seen.add((group, slot))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_uniform(self) -> bool:
        """One group whose slots are the layers: the pool and the step of a plain model."""
        return self.num_groups == 1 and self.layer_slot == tuple(range(len(self.layer_slot)))

    @classmethod
    def uniform(cls, num_layers: int) -> KVLayout:
        """Every layer in group 0 at its own index: today's pool of num_layers per page."""
        return cls(num_layers, (None,), (0,) * num_layers, tuple(range(num_layers)))


def kv_layout(config: ModelConfig, hybrid: bool) -> KVLayout:
    """The pool layout of `config`: uniform unless `hybrid` and its layers mix full-attention
    and windowed ones (Gemma).

    k = min(#full, #windowed) layers per group, so the smaller kind fills whole groups and no
    group mixes kinds (a page of a group is freed for all its layers at once, which only works
    when they share a window). Full groups first (group 0 must be full), then one run of groups
    per distinct window, each taking its layers in layer order, k at a time; the last group of
    a run may hold fewer (its free slots are padding no layer touches). gemma3-1b (4 global of
    26): k = 4, 1 full + 6 local groups (the last with 2 layers); gemma2-2b: k = 13, 2 groups.
    """
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    full = [i for i, w in enumerate(windows) if w is None]
    if not hybrid or not full or len(full) == len(windows):
        return KVLayout.uniform(config.num_layers)
    k = min(len(full), len(windows) - len(full))
    group_windows, layer_group, layer_slot = [], [0] * len(windows), [0] * len(windows)
    runs = [full] + [
        [i for i, w in enumerate(windows) if w == window]
        for window in sorted({w for w in windows if w is not None})
    ]
    for layers in runs:
        for start in range(0, len(layers), k):
            for slot, layer in enumerate(layers[start : start + k]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(windows[layers[0]])
    return KVLayout(k, tuple(group_windows), tuple(layer_group), tuple(layer_slot))


@dataclasses.dataclass(frozen=True)
class KVPages:
    """Keys and values of every cached token, addressed by (layer, page, offset)."""

    kv: jax.Array  # [group_size, num_pages, page_size, lanes] (see the module docstring)

    @property
    def num_pages(self) -> int:
        return self.kv.shape[1]

    @property
    def page_size(self) -> int:
        return self.kv.shape[2]


jax.tree_util.register_dataclass(KVPages, data_fields=["kv"], meta_fields=[])


def kv_lanes(config: ModelConfig, shards: int = 1, platform: str = "cpu", kv_dtype=None) -> int:
    """The pool's minor dimension for `config` split over `shards` devices by KV head: keys and
    values of each device's heads (and, for a quantized `kv_dtype`, their scale exponents),
    padded to whole 128-lane tiles on TPU (none elsewhere)."""
    align = common.LANES if platform == "tpu" else 1
    quantized = kv_dtype is not None and common.is_quantized(kv_dtype)
    return common.kv_lanes(config.num_kv_heads, config.head_dim, shards, align, quantized)


def resolve_kv_cache_dtype(name: str, model_dtype) -> jnp.dtype:
    """The pool's dtype for EngineConfig.kv_cache_dtype `name`: the model's for "auto", int8 or
    float8_e4m3fn for "int8" / "fp8"; ValueError, in a sentence with the value, otherwise."""
    if name == "auto":
        return jnp.dtype(model_dtype)
    if name not in common.KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={name!r} is not one of {KV_CACHE_DTYPES}: 'auto' keeps the KV "
            "cache in the model's dtype, 'int8' and 'fp8' (e4m3) store it in 8 bits with scales."
        )
    return common.KV_CACHE_DTYPES[name]


def init_kv_pages(
    config: ModelConfig,
    *,
    num_pages: int,
    page_size: int,
    dtype: jnp.dtype = jnp.float32,
    sharding: jax.sharding.Sharding | None = None,
    lanes: int | None = None,
    layout: KVLayout | None = None,
) -> KVPages:
    """Allocates a zeroed pool of `num_pages` pages of `page_size` tokens for every layer slot
    of `layout` (None: uniform, one slot per layer).

    With `sharding` (split by KV head over a mesh) each device allocates only its own heads.
    `lanes` defaults to the unpadded lanes of `dtype`'s pool (ShardingPlan.pool_lanes pads it for
    the platform and split). A quantized pool's zeros read back as zeros (exponent 0).
    """
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"The KV pool needs {num_pages=} >= 1 and {page_size=} >= 1.")
    lanes = lanes or kv_lanes(config, kv_dtype=dtype)
    shape = (pool_slots(config, layout), num_pages, page_size, lanes)
    return KVPages(kv=jnp.zeros(shape, dtype, device=sharding))


def pool_slots(config: ModelConfig, layout: KVLayout | None) -> int:
    """The pool's leading axis: `layout`'s group size, else every layer."""
    return config.num_layers if layout is None else layout.group_size


def kv_bytes_per_page(
    config: ModelConfig,
    page_size: int,
    dtype: jnp.dtype,
    lanes: int | None = None,
    layout: KVLayout | None = None,
) -> int:
    """Bytes one page ID takes over its layer slots (`layout`'s group size, else all layers),
    keys and values (with the lanes' padding, when `lanes` is given): to size the pool."""
    itemsize = jnp.dtype(dtype).itemsize
    lanes = lanes or kv_lanes(config, kv_dtype=dtype)
    return pool_slots(config, layout) * page_size * lanes * itemsize


def padded_bytes(shape: Sequence[int], dtype: jnp.dtype, platform: str = "tpu") -> int:
    """Bytes an array of `shape` takes in device memory laid out row-major: on TPU its minor
    dimension in whole 128-lane tiles and its second-minor in XLA's default tile rows (1, 2, 4 or
    8, then multiples of 8; at least 2 for 16-bit types), elsewhere unpadded. For the pool's
    padding overhead (`pool_padding`); the compiled step's memory_analysis() is the measurement."""
    itemsize = jnp.dtype(dtype).itemsize
    if platform != "tpu" or not shape:
        return math.prod(shape) * itemsize
    *major, rows, cols = (1, *shape) if len(shape) == 1 else shape
    if rows >= 8:
        rows = -(-rows // 8) * 8
    else:
        rows = max(2 if itemsize < 4 else 1, 1 << (rows - 1).bit_length())
    return math.prod(major) * rows * (-(-cols // 128) * 128) * itemsize


def pool_padding(
    config: ModelConfig, lanes: int, page_size: int, dtype, platform: str, shards: int = 1
) -> float:
    """Device bytes of the pool over its keys' and values' own bytes (1.0: no padding), per
    device of a pool of `lanes` split `shards` ways."""
    real = 2 * config.num_kv_heads // shards * config.head_dim * page_size
    return padded_bytes((page_size, lanes // shards), dtype, platform) / (
        real * jnp.dtype(dtype).itemsize
    )


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
    bytes_per_page: int,
    devices: Sequence[jax.Device],
    *,
    fraction: float,
    fallback_gb: float,
    reserved_bytes: int = 0,
) -> int:
    """Pages whose per-device share (`bytes_per_page` on each device, padded) fits the free
    memory once `reserved_bytes` (the compiled step's temporaries: model_runner.step_memory)
    are set aside.

    Call it after the params are placed, so what they take is already in use. Where the platform
    reports no memory (the CPU), the budget is `fallback_gb` per device.
    """
    free = free_device_bytes(devices)
    budget = int(fallback_gb * 2**30) if free is None else int((free - reserved_bytes) * fraction)
    return max(budget // bytes_per_page, 0)
