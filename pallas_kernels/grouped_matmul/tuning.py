"""The megablox kernel's tiles per TPU generation, and the rule that fits them to a shape.

megablox's `gmm` takes a tile (tm, tk, tn) and sets no VMEM limit of its own, so every tile
must fit the chip's default scoped VMEM (`chips.TpuChip.default_scoped_vmem_bytes`: 16 MiB on
v4/v5e/v5p, 32 MiB on v6e/TPU7x). One grid step holds an lhs tile [tm, tk], an rhs tile
[tk, tn] and the output tile [tm, tn], each double-buffered, a [tm, tn] f32 accumulator and
Mosaic's temporaries (`vmem_bytes`).

The rows come from the roofline, not from timings on a chip (none was at hand):
- tm: each visit of an m tile reads its group's whole [K, N] weights, so a tile's arithmetic
  intensity is about tm FLOP per weight byte. v5e's ridge is 197e12 / 819e9 = 240 FLOP/B, so
  256 rows; v6e's 918e12 / 1638e9 = 560, so 512. But a tile that straddles a group boundary is
  visited once per group and computes all its rows each time: where the groups are smaller than
  the tile, a big tile buys no weight reuse and wastes MXU work. So tm follows the rows per group
  (M / G, rounded up to a power of two), from 128 up to the row's tm: Qwen3-30B-A3B (128
  experts, 8 per token) gets 128 up to 2048 tokens a step, the row's tm at 8192.
- tk, tn: an rhs tile of 1024 x 1024 bf16 (2 MiB) takes ~2.6 us to arrive on v5e against the
  ~0.35 us a grid step costs; v6e's bandwidth twice that wants twice the tile. Each is cut to a
  divisor of the dimension that is a multiple of 128 lanes (or the whole dimension), then
  shrunk, tn first, until the step fits `BUDGET_FRACTION` of the scoped VMEM.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import chips

LANES = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class GmmTiles:
    """The largest tile megablox may take on a chip; `megablox_tiling` fits it to a shape."""

    tm: int  # rows of lhs / out per grid step (the most; fewer where groups are small)
    tk: int  # the contracted dimension per grid step
    tn: int  # columns of rhs / out per grid step

    def __post_init__(self):
        if self.tm % 16 or self.tk % LANES or self.tn % LANES:
            raise ValueError(
                f"GmmTiles(tm={self.tm}, tk={self.tk}, tn={self.tn}) must have tm a multiple of "
                f"16 rows and tk, tn multiples of {LANES} lanes."
            )


TPU_TABLE: dict[str, GmmTiles] = {
    "v5e": GmmTiles(tm=256, tk=1024, tn=1024),
    "v6e": GmmTiles(tm=512, tk=2048, tn=2048),
    # v4 and v5p (128-wide MXUs, 16 MiB scoped VMEM) and unnamed chips: v5e's row, which fits
    # every generation's default limit.
    "default": GmmTiles(tm=256, tk=1024, tn=1024),
}

# Of the default scoped VMEM, the share the estimate may fill: the estimate counts Mosaic's
# temporaries as measured (vmem_bytes); the rest is margin for shapes not measured.
BUDGET_FRACTION = 0.9


def tpu_chip_name(chip: str | None) -> str:
    """The TPU_TABLE row for `chip` (a generation "v6e" or a device kind "TPU v6 lite")."""
    if chip is None:
        return "default"
    name = chips.tpu_chip(chip).name
    return name if name in TPU_TABLE else "default"


def sublane_rows(dtype) -> int:
    """Rows of one VMEM tile of `dtype`: 8 of 32-bit values, 16 of bf16."""
    return 8 * 4 // jnp.dtype(dtype).itemsize


def vmem_bytes(tiling: tuple[int, int, int], lhs_dtype, rhs_dtype, out_dtype) -> int:
    """The scoped VMEM one grid step of megablox's gmm needs at `tiling` (tm, tk, tn): lhs, rhs
    and output tiles double-buffered, the f32 accumulator, and Mosaic's temporaries.

    The temporaries (the product before it is added to the accumulator, the store's row mask)
    are counted as one more f32 [tm, tn]: compiled for v5e and v6e (libtpu 0.0.50) at
    Qwen3-30B-A3B's shapes, the compiler allocated at most 3.3 x tm x tn bytes more than the
    buffers alone, at tiles of (128-256, 1024, 768); at most tiles it allocated less.
    """
    tm, tk, tn = tiling
    item = lambda dtype: jnp.dtype(dtype).itemsize  # noqa: E731
    return (
        2 * tm * tk * item(lhs_dtype)
        + 2 * tk * tn * item(rhs_dtype)
        + 2 * tm * tn * item(out_dtype)
        + 2 * tm * tn * 4
    )


def vmem_budget_bytes(chip: str | None) -> int:
    """What `vmem_bytes` may reach on `chip` (None: the smallest default limit, 16 MiB)."""
    limit = min(c.default_scoped_vmem_bytes for c in chips.TPU_CHIPS.values())
    if chip is not None:
        limit = chips.tpu_chip(chip).default_scoped_vmem_bytes
    return int(limit * BUDGET_FRACTION)


def _lane_divisors(dim: int, most: int) -> list[int]:
    """Tile sizes for a dimension of `dim`, largest first, none above `most`: the whole dimension
    where it fits, then the multiples of 128 that divide it; if none does, `most` (megablox masks
    the ragged last tile)."""
    sizes = [dim] if dim <= most else []
    sizes += [t for t in range(min(most, dim - 1) // LANES * LANES, 0, -LANES) if dim % t == 0]
    return sizes or [most]


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def megablox_tiling(
    m: int,
    k: int,
    n: int,
    num_groups: int,
    *,
    lhs_dtype,
    rhs_dtype,
    out_dtype,
    chip: str | None = None,
) -> tuple[int, int, int]:
    """(tm, tk, tn) for megablox's gmm of lhs [m, k] by rhs [*, k, n] over `num_groups` groups
    (all of them, G, not this device's) on `chip` (None: the "default" row and 16 MiB).

    tm is a multiple of the lhs dtype's sublane tile; m is padded to a multiple of it by the
    caller. Raises ValueError when not even the smallest tile fits the chip's VMEM.
    """
    row = TPU_TABLE[tpu_chip_name(chip)]
    align = max(sublane_rows(lhs_dtype), sublane_rows(out_dtype))
    rows_per_group = _power_of_two_at_least(-(-m // max(1, num_groups)))
    tm = min(row.tm, max(LANES, rows_per_group))
    tm = min(tm, -(-m // align) * align)  # a small M is one tile of M rows, padded to a tile
    budget = vmem_budget_bytes(chip)
    dtypes = (lhs_dtype, rhs_dtype, out_dtype)
    tks, tns = _lane_divisors(k, row.tk), _lane_divisors(n, row.tn)
    # Shrink tn first: a narrower output tile rereads lhs, a shorter k tile adds grid steps that
    # each store nothing.
    for tk in tks:
        for tn in tns:
            if vmem_bytes((tm, tk, tn), *dtypes) <= budget:
                return tm, tk, tn
    raise ValueError(
        f"No megablox tile fits {budget} bytes of VMEM on {chip or 'the default chip'} for "
        f"lhs [{m}, {k}] {jnp.dtype(lhs_dtype).name} by rhs [{k}, {n}] "
        f"{jnp.dtype(rhs_dtype).name}: even ({tm}, {tks[-1]}, {tns[-1]}) needs "
        f"{vmem_bytes((tm, tks[-1], tns[-1]), *dtypes)} bytes."
    )
