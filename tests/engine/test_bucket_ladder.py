"""Token-bucket ladders: geometric, or geometric then additive where steps are large."""

from __future__ import annotations

import pytest

from jaxserve.model_runner import bucket_ladder, pick_bucket


def test_geometric_ladder_ends_at_the_largest_size():
    assert bucket_ladder(1, 256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert bucket_ladder(16, 100, 4) == (16, 64, 100)


def test_a_step_makes_the_ladder_additive_above_it():
    assert bucket_ladder(1, 256, 2, 64) == (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)
    assert bucket_ladder(8, 100, 2, 16) == (8, 16, 32, 48, 64, 80, 96, 100)
    # A 300-token step pads to 512 on powers of two, to 320 with a 64-token step.
    assert pick_bucket(bucket_ladder(1, 512), 300) == 512
    assert pick_bucket(bucket_ladder(1, 512, 2, 64), 300) == 320


@pytest.mark.parametrize("args", [(0, 8, 2, None), (8, 4, 2, None), (1, 8, 1, None), (1, 8, 2, 0)])
def test_bad_ladders_are_refused(args):
    with pytest.raises(ValueError, match="Invalid bucket ladder"):
        bucket_ladder(*args)
