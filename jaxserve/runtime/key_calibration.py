"""Calibrates an 8-bit KV pool's key transform (models/kv_keys.py) on the model being served.

At start-up, before the pool exists: one teacher-forced pass of a short calibration text (the
model's tokenizer on CALIBRATION_TEXT, or seeded random ids for a model without one) over a
float pool with the reference attention, and the keys it wrote, read back per layer, give each
(layer, KV head, channel) its mean and spread. The text is neither a prompt nor a benchmark's
text; any keys would give an exact transform, these give a small quantization error.

One compile of one prefill, in the model's dtype on the serving mesh; the result is host data
(identical on every host of a multi-host mesh, which run the same program on the same weights).
"""

from __future__ import annotations

import functools
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.kv_keys import KeyTransform
from jaxserve.models.kv_pool import KVPages, kv_lanes
from jaxserve.models.loaded import LoadedModel, layer_loop_of, model_for
from jaxserve.models.step_batch import SeqChunk, pack_chunks
from pallas_kernels.ragged_paged_attention import common

logger = logging.getLogger(__name__)

# Plain prose of several kinds (narrative, dialogue, numbers, instructions): what a model's keys
# look like on ordinary text. Not the text docs/history/quant_accuracy.py scores.
CALIBRATION_TEXT = (
    "The old lighthouse stood at the edge of the harbour, and every evening the keeper climbed "
    'its ninety-two steps to light the lamp. "Will the boats come home tonight?" asked his '
    "granddaughter. He smiled and pointed at the sea. In 1887 a storm broke the glass, and the "
    "town paid 40 pounds to mend it. To make bread, mix flour, water, salt and yeast; knead the "
    "dough for ten minutes, let it rise for an hour, then bake it until the crust is brown. The "
    "committee met on Tuesday to discuss the budget, the new library and the bus timetable. "
    "Scientists measured the temperature of the lake every day for a year and found that it "
    "was warmest in August. She wrote a letter to her brother, folded it twice and walked to "
    "the post office before it closed."
)
CALIBRATION_TOKENS = 256  # at most; fewer where max_model_len is shorter
PAGE = 16


def calibration_ids(model: LoadedModel, max_len: int, seed: int = 0) -> list[int]:
    """The token ids the keys are calibrated on: the tokenizer's ids of CALIBRATION_TEXT (with
    its BOS) repeated up to min(CALIBRATION_TOKENS, max_len), else seeded random ids."""
    n = max(2, min(CALIBRATION_TOKENS, max_len))
    if model.tokenizer is not None:
        ids = list(model.tokenizer(CALIBRATION_TEXT)["input_ids"])
        return (ids * math.ceil(n / len(ids)))[:n]
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, model.config.vocab_size, n)]


def calibration_keys(model: LoadedModel, ids: list[int], replicated=None) -> np.ndarray:
    """f32[L, T, Hkv, D]: the keys (after RoPE) each layer writes for `ids`, from one pass of
    the model over a float pool with the reference attention (on the params' own devices;
    `replicated`, a sharding over all of them, makes every host hold the whole result)."""
    c = model.config
    module = model_for(
        c, model.dtype, "reference", layer_loop=layer_loop_of(model.params), quant=model.quant
    )
    pages = math.ceil(len(ids) / PAGE)
    batch = pack_chunks(
        [SeqChunk(list(ids), 0, list(range(pages)))],
        page_size=PAGE,
        num_tokens=len(ids),
        num_seqs=1,
        pages_per_seq=pages,
        num_pages=pages,
    )
    shape = (c.num_layers, pages, PAGE, kv_lanes(c))

    @functools.partial(jax.jit, out_shardings=replicated)
    def keys_of(params):
        _, kv = module.apply({"params": params}, KVPages(kv=jnp.zeros(shape, model.dtype)), batch)
        k, _ = common.split_kv(kv.kv, c.num_kv_heads, c.head_dim, jnp.float32)
        return k.reshape(c.num_layers, pages * PAGE, c.num_kv_heads, c.head_dim)[:, : len(ids)]

    keys = keys_of(model.params)
    if jax.process_count() > 1:  # replicated: this host's copy is the whole of it
        keys = keys.addressable_data(0)
    return np.asarray(jax.device_get(keys), np.float32)


def calibrate_key_transform(
    model: LoadedModel, kv_dtype, max_len: int, replicated=None
) -> KeyTransform:
    """The key transform of `model` for a pool of `kv_dtype` (models/kv_keys.py), calibrated
    on `calibration_ids` (at most `max_len` tokens); `replicated` as `calibration_keys` takes
    it (ShardingPlan.replicated on a mesh). Logs how long it took."""
    start = time.perf_counter()
    ids = calibration_ids(model, max_len)
    keys = calibration_keys(model, ids, replicated)
    capped = model.config.attn_logit_softcap is not None
    transform = KeyTransform.from_keys(keys, kv_dtype, soft_capped=capped)
    logger.info(
        "%s KV pool: keys %s%s over %d calibration tokens (%.1f s).",
        jnp.dtype(kv_dtype).name,
        "smoothed" if capped else "centred and smoothed",
        ", rotated" if transform.rotate else "",
        len(ids),
        time.perf_counter() - start,
    )
    return transform
