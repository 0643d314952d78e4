"""Block sizes of the ragged paged attention kernels, one table row per device kind.

The kernels take their block sizes from here rather than from arguments the model would have to
thread through, so a new chip is a new row, not a code change. Rows are matched against
`jax.Device.device_kind` by substring, longest key first ("TPU v5 lite" before "TPU v5").

The values are starting points reasoned from the hardware (MXU or tensor-core tile sizes, VMEM and
SM counts), not yet measured: `python -m pallas_kernels.gpu_check` times the GPU kernel, and its
report is what a row should be tuned from. Per call the kernels derive the query block from the
bucket shape (`query_block_tokens`), because a decode-only bucket wants one token per sequence
while a prefill bucket wants many.
"""

from __future__ import annotations

import dataclasses
import math

import jax


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuBlockSizes:
    """Tiles of the Mosaic TPU kernel."""

    q_rows: int  # query rows (tokens * q heads per kv head) per grid step: the MXU's M dimension
    kv_tokens: int  # keys per DMA'd block; pages per block = max(1, kv_tokens // page_size)
    vmem_limit_bytes: int | None = None  # None: Mosaic's default scoped VMEM limit

    def __post_init__(self):
        if self.q_rows < 1 or self.kv_tokens < 1:
            raise ValueError(f"Block sizes must be positive: {self.q_rows=}, {self.kv_tokens=}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuBlockSizes:
    """Tiles and launch shape of the Pallas Triton kernel."""

    q_rows: int  # query rows per program (a power of 2, >= 16 for tensor-core dots)
    kv_tokens: int  # keys per loop iteration; pages per block = max(1, kv_tokens // page_size)
    num_warps: int
    num_stages: int
    num_sms: int  # streaming multiprocessors: how many programs keep the chip busy
    max_kv_splits: int  # split-K ("flash decoding") cap for small decode batches

    def __post_init__(self):
        for name in ("q_rows", "kv_tokens", "max_kv_splits"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a positive power of 2 (Triton tiles).")


# MXU: 128x128 on v4/v5e, 256x256 on v6e; VMEM 16 MiB (v4/v5e scoped default) to 32 MiB (v6e).
TPU_TABLE: dict[str, TpuBlockSizes] = {
    "TPU v4": TpuBlockSizes(q_rows=128, kv_tokens=256),
    "TPU v5 lite": TpuBlockSizes(q_rows=128, kv_tokens=256),
    "TPU v5": TpuBlockSizes(q_rows=128, kv_tokens=512),  # v5p
    "TPU v6 lite": TpuBlockSizes(q_rows=256, kv_tokens=512, vmem_limit_bytes=64 * 2**20),
    "default": TpuBlockSizes(q_rows=128, kv_tokens=256),
}

GPU_TABLE: dict[str, GpuBlockSizes] = {
    "H200": GpuBlockSizes(
        q_rows=64, kv_tokens=64, num_warps=4, num_stages=3, num_sms=132, max_kv_splits=16
    ),
    "H100": GpuBlockSizes(
        q_rows=64, kv_tokens=64, num_warps=4, num_stages=3, num_sms=132, max_kv_splits=16
    ),
    "A100": GpuBlockSizes(
        q_rows=64, kv_tokens=64, num_warps=4, num_stages=2, num_sms=108, max_kv_splits=16
    ),
    "L4": GpuBlockSizes(
        q_rows=32, kv_tokens=64, num_warps=4, num_stages=2, num_sms=58, max_kv_splits=8
    ),
    "default": GpuBlockSizes(
        q_rows=32, kv_tokens=64, num_warps=4, num_stages=2, num_sms=80, max_kv_splits=8
    ),
}


def _lookup(table: dict, device_kind: str):
    for key in sorted(table, key=len, reverse=True):
        if key != "default" and key.lower() in device_kind.lower():
            return table[key]
    return table["default"]


def _device_kind() -> str:
    return jax.devices()[0].device_kind


def tpu_block_sizes(device_kind: str | None = None) -> TpuBlockSizes:
    """The TPU row for `device_kind` (default: the first device's kind)."""
    return _lookup(TPU_TABLE, device_kind or _device_kind())


def gpu_block_sizes(device_kind: str | None = None) -> GpuBlockSizes:
    """The GPU row for `device_kind` (default: the first device's kind)."""
    return _lookup(GPU_TABLE, device_kind or _device_kind())


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def tpu_query_block_tokens(num_tokens: int, group: int, q_rows: int, sublanes: int) -> int:
    """Tokens per TPU query block: `q_rows // group`, legal as a Mosaic block of `group` rows each.

    A block's rows (tokens * group) must fill whole sublane tiles (8 rows of f32, 16 of bf16) unless
    the block is the whole array, so small buckets take one block. Decode buckets keep big blocks
    too: one grid step then streams the pages of many sequences back to back, double-buffered,
    instead of paying a step and an exposed DMA per sequence.
    """
    tokens = max(1, q_rows // group)
    if tokens >= num_tokens:
        return num_tokens
    step = sublanes // math.gcd(sublanes, group)  # tokens per whole sublane tile
    return -(-tokens // step) * step


def gpu_query_block(num_tokens: int, num_seqs: int, group: int, q_rows: int) -> tuple[int, int]:
    """(tokens, rows) of a GPU program: about one sequence's share of the bucket, in <= q_rows rows.

    Both arguments are static bucket sizes, so this never retraces. A decode-only bucket
    (num_tokens == num_seqs) gets one token per program and no rows wasted on other tokens; a
    prefill bucket fills `q_rows` rows so each key block loaded is reused by many queries. Rows are
    a power of 2 (Triton) and at least 16 (tensor-core dots); the spare ones are masked.
    """
    per_seq = next_power_of_2(-(-num_tokens // max(1, num_seqs)))
    rows = max(16, next_power_of_2(group), min(q_rows, next_power_of_2(per_seq * group)))
    return max(1, rows // group), rows
