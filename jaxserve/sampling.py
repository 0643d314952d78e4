"""Sampling on the device, per row: greedy, temperature, top-k, top-p, min-p, logprobs.

Every row carries its own parameters as arrays (never static arguments, so a new mix of requests
does not retrace), and its own PRNG key derived from (seed, position): a seeded request draws the
same token at the same position whatever else shares its batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step (row s samples for sequence s)."""

    temperature: jax.Array  # f32[S] 0 means greedy
    top_k: jax.Array  # i32[S] 0 means off
    top_p: jax.Array  # f32[S] 1 means off
    min_p: jax.Array  # f32[S] 0 means off
    seeds: jax.Array  # u32[S] the request's seed
    positions: jax.Array  # i32[S] position of the token being sampled (folded into the key)
    want_top_logprobs: jax.Array  # bool[] any row asked for top-n logprobs

    @staticmethod
    def empty(num_seqs: int) -> SamplingBatch:
        """Greedy rows with nothing asked: the padding every packer starts from."""
        return SamplingBatch(
            temperature=np.zeros(num_seqs, np.float32),
            top_k=np.zeros(num_seqs, np.int32),
            top_p=np.ones(num_seqs, np.float32),
            min_p=np.zeros(num_seqs, np.float32),
            seeds=np.zeros(num_seqs, np.uint32),
            positions=np.zeros(num_seqs, np.int32),
            want_top_logprobs=np.bool_(False),
        )


jax.tree_util.register_dataclass(
    SamplingBatch,
    data_fields=[f.name for f in dataclasses.fields(SamplingBatch)],
    meta_fields=[],
)


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """What crosses back to the host each step: small arrays, one row per sequence."""

    token_ids: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S] log-probability of the chosen token under the model
    top_ids: jax.Array  # i32[S, min(20, V)] most likely tokens (zeros unless asked)
    top_logprobs: jax.Array  # f32[S, min(20, V)]


jax.tree_util.register_dataclass(
    SampleOutput,
    data_fields=["token_ids", "logprobs", "top_ids", "top_logprobs"],
    meta_fields=[],
)


def _filter_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks logits outside each row's top-k and top-p nucleus. scaled: f32[S, V]."""
    vocab = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    ordered = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    keep = before < top_p[:, None]
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    nucleus_min = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(kth, nucleus_min)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits: jax.Array, params: SamplingBatch) -> SampleOutput:
    """Draws one token per row of logits f32[S, V] (jit-friendly, no host sync)."""
    logits = logits.astype(jnp.float32)
    num_seqs = logits.shape[0]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    greedy = params.temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, params.temperature)[:, None]
    # The sort costs more than the rest of sampling; skip it when no row filters.
    needs_sort = jnp.any(((params.top_k > 0) | (params.top_p < 1)) & ~greedy)
    scaled = jax.lax.cond(
        needs_sort,
        lambda x: _filter_top_k_top_p(x, params.top_k, params.top_p),
        lambda x: x,
        scaled,
    )
    row_max = jnp.max(scaled, axis=-1, keepdims=True)
    # min-p: drop tokens whose probability is below min_p times the most likely one's.
    scaled = jnp.where(scaled >= row_max + jnp.log(params.min_p)[:, None], scaled, -jnp.inf)

    def gumbel(seed, position):
        key = jax.random.fold_in(jax.random.key(seed), position)
        return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

    noise = jax.vmap(gumbel)(params.seeds, params.positions)
    drawn = jnp.argmax(scaled + noise, axis=-1)
    token_ids = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    chosen = jnp.take_along_axis(log_probs, token_ids[:, None], axis=-1)[:, 0]

    width = min(MAX_TOP_LOGPROBS, logits.shape[-1])

    def top_n(lp):
        values, ids = jax.lax.top_k(lp, width)
        return ids.astype(jnp.int32), values

    def no_top(lp):
        shape = (num_seqs, width)
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)

    top_ids, top_lp = jax.lax.cond(params.want_top_logprobs, top_n, no_top, log_probs)
    return SampleOutput(token_ids=token_ids, logprobs=chosen, top_ids=top_ids, top_logprobs=top_lp)
