"""Block sizes of the ragged paged attention kernels: a table of targets per chip, and for the TPU
kernel the VMEM budgeting that turns a target into blocks that fit the chip.

The kernels take their block sizes from here rather than from arguments the model would have to
thread through, so a new chip is a new row, not a code change. The TPU table is keyed by chip
generation ("v5e"); the chip is an argument (a generation name or a `jax.Device.device_kind`,
facts in `pallas_kernels.chips`), so blocks can be planned for a chip this process is not running
on (ahead-of-time compilation for a TPU topology from a CPU host). GPU rows are matched against the
device kind by substring, longest key first.

The values are starting points reasoned from the hardware (MXU or tensor-core tile sizes, VMEM and
SM counts), not yet measured: `python -m pallas_kernels.gpu_check` times the GPU kernel, and its
report is what a row should be tuned from. Per call the kernels derive the query block from the
bucket shape (`query_block_tokens`), because a decode-only bucket wants one token per sequence
while a prefill bucket wants many. On the TPU, `plan_tpu_blocks` then shrinks the KV heads, query
rows and pages per grid step until the step's VMEM (padded to TPU tiles, with the kernel's f32
temporaries) fits the chip.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels import chips
from pallas_kernels.ragged_paged_attention import common


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuBlockSizes:
    """Target tiles of the Mosaic TPU kernel; `plan_tpu_blocks` shrinks them until they fit."""

    q_rows: int  # query rows (tokens * q heads per kv head) per grid step: the MXU's M dimension
    kv_tokens: int  # keys per DMA'd block; pages per block = max(1, kv_tokens // page_size)
    vmem_limit_bytes: int | None = None  # None: the chip's limit (`tpu_vmem_limit_bytes`)

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


# MXU: 128x128 before v6e, 256x256 from v6e on; VMEM per chip in `chips.TPU_CHIPS`.
TPU_TABLE: dict[str, TpuBlockSizes] = {
    "v4": TpuBlockSizes(q_rows=128, kv_tokens=256),
    "v5e": TpuBlockSizes(q_rows=128, kv_tokens=256),
    "v5p": TpuBlockSizes(q_rows=128, kv_tokens=512),
    "v6e": TpuBlockSizes(q_rows=256, kv_tokens=512),
    "tpu7x": TpuBlockSizes(q_rows=256, kv_tokens=512),
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


# The chip planned for when none is named and the default backend is not a TPU (the kernel in
# interpret mode on the CPU): the table's smallest VMEM, so blocks planned there fit every chip.
INTERPRET_CHIP = "v4"


def resolve_tpu_chip(chip: str | None = None) -> chips.TpuChip:
    """The target TPU: `chip` (a generation or device kind) if given, else the default backend's.

    Only when no chip is named is a device consulted, and then the default backend's first device
    (a TPU whose kind is not in `chips.TPU_CHIPS` raises there); on a non-TPU backend the kernel
    can only run in interpret mode, and blocks are planned for `INTERPRET_CHIP`.
    """
    if chip is not None:
        return chips.tpu_chip(chip)
    if jax.default_backend() == "tpu":
        return chips.tpu_chip(chips.default_device_kind())
    return chips.tpu_chip(INTERPRET_CHIP)


def tpu_block_sizes(chip: str | None = None) -> TpuBlockSizes:
    """The target TPU tiles for `chip` (see `resolve_tpu_chip` for the default)."""
    return TPU_TABLE[resolve_tpu_chip(chip).name]


def tpu_vmem_limit_bytes(chip: chips.TpuChip) -> int:
    """The scoped VMEM limit the kernel asks Mosaic for on `chip`.

    Three quarters of the TensorCore's VMEM, and never below the compiler's default limit (v4
    has 16 MiB of VMEM and a 16 MiB default, so it cannot be raised there). The quarter left is
    for what Mosaic and XLA place beside the kernel; asking for all of it buys nothing, since a
    step's blocks are sized by the table, not by the limit.
    """
    return max(chip.default_scoped_vmem_bytes, chip.vmem_bytes * 3 // 4)


# Of the scoped limit, the share the estimate below may fill: the estimate models the kernel's
# temporaries from measurements (see `tpu_vmem_bytes`), and Mosaic's exact allocation varies.
_BUDGET_FRACTION = 0.9


def sublane_tile(dtype) -> int:
    """Rows of one full VMEM tile of `dtype`: 8 of 32-bit values, 16 of bf16, 32 of 8-bit."""
    return 8 * 4 // jnp.dtype(dtype).itemsize


def _padded_rows(rows: int, dtype) -> int:
    """`rows` rounded up as Mosaic tiles a second-to-last dimension of `dtype`.

    A dimension of at least a full tile pads to whole tiles (8 rows of 32-bit, 16 of bf16); a
    smaller one gets a smaller power-of-two tile, at least one packed row (1 of 32-bit, 2 of bf16),
    so 2 bf16 KV heads take 2 rows, not 16 (measured: the compiler's scoped VMEM for such buffers).
    """
    full = sublane_tile(dtype)
    if rows >= full:
        return -(-rows // full) * full
    tile = 4 // jnp.dtype(dtype).itemsize or 1
    while tile < rows:
        tile *= 2
    return tile


def padded_bytes(shape: tuple[int, ...], dtype) -> int:
    """Bytes of an array of `shape` in VMEM, padded to TPU tiles: the last dim to 128 lanes, the
    one before it to sublane tiles (`_padded_rows`)."""
    *lead, rows, cols = (1, *shape) if len(shape) == 1 else shape
    cols = -(-cols // 128) * 128
    return math.prod(lead) * _padded_rows(rows, dtype) * cols * jnp.dtype(dtype).itemsize


# Chips whose Mosaic lowering keeps more of the kernel's temporaries in VMEM (measured).
_TEMPS_FACTOR = {"v4": 2}


def tpu_vmem_bytes(
    *,
    rows: int,
    heads: int,
    pages_per_block: int,
    page_size: int,
    head_dim: int,
    q_dtype,
    kv_dtype,
    chip: str,
    lanes: int | None = None,
) -> int:
    """VMEM one grid step of the TPU kernel needs on `chip` (a generation), padded to TPU tiles:
    an upper bound.

    `rows` query rows of `heads` KV heads; `pages_per_block` pages per key block; `lanes` the
    lanes of a page the step copies (default 2 * heads * head_dim: its heads' keys and values;
    the pool's padded minor dim when the step takes every head). Counts
    - the q and out blocks, double-buffered by the Pallas pipeline;
    - two page buffers ([pages, page_size, lanes]: page_size padded to sublane tiles) and the
      heads-first copy of the current key block ([heads, keys, 2 * head_dim]);
    - the f32 accumulator, running max and running sum (a [rows, 1] column pads to 128 lanes);
    - the kernel's temporaries, which Mosaic places in VMEM: the heads-first copies of the key
      block, the f32 scores, probabilities and masks ([rows, block_kv]) and PV products
      ([rows, D]) of one head (the heads are walked in a loop, so once). Their multiples are upper
      bounds fitted to the scoped VMEM the compiler reports (tests/kernels/test_tpu_aot.py checks
      the bound on every chip it compiles for). For v4 the compiler keeps up to 1.5 times as much
      as for v5e and later (measured), so there they count double.
    """
    block_kv = pages_per_block * page_size
    quantized = common.is_quantized(kv_dtype)
    lanes = lanes or common.kv_lanes(heads, head_dim, quantized=quantized)
    q_out = 2 * 2 * padded_bytes((heads, rows, head_dim), q_dtype)
    pages = 2 * padded_bytes((pages_per_block, page_size, lanes), kv_dtype)
    # 8-bit pages are dequantized into the heads-first copy, in q's dtype.
    heads_first = padded_bytes((heads, block_kv, 2 * head_dim), q_dtype if quantized else kv_dtype)
    acc = padded_bytes((heads, rows, head_dim), jnp.float32)
    stats = 2 * padded_bytes((heads, rows, 1), jnp.float32)
    # Under 8 heads the heads-first copies' vector temporaries take more than their bytes: twice
    # the allowance.
    copies = 3 * heads_first // 2 * (2 if heads < 8 else 1)
    temps = (
        copies
        + 6 * padded_bytes((rows, block_kv), jnp.float32)
        + 2 * padded_bytes((rows, head_dim), jnp.float32)
    )
    if quantized:  # the exponent tile, a head's f32 rows and their scale factor, in float32
        temps += padded_bytes((block_kv, 128), jnp.float32) + 3 * padded_bytes(
            (block_kv, 2 * head_dim), jnp.float32
        )
    temps *= _TEMPS_FACTOR.get(chip, 1)
    return q_out + pages + heads_first + acc + stats + temps


@dataclasses.dataclass(frozen=True)
class TpuBlockPlan:
    """The blocks of one call of the TPU kernel, for one chip and one bucket shape."""

    chip: str  # the generation planned for
    block_tokens: int  # query tokens per grid step
    rows: int  # block_tokens * group: query rows per KV head per grid step
    heads_per_block: int  # KV heads per grid step (divides num_kv_heads)
    pages_per_block: int  # pages per DMA'd key block
    vmem_limit_bytes: int  # the scoped VMEM limit asked of Mosaic
    vmem_bytes: int  # `tpu_vmem_bytes` of these blocks: at most the budget


def _head_choices(num_kv_heads: int) -> list[int]:
    """KV heads per grid step, largest first: all of them, or a divisor that is a multiple of 8.

    A grid step DMAs its heads' lanes of each page, at a traced lane offset that Mosaic must
    prove aligned to whole 128-lane tiles: 8 heads of keys and values (16 * head_dim lanes) are
    for every head_dim from 8 up.
    """
    return [
        h
        for h in range(num_kv_heads, 0, -1)
        if num_kv_heads % h == 0 and (h == num_kv_heads or h % 8 == 0)
    ]


def plan_tpu_blocks(
    *,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    q_dtype,
    kv_dtype,
    lanes: int | None = None,
    chip: str | None = None,
    block_sizes: TpuBlockSizes | None = None,
) -> TpuBlockPlan:
    """Blocks of the TPU kernel for this bucket on `chip` that fit its VMEM.

    Starts from `block_sizes` (default: the chip's `TPU_TABLE` row) and, while a grid step's VMEM
    (`tpu_vmem_bytes`) exceeds the budget, shrinks first the KV heads per step (that costs only
    more grid steps), then whichever of the query rows and the pages per key block holds more
    VMEM, halving each down to one sublane tile of rows and one page. Raises ValueError when even
    the smallest blocks do not fit. `lanes` is the pool's minor dimension (padding included;
    default: 2 * num_kv_heads * head_dim).
    """
    target = resolve_tpu_chip(chip)
    sizes = block_sizes or TPU_TABLE[target.name]
    limit = sizes.vmem_limit_bytes or tpu_vmem_limit_bytes(target)
    if limit > target.vmem_bytes:
        raise ValueError(
            f"vmem_limit_bytes={limit} exceeds the {target.vmem_bytes} bytes of VMEM of a "
            f"{target.name} TensorCore."
        )
    budget = int(limit * _BUDGET_FRACTION)
    group = num_heads // num_kv_heads
    sublanes = sublane_tile(q_dtype)
    head_choices = _head_choices(num_kv_heads)
    if common.is_quantized(kv_dtype):
        # A quantized page's scale lanes end the row (common.fuse_kv): a step takes every head,
        # so that one DMA of the whole page brings its heads' exponents with them.
        head_choices = [num_kv_heads]
    q_rows = sizes.q_rows
    heads = head_choices[0]
    pages = max(1, min(sizes.kv_tokens // page_size, pages_per_seq))

    def size(q_rows: int, heads: int, pages: int) -> tuple[int, int]:
        tokens = tpu_query_block_tokens(num_tokens, group, q_rows, sublanes)
        rows = tokens * group
        vmem = tpu_vmem_bytes(
            rows=rows,
            heads=heads,
            pages_per_block=pages,
            page_size=page_size,
            head_dim=head_dim,
            q_dtype=q_dtype,
            kv_dtype=kv_dtype,
            chip=target.name,
            lanes=lanes if heads == num_kv_heads else None,
        )
        return tokens, vmem

    tokens, vmem = size(q_rows, heads, pages)
    while vmem > budget:
        can_halve_rows = tpu_query_block_tokens(num_tokens, group, q_rows // 2, sublanes) < tokens
        if heads != head_choices[-1]:
            heads = head_choices[head_choices.index(heads) + 1]
        elif can_halve_rows and pages > 1:
            # Halve whichever frees more: the row blocks or the page buffers.
            if size(q_rows // 2, heads, pages)[1] <= size(q_rows, heads, pages // 2)[1]:
                q_rows //= 2
            else:
                pages //= 2
        elif can_halve_rows:
            q_rows //= 2
        elif pages > 1:
            pages //= 2
        else:
            raise ValueError(
                f"No blocks of the TPU ragged paged attention kernel fit the {limit / 2**20:.1f} "
                f"MiB scoped VMEM limit of a {target.name}: even {tokens} query token(s), {heads} "
                f"KV head(s) and one page per grid step need {vmem / 2**20:.1f} MiB (budget "
                f"{budget / 2**20:.1f} MiB) for q [{num_tokens}, {num_heads}, {head_dim}] "
                f"{jnp.dtype(q_dtype).name} over pages of {page_size} tokens x {num_kv_heads} KV "
                f"heads of {jnp.dtype(kv_dtype).name}."
            )
        tokens, vmem = size(q_rows, heads, pages)
    return TpuBlockPlan(
        chip=target.name,
        block_tokens=tokens,
        rows=tokens * group,
        heads_per_block=heads,
        pages_per_block=pages,
        vmem_limit_bytes=limit,
        vmem_bytes=vmem,
    )


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
