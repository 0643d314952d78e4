"""Sampling on the device, per row: greedy, temperature, top-k, top-p, min-p, logit bias,
min-tokens, logprobs.

Every row carries its own parameters as arrays (never static arguments, so a new mix of requests
does not retrace), and its own PRNG key derived from (seed, position): a seeded request draws the
same token at the same position whatever else shares its batch.

The cost follows what the batch asks for, because sampling runs every step beside a forward pass
that may take only a few milliseconds:

- all rows greedy and no logprobs asked: one argmax, nothing else (`lax.cond` on the batch);
- top-k / top-p / min-p rows: filtered among the NUM_CANDIDATES most likely tokens of
  `lax.top_k`, an exact answer whenever the row's kept set provably lies among them (top-k <=
  NUM_CANDIDATES, a nucleus whose mass the candidates reach, a min-p cut above the last candidate);
- rows whose kept set may reach past the candidates (plain temperature sampling, a nucleus wider
  than the candidates, top-k > NUM_CANDIDATES) draw from the whole vocabulary; only when such a row
  also filters does the batch pay the full-vocabulary bisection (`full_vocab_threshold`), which is
  exact but costs ~60 passes over the logits. The fallback is taken rather than truncating the
  nucleus to the candidates because truncation would silently change the distribution a user asked
  for, and flat distributions (high temperature, top_p near 1) are exactly where it would.

Within a step every row computes the same arrays (branch-free per row); the `lax.cond`s choose
per batch which work any row needs at all.

Prompt logprobs (`prompt_logprobs`) are the one part that reads every token of the step, not one
row per sequence: the LM head over all T tokens, a log-softmax, the next prompt token's logprob
and the top 20, all under one `lax.cond` on the batch, so a step where no row asks pays nothing.
They are of the raw model (no bias, penalty or temperature), as vLLM and OpenAI report them.

A sampled token's logprobs are of the logits after the mask, bias and penalties, before the
temperature and filters (`logprobs_mode="raw"`, OpenAI's meaning), or, for a row that asks for
`"processed"` (vLLM's processed_logprobs), of the distribution the token is drawn from: tempered,
with the filtered tokens at -inf (`processed_logits`).

Logit bias and min-tokens are one mechanism: each row has BIAS_SLOTS (token id, value) pairs
added to its logits before anything else (a scatter of S x BIAS_SLOTS values, nothing per
vocabulary entry). A request's `logit_bias` fills them; a request short of `min_tokens` also
gets -inf on its EOS and stop ids. Unused slots add 0 to token 0.

Penalties (vLLM's and OpenAI's meanings), after the bias and before the temperature, for a row
whose generated tokens so far hold token t c[t] times and whose prompt holds it or not:

    seen[t]  = c[t] > 0 or t in the prompt
    logit[t] = logit[t] / r  if seen[t] and logit[t] > 0        (repetition_penalty r, 1: off)
               logit[t] * r  if seen[t] and logit[t] <= 0
    logit[t] -= f * c[t] + p * (c[t] > 0)                     (frequency f, presence p, 0: off)

The counts live on the device (`PenaltyState`, one row per batch slot), so the host never ships
a [S, vocab] array: a request's row is filled once when it takes a slot (`init_penalty_row`,
from its prompt and any outputs it had before a preemption), and each step adds the token it
samples (`sample_step`, inside the jitted step). Rows without penalties never read it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

MAX_TOP_LOGPROBS = 20
# Top-k exact up to this k, nuclei exact while they fit in this many tokens. 128 rather than 64:
# lax.top_k costs about the same on the CPU (~an argmax either way) and wide nuclei are common.
NUM_CANDIDATES = 128
# Tokens per block of the two-level inverse CDF over the vocabulary (when no smaller power of two
# divides it): a cumsum over the whole vocabulary costs ~10x a pass over it on XLA:CPU, one over
# the block sums and one inside a block do not.
_CDF_BLOCK = 256
# Per-row (token, bias) slots: a request's logit_bias (at most 32) and, under min_tokens, its
# EOS and stop ids (at most 16 + the model's EOS ids).
BIAS_SLOTS = 64


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
    want_logprobs: jax.Array  # bool[] any row asked for its chosen token's logprob
    bias_ids: jax.Array = None  # i32[S, BIAS_SLOTS] tokens whose logits get bias_values added
    bias_values: jax.Array = None  # f32[S, BIAS_SLOTS] 0 in unused slots; -inf masks a token
    # Penalties (see the module docstring); rows without any read no counts.
    presence_penalty: jax.Array = None  # f32[S] 0 means off
    frequency_penalty: jax.Array = None  # f32[S] 0 means off
    repetition_penalty: jax.Array = None  # f32[S] 1 means off
    slots: jax.Array = None  # i32[S] the row's PenaltyState row (its batch slot)
    count_sampled: jax.Array = None  # bool[S] add the sampled token to the row's counts
    # Prompt logprobs: whether any row asked (else the whole computation is skipped), and per
    # row the prompt token after its chunk's last token (-1: none, the chunk ends the prompt).
    want_prompt_logprobs: jax.Array = None  # bool[]
    next_prompt_token: jax.Array = None  # i32[S]
    # Some row is constrained by a grammar: only then is the step's token mask applied (a batch
    # without one pays a scalar branch; see apply_token_mask).
    constrained: jax.Array = None  # bool[]
    # Rows whose logprobs are of the processed distribution (`logprobs_mode="processed"`: after
    # the temperature and the top-k/top-p/min-p filters, the one the token is drawn from).
    processed_logprobs: jax.Array = None  # bool[S]

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
            want_logprobs=np.bool_(False),
            bias_ids=np.zeros((num_seqs, BIAS_SLOTS), np.int32),
            bias_values=np.zeros((num_seqs, BIAS_SLOTS), np.float32),
            presence_penalty=np.zeros(num_seqs, np.float32),
            frequency_penalty=np.zeros(num_seqs, np.float32),
            repetition_penalty=np.ones(num_seqs, np.float32),
            slots=np.zeros(num_seqs, np.int32),
            count_sampled=np.zeros(num_seqs, np.bool_),
            want_prompt_logprobs=np.bool_(False),
            next_prompt_token=np.full(num_seqs, -1, np.int32),
            constrained=np.bool_(False),
            processed_logprobs=np.zeros(num_seqs, np.bool_),
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
    # Zeros unless want_logprobs or want_top_logprobs: a greedy batch should not pay a softmax.
    logprobs: jax.Array  # f32[S] log-probability of the chosen token under the model
    top_ids: jax.Array  # i32[S, min(20, V)] most likely tokens (zeros unless asked)
    top_logprobs: jax.Array  # f32[S, min(20, V)]
    # Per token of the step (the packed order), the logprob of the token after it and the top
    # 20 (`prompt_logprobs`): zeros unless want_prompt_logprobs; None where only `sample` ran.
    prompt_logprobs: jax.Array = None  # f32[T]
    prompt_top_ids: jax.Array = None  # i32[T, min(20, V)]
    prompt_top_logprobs: jax.Array = None  # f32[T, min(20, V)]
    # Speculative verification (`verify`): per sequence row, how many of its proposals the
    # step accepted; None where the batch verifies nothing.
    num_accepted: jax.Array = None  # i32[S]
    # A mixture of experts' routing: the step's real tokens each expert of each layer ran
    # (models/moe.py), summed on the device; None for a dense model.
    expert_load: jax.Array = None  # i32[num_layers, num_experts]


jax.tree_util.register_dataclass(
    SampleOutput,
    data_fields=[f.name for f in dataclasses.fields(SampleOutput)],
    meta_fields=[],
)


@dataclasses.dataclass(frozen=True)
class PenaltyState:
    """Per batch slot, what the penalties need of a request's tokens; lives on the device."""

    output_counts: jax.Array  # i32[max_num_seqs, V] times each token was generated
    in_prompt: jax.Array  # bool[max_num_seqs, V] the token occurs in the prompt

    @staticmethod
    def zeros(num_slots: int, vocab: int) -> PenaltyState:
        return PenaltyState(
            output_counts=jnp.zeros((num_slots, vocab), jnp.int32),
            in_prompt=jnp.zeros((num_slots, vocab), jnp.bool_),
        )


jax.tree_util.register_dataclass(
    PenaltyState, data_fields=["output_counts", "in_prompt"], meta_fields=[]
)


def init_penalty_row(
    state: PenaltyState,
    slot: jax.Array,
    token_ids: jax.Array,
    num_prompt: jax.Array,
    num_tokens: jax.Array,
) -> PenaltyState:
    """`state` with row `slot` holding one request's tokens, whatever the row held before.

    slot: i32[]; token_ids: i32[L] prompt then outputs, padded to a fixed L (the context length,
    so one compiled shape serves every request); num_prompt, num_tokens: i32[] how many of them
    are the prompt and how many are real.
    """
    index = jnp.arange(token_ids.shape[0])
    real = index < num_tokens
    vocab = state.output_counts.shape[1]
    counts = jnp.zeros(vocab, jnp.int32).at[token_ids].add((real & (index >= num_prompt)) * 1)
    prompt = jnp.zeros(vocab, jnp.int32).at[token_ids].add((index < num_prompt) * 1) > 0
    return PenaltyState(
        output_counts=state.output_counts.at[slot].set(counts),
        in_prompt=state.in_prompt.at[slot].set(prompt),
    )


def apply_penalties(logits: jax.Array, params: SamplingBatch, state: PenaltyState) -> jax.Array:
    """logits f32[S, V] with each row's presence, frequency and repetition penalties applied.

    Gathers S rows of counts only when some row has a penalty: a batch without any pays nothing.
    """
    rep = params.repetition_penalty
    on = (params.presence_penalty != 0) | (params.frequency_penalty != 0) | (rep != 1)

    def penalize():
        counts = state.output_counts[params.slots].astype(jnp.float32)  # f32[S, V]
        seen = (counts > 0) | state.in_prompt[params.slots]
        r = rep[:, None]
        out = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
        out = out - params.frequency_penalty[:, None] * counts
        out = out - params.presence_penalty[:, None] * (counts > 0)
        # Rows without penalties keep their logits bit for bit (x / 1 is exact, but be plain).
        return jnp.where(on[:, None], out, logits)

    return jax.lax.cond(jnp.any(on), penalize, lambda: logits)


def mask_words(vocab: int) -> int:
    """int32 words of one row's token bitmask: bit j of word i allows token 32 * i + j."""
    return -(-vocab // 32)


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """logits f32[S, V] with every token whose bit is clear in mask i32[S, ceil(V / 32)] at -inf.

    The grammar engine's packed layout (llguidance): bit j of word i is token 32 * i + j. A row
    whose words are all -1 (every bit set: the unconstrained rows of a constrained batch) keeps
    its logits bit for bit, so its tokens are those it samples without any mask.
    """
    num_seqs, vocab = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = jnp.right_shift(mask[:, :, None], shifts) & 1  # i32[S, W, 32]; arithmetic: & 1 is exact
    allowed = bits.reshape(num_seqs, -1)[:, :vocab] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def sample_step(
    logits: jax.Array, params: SamplingBatch, state: PenaltyState, mask: jax.Array | None = None
) -> tuple[SampleOutput, PenaltyState]:
    """`sample` with penalties from `state`, and `state` with each counted row's new token added.

    The step's own update: the token sampled now is counted before the next step reads it.
    mask: i32[S, ceil(V / 32)] the grammar rows' allowed tokens (apply_token_mask), or None.
    """
    out = sample(logits, params, state, mask)
    counts = state.output_counts.at[params.slots, out.token_ids].add(params.count_sampled * 1)
    return out, dataclasses.replace(state, output_counts=counts)


def argmax_rows(logits: jax.Array) -> jax.Array:  # f32[S, V] -> i32[S]
    """`jnp.argmax(logits, -1)` (the first maximum, or the first NaN) as two plain reductions.

    XLA:CPU lowers argmax to one variadic reduce over (value, index) pairs that it does not
    vectorize: 7.0 ms for 64 rows of a 49,152-token vocabulary on the 2-core CPU (1.8 ms at 16
    rows). Here each logit becomes an int32 key in the float order (its bits, the negative ones'
    magnitude bits flipped; -0.0 as 0.0; NaN above everything, as argmax ranks it), and a max of
    the keys and then a min over the indices that reach it give the same answer in 2.0 ms (0.43
    at 16 rows).
    """
    x = jnp.where(logits == 0, 0.0, logits).astype(jnp.float32)  # -0.0 ties with 0.0
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    key = jnp.where(jnp.isnan(x), jnp.iinfo(jnp.int32).max, bits ^ ((bits >> 31) & 0x7FFFFFFF))
    top = jnp.max(key, axis=-1, keepdims=True)
    ids = jax.lax.broadcasted_iota(jnp.int32, key.shape, key.ndim - 1)
    return jnp.min(jnp.where(key == top, ids, key.shape[-1] - 1), axis=-1)


def sample(
    logits: jax.Array,
    params: SamplingBatch,
    penalties: PenaltyState | None = None,
    mask: jax.Array | None = None,
) -> SampleOutput:
    """Draws one token per row of logits f32[S, V] (jit-friendly, no host sync).

    mask: i32[S, ceil(V / 32)] allowed tokens, applied first (so bias, penalties, every
    sampling mode and the logprobs see the masked logits) when `params.constrained`.
    """
    logits = logits.astype(jnp.float32)
    if mask is not None and params.constrained is not None:  # static: a step built with a mask
        logits = jax.lax.cond(
            params.constrained, lambda: apply_token_mask(logits, mask), lambda: logits
        )
    if params.bias_ids is not None:  # static: a batch built without bias slots has none
        rows = jnp.arange(logits.shape[0])[:, None]
        logits = logits.at[rows, params.bias_ids].add(params.bias_values)
    if penalties is not None and params.slots is not None:  # static
        logits = apply_penalties(logits, params, penalties)
    greedy = params.temperature <= 0
    best = argmax_rows(logits)
    token_ids = jax.lax.cond(
        jnp.all(greedy),
        lambda: best,
        lambda: jnp.where(greedy, best, _draw(logits, params)),
    )
    num_seqs, width = logits.shape[0], min(MAX_TOP_LOGPROBS, logits.shape[-1])

    def no_top(_lse):
        shape = (num_seqs, width)
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)

    def with_logprobs():
        view = logits
        if params.processed_logprobs is not None:  # static: a batch built without the field
            view = jax.lax.cond(
                jnp.any(params.processed_logprobs),
                lambda: processed_logits(logits, params),
                lambda: logits,
            )
        lse = jax.nn.logsumexp(view, axis=-1)

        def top_n(lse):
            # top_k of the logits, not of a materialised log_softmax: the same order, one pass less.
            values, ids = jax.lax.top_k(view, width)
            return ids.astype(jnp.int32), values - lse[:, None]

        chosen = jnp.take_along_axis(view, token_ids[:, None], axis=-1)[:, 0] - lse
        return (chosen, *jax.lax.cond(params.want_top_logprobs, top_n, no_top, lse))

    chosen, top_ids, top_lp = jax.lax.cond(
        params.want_logprobs | params.want_top_logprobs,
        with_logprobs,
        lambda: (jnp.zeros(num_seqs, jnp.float32), *no_top(None)),
    )
    return SampleOutput(token_ids=token_ids, logprobs=chosen, top_ids=top_ids, top_logprobs=top_lp)


# Tokens whose logits are made at once for prompt logprobs: bounds the [block, V] array (32 MB
# at a 128k vocabulary) however large the step's token bucket.
_PROMPT_BLOCK = 64


def prompt_logprobs(
    logits_of,
    hidden: jax.Array,
    token_ids: jax.Array,
    last_index: jax.Array,
    num_seqs: jax.Array,
    params: SamplingBatch,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token of the step, the log-probability of the token after it and the top 20.

    logits_of: hidden [B, H] -> logits [B, V] (the model's LM head); hidden: [T, H] (the model's
    dtype) every token's final hidden state; token_ids: i32[T] the step's tokens (pending ones
    fed in); last_index: i32[S] each row's last token (StepBatch.logits_indices); num_seqs: i32[]
    real rows. The token after a row's last one is the row's next_prompt_token (the next chunk's
    first), any other token's is the next in the step. Returns f32[T], i32[T, W], f32[T, W] with
    W = min(20, V): zeros when no row asked, and meaningless where there is no next prompt
    token (the host reads only the positions it asked for).
    """
    num_tokens = hidden.shape[0]
    vocab = jax.eval_shape(logits_of, hidden[:1]).shape[-1]
    width = min(MAX_TOP_LOGPROBS, vocab)

    def compute():
        rows = jnp.arange(last_index.shape[0])
        # Padding rows point at token 0: sent past the end (dropped) so they never overwrite it.
        at = jnp.where(rows < num_seqs, last_index, num_tokens)
        targets = jnp.concatenate([token_ids[1:], jnp.zeros(1, jnp.int32)])
        targets = targets.at[at].set(jnp.maximum(params.next_prompt_token, 0), mode="drop")
        # Equal blocks that tile the bucket: all of it at or below 64 tokens (powers of two),
        # 64 for the multiples of 64 above.
        block = math.gcd(num_tokens, _PROMPT_BLOCK)

        def one_block(args):
            h, target = args
            logits = logits_of(h).astype(jnp.float32)  # [block, V]
            lse = jax.nn.logsumexp(logits, axis=-1)
            chosen = jnp.take_along_axis(logits, target[:, None], axis=-1)[:, 0] - lse
            values, ids = jax.lax.top_k(logits, width)
            return chosen, ids.astype(jnp.int32), values - lse[:, None]

        # Blocks one after another (lax.map), so only one [block, V] array is live at a time.
        chosen, ids, top = jax.lax.map(
            one_block,
            (hidden.reshape(-1, block, hidden.shape[-1]), targets.reshape(-1, block)),
        )
        return chosen.reshape(num_tokens), ids.reshape(num_tokens, -1), top.reshape(num_tokens, -1)

    def skip():
        return (
            jnp.zeros(num_tokens, jnp.float32),
            jnp.zeros((num_tokens, width), jnp.int32),
            jnp.zeros((num_tokens, width), jnp.float32),
        )

    if params.want_prompt_logprobs is None:  # static: a batch built without the fields
        return skip()
    return jax.lax.cond(params.want_prompt_logprobs, compute, skip)


def processed_logits(logits: jax.Array, params: SamplingBatch) -> jax.Array:
    """f32[S, V]: the logits whose log-softmax is each processed row's sampling distribution.

    logits: f32[S, V] after the mask, bias and penalties. Rows with `processed_logprobs` set are
    divided by their temperature (1 for a greedy row) and every token the top-k, top-p and
    min-p filters drop is -inf, exactly the set `_draw` draws from (`full_vocab_threshold` is
    the oracle the sampler's candidate filter is tested against); the other rows are returned as
    they are. Only logprobs read this: the slow exact path is paid by processed rows' steps.
    """
    on = params.processed_logprobs
    sampling = on & (params.temperature > 0)
    inv_temp = jnp.where(sampling, 1.0 / jnp.where(sampling, params.temperature, 1.0), 1.0)
    scaled = logits * inv_temp[:, None]
    filtered = on & ((params.top_k > 0) | (params.top_p < 1))
    num_seqs = logits.shape[0]
    cut = jax.lax.cond(
        jnp.any(filtered),
        lambda: jnp.where(
            filtered, full_vocab_threshold(scaled, params.top_k, params.top_p), -jnp.inf
        ),
        lambda: jnp.full(num_seqs, -jnp.inf),
    )
    min_p_cut = jnp.max(scaled, axis=-1) + jnp.log(params.min_p)  # -inf when min-p is off
    cut = jnp.where(on, jnp.maximum(cut, min_p_cut), -jnp.inf)
    return jnp.where(scaled >= cut[:, None], scaled, -jnp.inf)


def _draw(logits: jax.Array, params: SamplingBatch) -> jax.Array:
    """A random token per row (i32[S]) from the tempered, filtered distribution.

    Greedy rows compute throwaway values here (the caller replaces them) but never decide a cond.
    The tempered logits are never materialised as [S, V]: each pass below scales the logits on the
    fly, because on XLA:CPU writing one more [S, V] array costs as much as the pass that reads it.
    """
    sampling = params.temperature > 0
    # Greedy rows scale by 1, not by ~1/0, so their throwaway values stay finite.
    inv_temp = jnp.where(sampling, 1.0 / jnp.where(sampling, params.temperature, 1.0), 1.0)
    u = jax.vmap(_uniform)(params.seeds, params.positions)
    filters = (params.top_k > 0) | (params.top_p < 1) | (params.min_p > 0)
    num_seqs = logits.shape[0]
    from_candidates, exact = jax.lax.cond(
        jnp.any(sampling & filters),
        lambda: _draw_from_candidates(logits, inv_temp, params, u),
        lambda: (jnp.zeros(num_seqs, jnp.int32), jnp.zeros(num_seqs, bool)),
    )
    whole_vocab = sampling & ~(filters & exact)
    # Only these rows need the bisection; min-p alone is one cheap pass, done for every row.
    bisect = whole_vocab & ((params.top_k > 0) | (params.top_p < 1))

    def with_vocab():
        token = _draw_from_vocab(logits, inv_temp, params, u, bisect)
        return jnp.where(whole_vocab, token, from_candidates)

    return jax.lax.cond(jnp.any(whole_vocab), with_vocab, lambda: from_candidates)


def _uniform(seed: jax.Array, position: jax.Array) -> jax.Array:
    """U[0, 1) keyed by (seed, position) alone: the same draw whatever batch the row is in."""
    return jax.random.uniform(jax.random.fold_in(jax.random.key(seed), position))


def candidate_filter(
    values: jax.Array, total: jax.Array, params: SamplingBatch
) -> tuple[jax.Array, jax.Array]:
    """Which candidates top-k, then top-p, then min-p keep, and whether that is the whole answer.

    values: f32[S, K] the K most likely tempered logits, sorted down; total: f32[S] the whole
    vocabulary's mass in units of the most likely token's, sum(exp(scaled - values[:, :1])).
    Returns keep: bool[S, K] and exact: bool[S], true where no token beyond the candidates could
    be kept, so drawing among the kept candidates is exactly the filtered distribution. Ties
    with the last kept token are kept, as the full-vocabulary filter does.
    """
    num_candidates = values.shape[-1]
    top = values[:, :1]
    weights = jnp.exp(values - top)  # f32[S, K] probabilities relative to the most likely
    top_k_inside = (params.top_k > 0) & (params.top_k <= num_candidates)
    kth = jnp.take_along_axis(values, jnp.clip(params.top_k - 1, 0, num_candidates - 1)[:, None], 1)
    keep = ~top_k_inside[:, None] | (values >= kth)
    # The nucleus is measured against the top-k set when top-k is on (it is all here), else the
    # whole vocabulary, of which the candidates hold only part of the mass.
    kept_mass = jnp.sum(jnp.where(keep, weights, 0.0), axis=-1)
    norm = jnp.where(top_k_inside, kept_mass, total)
    before = jnp.cumsum(jnp.where(keep, weights, 0.0), axis=-1) - jnp.where(keep, weights, 0.0)
    in_nucleus = keep & (before < params.top_p[:, None] * norm[:, None])
    last = jnp.min(jnp.where(in_nucleus, values, jnp.inf), axis=-1, keepdims=True)
    keep = keep & (values >= last)
    min_p_cut = top + jnp.log(params.min_p)[:, None]  # -inf when min-p is off
    keep = keep & (values >= min_p_cut)
    exact = (
        top_k_inside
        | ((params.top_p < 1) & (kept_mass >= params.top_p * norm))
        | (values[:, -1] < min_p_cut[:, 0])
    )
    # A top-k past the candidates rescales the nucleus by mass we have not summed: no shortcut.
    exact = exact & ~(params.top_k > num_candidates)
    return keep, exact


def _draw_from_candidates(
    logits: jax.Array, inv_temp: jax.Array, params: SamplingBatch, u: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Per row the token (i32[S]) drawn among the kept candidates, and whether it is exact.

    logits: f32[S, V]; inv_temp: f32[S] > 0. A positive scale keeps the order, so the candidates
    of the raw logits are those of the tempered ones.
    """
    vocab = logits.shape[-1]
    # The barrier keeps XLA:CPU's top-k kernel: without it the simplifier folds our slice of the
    # values into the sort that top_k lowers to, the pattern no longer matches, and a full sort of
    # the vocabulary runs instead (~100x slower at 64 x 49152). It wraps the values alone: a
    # barrier over top_k's (values, ids) tuple crashes XLA's compiler on a sharded step (a
    # check failure casting it to a get-tuple-element, under tensor parallelism), and the values
    # alone keep the kernel just as well (25.6 vs 25.8 ms; 1428 ms without any barrier).
    values, ids = jax.lax.top_k(logits, min(NUM_CANDIDATES, vocab))
    values = jax.lax.optimization_barrier(values)
    values = values * inv_temp[:, None]
    total = jnp.sum(jnp.exp(logits * inv_temp[:, None] - values[:, :1]), axis=-1)
    keep, exact = candidate_filter(values, total, params)
    if values.shape[-1] == vocab:  # static: the candidates are the whole vocabulary
        exact = jnp.ones_like(exact)
    pick = _inverse_cdf(jnp.where(keep, jnp.exp(values - values[:, :1]), 0.0), u)
    picked = jnp.arange(ids.shape[-1]) == pick[:, None]
    return jnp.sum(jnp.where(picked, ids, 0), axis=-1).astype(jnp.int32), exact


def _draw_from_vocab(
    logits: jax.Array, inv_temp: jax.Array, params: SamplingBatch, u: jax.Array, bisect: jax.Array
) -> jax.Array:
    """The token (i32[S]) drawn over the whole vocabulary, filtered exactly (slow) where asked.

    logits: f32[S, V]; inv_temp: f32[S] > 0; bisect: bool[S] rows whose top-k/top-p must be
    applied here (by the bisection, which runs only if any row needs it).
    """
    num_seqs, vocab = logits.shape
    row_max = jnp.max(logits, axis=-1) * inv_temp
    # The cond yields a threshold per row, not a masked copy of the logits, so no [S, V] array
    # crosses it and the passes below stay fused.
    cut = jax.lax.cond(
        jnp.any(bisect),
        lambda: jnp.where(
            bisect,
            full_vocab_threshold(logits * inv_temp[:, None], params.top_k, params.top_p),
            -jnp.inf,
        ),
        lambda: jnp.full(num_seqs, -jnp.inf),
    )
    # min-p: drop tokens whose probability is below min_p times the most likely one's.
    cut = jnp.maximum(cut, row_max + jnp.log(params.min_p))

    def mass(x):  # x: f32[S, ..., n] raw logits -> their kept, tempered mass
        scale = inv_temp.reshape((-1,) + (1,) * (x.ndim - 1))
        lower, top = cut.reshape(scale.shape), row_max.reshape(scale.shape)
        return jnp.where(x * scale >= lower, jnp.exp(x * scale - top), 0.0)

    # Two levels: pick a block by the cumulative block masses, then a token inside that block.
    block_size = next((b for b in (256, 128, 64, 32) if vocab % b == 0), _CDF_BLOCK)
    padded = -(-vocab // block_size) * block_size
    if padded != vocab:  # static and rare (odd vocabularies): -inf logits carry no mass
        logits = jnp.pad(logits, ((0, 0), (0, padded - vocab)), constant_values=-jnp.inf)
    blocks = logits.reshape(num_seqs, padded // block_size, block_size)
    block_mass = jnp.sum(mass(blocks), axis=-1)  # f32[S, V / block_size]
    block = _inverse_cdf(block_mass, u)
    # Where u falls inside the chosen block, as a fraction of that block's mass.
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    chosen = jnp.arange(block_mass.shape[-1]) == block[:, None]
    below = jnp.sum(jnp.where(chosen, block_cdf - block_mass, 0.0), axis=-1)
    within = jnp.sum(jnp.where(chosen, block_mass, 0.0), axis=-1)
    u_inside = (u * block_cdf[:, -1] - below) / within
    # The block's raw logits are gathered (S x block_size values) and their mass recomputed, so no
    # [S, V] mass array is ever written.
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    return block * block_size + _inverse_cdf(mass(inside), u_inside)


def _inverse_cdf(mass: jax.Array, u: jax.Array) -> jax.Array:
    """Index (i32[S]) of the first entry whose cumulative mass exceeds u times the total, per row.

    mass: f32[S, N] >= 0 with a positive entry in every row; u: f32[S] in [0, 1) or, after
    rounding, a little outside. Only entries with mass of their own can be picked, whatever the
    rounding of the cumulative sums: a filtered (zero-mass) token is never drawn.
    """
    cdf = jnp.cumsum(mass, axis=-1)
    index = jnp.arange(mass.shape[-1], dtype=jnp.int32)
    positive = mass > 0
    hit = positive & (cdf > (u * cdf[:, -1])[:, None])
    first = jnp.min(jnp.where(hit, index, mass.shape[-1]), axis=-1)
    last = jnp.max(jnp.where(positive, index, 0), axis=-1)  # when rounding left u past the end
    return jnp.minimum(first, last)


def _bisect_threshold(low: jax.Array, high: jax.Array, enough) -> jax.Array:
    """Largest t in [low, high] (f32[S], per row) with enough(t) true, by 32 bisections.

    enough(t): bool[S] must hold at t = low and be monotone in t. Thirty-two halvings pin t to
    float32 resolution, so the kept set is exact up to ties; a full vocab sort costs ~15x more on
    the CPU.
    """

    def body(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        ok = enough(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, body, (low, high))
    return lo


def full_vocab_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Per row the smallest logit (f32[S]) that top-k and then the top-p nucleus keep.

    scaled: f32[S, V] tempered logits; top_k: i32[S] (0: off); top_p: f32[S] (1: off). Keeping
    `scaled >= threshold` keeps the k most likely tokens, then of those the most likely whose
    mass first reaches top_p, ties with the last one kept included. The exact, slow path over the
    whole vocabulary (each bisection step is a pass over it): the fallback when a row's kept set
    may reach past the candidates, and the oracle the candidate filter is tested against.
    """
    vocab = scaled.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    row_min, row_max = jnp.min(scaled, axis=-1), jnp.max(scaled, axis=-1)

    def count_enough(t):
        return jnp.sum(scaled >= t[:, None], axis=-1) >= k

    kth = jax.lax.cond(
        jnp.any(k < vocab),
        lambda: _bisect_threshold(row_min, row_max, count_enough),
        lambda: row_min,
    )
    mass = jnp.where(scaled >= kth[:, None], jnp.exp(scaled - row_max[:, None]), 0.0)
    need = top_p * jnp.sum(mass, axis=-1)

    def mass_enough(t):
        return jnp.sum(jnp.where(scaled >= t[:, None], mass, 0.0), axis=-1) >= need

    return jax.lax.cond(
        jnp.any(top_p < 1),
        lambda: _bisect_threshold(kth, row_max, mass_enough),
        lambda: kth,
    )


def verify(
    sampled: jax.Array,  # i32[S] each row's token, drawn as if no proposal existed
    token_ids: jax.Array,  # i32[T] the step's tokens (pending ones fed in)
    logits_indices: jax.Array,  # i32[S] the token whose logits each row sampled from
    num_proposals: jax.Array,  # i32[S] proposals of each sequence row (0: none)
    extra_start: jax.Array,  # i32[S] first extra row of each sequence row's proposals
) -> tuple[jax.Array, jax.Array]:
    """Per sequence row, the proposals accepted (i32[S]) and the token after them (i32[S]).

    Row r sampled the token that follows its query token; a proposal is accepted when the
    sample of the query before it is that very proposal, and every proposal before it was
    accepted. The sample of the first disagreeing query (or, all accepted, the sequence's own
    row, after its last proposal) is the token the step adds after them.

    The samples are the ones a step without proposals draws (greedy: the argmax; sampling: the
    key of (seed, position)), so every emitted token is drawn from the target distribution at
    its position whatever was proposed: for a draft that proposes one token d with certainty,
    this accepts d with probability p(d) and otherwise draws from p without d, renormalised,
    which is the rejection sampling of speculative decoding, coupled to the request's seed.
    Seeded outputs are the same token for token with speculation on or off.
    """
    rows, num_tokens = sampled.shape[0], token_ids.shape[0]
    index = jnp.arange(rows, dtype=jnp.int32)
    checked = token_ids[jnp.minimum(logits_indices + 1, num_tokens - 1)]  # the next query token
    failed = jnp.where(sampled != checked, index, rows)
    next_failure = jax.lax.cummin(failed, reverse=True)  # first row >= r that disagrees
    first = jnp.minimum(extra_start, rows - 1)
    ends = extra_start + num_proposals
    accepted = jnp.where(num_proposals > 0, jnp.minimum(next_failure[first], ends) - extra_start, 0)
    after = jnp.where(
        accepted < num_proposals,
        sampled[jnp.minimum(extra_start + accepted, rows - 1)],
        sampled,
    )
    return accepted.astype(jnp.int32), after.astype(jnp.int32)
