"""Bucket ladders: the step shapes the runner compiles, in plain Python.

Kept apart from model_runner (which imports JAX) so the scheduler's config, the simulator and the
tuner build the very same ladders without a device.
"""

from __future__ import annotations

from collections.abc import Sequence


def bucket_ladder(
    smallest: int, largest: int, factor: int = 2, step: int | None = None
) -> tuple[int, ...]:
    """smallest, smallest*factor, ... capped by (and always ending at) largest.

    With `step`, a size never grows by more than `step`: 1, 2, 4, ..., 64, 128, 192, 256, ... for
    step 64. Geometric sizes pad a step by up to half of it (a 300-token step runs as 512); the
    additive tail pads large steps by less than `step`, at the price of more buckets to compile:
    about largest / step sizes above `step` instead of log2(largest / step).
    """
    if smallest < 1 or largest < smallest or factor < 2 or (step is not None and step < 1):
        raise ValueError(f"Invalid bucket ladder: {smallest=}, {largest=}, {factor=}, {step=}.")
    sizes, size = [], smallest
    while size < largest:
        sizes.append(size)
        size = size * factor if step is None else min(size * factor, size + step)
    sizes.append(largest)
    return tuple(sizes)


def pick_bucket(ladder: Sequence[int], n: int) -> int:
    """The smallest bucket that holds n."""
    for size in ladder:
        if size >= n:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {ladder[-1]}.")
