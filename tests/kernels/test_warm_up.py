"""The warm-up batches: they must reach the xla attention's decode loop and prefill tiles (the
branches an all-padding batch skips) and must not change a single KV slot."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from checkpoints import load_model, model_for
from jaxserve.models.attention import warm_up_batches
from jaxserve.models.kv_pool import KVPages, kv_lanes
from pallas_kernels.ragged_paged_attention import xla_blocked

NUM_PAGES = 6


@pytest.mark.parametrize(
    "num_tokens, num_seqs, page_size, pages_per_seq",
    [
        (1, 1, 16, 4),  # the decode-only bucket
        (2, 2, 16, 4),  # too small for both rows at once
        (3, 1, 16, 4),  # one sequence row: a batch per row
        (16, 16, 16, 4),
        (128, 64, 16, 2),  # a bucket longer than a sequence may be: the prefill is capped
        (8, 4, 1, 16),  # pages of one token: a chunk spans many pages
    ],
)
def test_batches_reach_the_decode_loop_and_the_prefill_tiles(
    num_tokens, num_seqs, page_size, pages_per_seq
):
    batches = warm_up_batches(
        num_tokens,
        num_seqs,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        num_pages=NUM_PAGES,
    )
    plans = []
    for batch in batches:
        assert batch.token_ids.shape == (num_tokens,) and batch.kv_lens.shape == (num_seqs,)
        assert (batch.slot_mapping >= NUM_PAGES * page_size).all(), "a warm-up write would land"
        plans.append(
            xla_blocked.plan_step(num_tokens, batch.query_start, batch.kv_lens, batch.num_seqs)
        )
    assert any(int(p.decode_kv_max) > 0 for p in plans), "no batch runs the decode loop"
    tiles = [int(p.num_tiles) for p in plans]
    assert (max(tiles) > 0) == (num_tokens > 1), f"prefill tiles per batch: {tiles}"


def test_batches_leave_every_kv_slot_as_it_was():
    model = load_model("llama-tiny", layer_loop="scan")  # the CPU's "auto" would unroll it
    module = model_for(model.config, model.dtype, "xla", layer_loop="scan")
    c = model.config
    shape = (c.num_layers, NUM_PAGES, 4, kv_lanes(c))
    rng = np.random.default_rng(0)
    kv = KVPages(kv=rng.standard_normal(shape).astype(np.float32))
    step = jax.jit(lambda kv, batch: module.apply({"params": model.params}, kv, batch))
    for batch in warm_up_batches(8, 4, page_size=4, pages_per_seq=3, num_pages=NUM_PAGES):
        hidden, new_kv = step(kv, batch)
        assert np.isfinite(np.asarray(hidden)).all()
        np.testing.assert_array_equal(np.asarray(new_kv.kv), kv.kv)
