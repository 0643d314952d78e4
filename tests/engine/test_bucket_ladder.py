"""Token-bucket ladders: geometric, or geometric then additive where steps are large."""

from __future__ import annotations

import pytest

from jaxserve.models.step_batch import SeqChunk, pack_chunks
from jaxserve.runtime.model_runner import ModelRunner, bucket_ladder, pick_bucket


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


def test_one_compiled_shape_per_token_bucket_holds_every_packable_step():
    from jaxserve.runtime.model_runner import RunnerConfig

    config = RunnerConfig(
        num_pages=64,
        page_size=4,
        max_model_len=64,
        token_buckets=bucket_ladder(1, 64),
        seq_buckets=bucket_ladder(1, 8),
    )
    shapes = config.buckets()
    assert shapes == [(1, 1), (2, 2), (4, 4), (8, 8), (16, 8), (32, 8), (64, 8)]
    runner = object.__new__(ModelRunner)  # pack reads only the config: no model needed
    runner.config = config
    for num_seqs in range(1, 9):
        for tokens_each in (1, 2, 7):
            chunks = [
                SeqChunk(token_ids=[5] * tokens_each, start_pos=0, page_table=[2 * s, 2 * s + 1])
                for s in range(num_seqs)
            ]
            total = num_seqs * tokens_each
            if total > 64:
                continue
            tokens = pick_bucket(config.token_buckets, total)
            batch = pack_chunks(
                chunks,
                page_size=runner.config.page_size,
                num_tokens=tokens,
                num_seqs=runner.config.seq_bucket_for(tokens),
                pages_per_seq=runner.config.pages_per_seq,
                num_pages=runner.config.num_pages,
            )
            shape = (batch.token_ids.shape[0], batch.kv_lens.shape[0])
            assert shape in shapes, (num_seqs, tokens_each, shape)
            assert shape[0] == pick_bucket(config.token_buckets, total)
