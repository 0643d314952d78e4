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


def _bisect_threshold(values: jax.Array, low: jax.Array, high: jax.Array, enough) -> jax.Array:
    """Largest t in [low, high] (per row) with enough(values >= t) true, by 32 bisections.

    enough(keep) must hold at t = low and be monotone in t. Thirty-two halvings pin t to float32
    resolution, so the kept set is exact up to ties; a full vocab sort costs ~15x more on the CPU.
    """

    def body(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        ok = enough(values >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, body, (low, high))
    return lo


def _filter_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks logits outside each row's top-k and then its top-p nucleus. scaled: f32[S, V]."""
    vocab = scaled.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    row_min, row_max = jnp.min(scaled, axis=-1), jnp.max(scaled, axis=-1)
    kth = _bisect_threshold(scaled, row_min, row_max, lambda keep: jnp.sum(keep, axis=-1) >= k)
    scaled = jnp.where(scaled >= kth[:, None], scaled, -jnp.inf)
    probs = jax.nn.softmax(scaled, axis=-1)
    # The nucleus: the most likely tokens whose mass first reaches top_p.
    nucleus = _bisect_threshold(
        probs,
        jnp.zeros_like(row_max),
        jnp.max(probs, axis=-1),
        lambda keep: jnp.sum(jnp.where(keep, probs, 0.0), axis=-1) >= top_p,
    )
    return jnp.where(probs >= nucleus[:, None], scaled, -jnp.inf)


def sample(logits: jax.Array, params: SamplingBatch) -> SampleOutput:
    """Draws one token per row of logits f32[S, V] (jit-friendly, no host sync)."""
    logits = logits.astype(jnp.float32)
    num_seqs = logits.shape[0]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    greedy = params.temperature <= 0
    # top_k(., 1) rather than argmax: the same first-index tie break, several times faster on CPU.
    best = jax.lax.top_k(logits, 1)[1][:, 0]
    token_ids = jax.lax.cond(
        jnp.all(greedy),
        lambda: best,
        lambda: jnp.where(greedy, best, _draw(logits, params)),
    ).astype(jnp.int32)
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


def _draw(logits: jax.Array, params: SamplingBatch) -> jax.Array:
    """A random token per row from the filtered, tempered distribution (inverse CDF)."""
    scaled = logits / jnp.maximum(params.temperature, 1e-6)[:, None]
    needs_filter = jnp.any((params.top_k > 0) | (params.top_p < 1))
    scaled = jax.lax.cond(
        needs_filter,
        lambda x: _filter_top_k_top_p(x, params.top_k, params.top_p),
        lambda x: x,
        scaled,
    )
    row_max = jnp.max(scaled, axis=-1, keepdims=True)
    # min-p: drop tokens whose probability is below min_p times the most likely one's.
    scaled = jnp.where(scaled >= row_max + jnp.log(params.min_p)[:, None], scaled, -jnp.inf)
    cdf = jnp.cumsum(jnp.exp(scaled - row_max), axis=-1)

    def uniform(seed, position):
        # One draw per row, keyed by (seed, position): independent of the batch around it.
        return jax.random.uniform(jax.random.fold_in(jax.random.key(seed), position))

    u = jax.vmap(uniform)(params.seeds, params.positions) * cdf[:, -1]
    # The first token whose cumulative mass exceeds u; zero-mass tokens can never be it.
    return jnp.minimum(jnp.sum(cdf <= u[:, None], axis=-1), logits.shape[-1] - 1)
