"""jaxserve as the rollout engine of an RL loop: a differentiable teacher-forced forward of the
same flax model the engine serves, and a toy REINFORCE loop (docs/rl.md).

The trainer's forward runs `jaxserve.models` directly (no scheduler, no sampling, a fresh KV
pool per call), so the engine's logprobs can be checked against it and its gradients taken.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.config import ModelConfig
from jaxserve.models.kv_pool import KVPages, kv_lanes
from jaxserve.models.loaded import layer_loop_of, model_for
from jaxserve.models.step_batch import SeqChunk, pack_chunks

PAGE = 16


def forward_logprobs(config: ModelConfig, dtype, params: dict, seqs: Sequence[Sequence[int]]):
    """A function of params -> f32[T] the logprob of every token of `seqs` after the first of
    its sequence (concatenated per sequence: len(seq) - 1 values each), and T.

    One ragged batch of every sequence over a fresh pool, the reference attention: plain jnp,
    differentiable."""
    module = model_for(config, dtype, "reference", layer_loop=layer_loop_of(params))
    pages_per_seq = max(math.ceil(len(s) / PAGE) for s in seqs)
    num_pages = pages_per_seq * len(seqs)
    chunks = [
        SeqChunk(list(s), 0, list(range(i * pages_per_seq, (i + 1) * pages_per_seq)))
        for i, s in enumerate(seqs)
    ]
    total = sum(len(s) for s in seqs)
    batch = pack_chunks(
        chunks,
        page_size=PAGE,
        num_tokens=total,
        num_seqs=len(seqs),
        pages_per_seq=pages_per_seq,
        num_pages=num_pages,
    )
    # Token t's logits score token t + 1 of the same sequence; the last token of each scores none.
    starts = _offsets(seqs)
    rows = np.concatenate([np.arange(len(s) - 1) + o for s, o in zip(seqs, starts, strict=True)])
    targets = np.concatenate([np.asarray(s[1:], np.int32) for s in seqs])
    shape = (config.num_layers, num_pages, PAGE, kv_lanes(config))

    def logprobs(params):
        kv = KVPages(kv=jnp.zeros(shape, dtype))
        hidden, _ = module.apply({"params": params}, kv, batch)
        logits = module.apply({"params": params}, hidden[rows], method=module.logits)
        lp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]  # f32[len(rows)]

    return logprobs


def _offsets(seqs) -> list[int]:
    out, at = [], 0
    for s in seqs:
        out.append(at)
        at += len(s)
    return out


def reinforce(
    llm,
    prompt: Sequence[int],
    reward_fn,
    *,
    steps: int = 8,
    samples: int = 8,
    max_tokens: int = 8,
    learning_rate: float = 1e-2,
    seed: int = 0,
) -> list[float]:
    """A toy REINFORCE loop with jaxserve as the rollout engine: each step samples `samples`
    completions of `prompt` on the engine, scores them with `reward_fn(token_ids) -> float`,
    takes one Adam step (optax) on the mean-baselined policy gradient of the trainer's own
    forward, and hands the new weights to the engine (LLM.update_weights: no compile). Returns
    the mean reward of each step's rollouts."""
    import optax

    from jaxserve.sampling_params import SamplingParams

    engine = llm.engine
    config, dtype = engine.model.config, engine.model.dtype
    params = jax.device_get(engine.runner.params)
    opt = optax.adam(learning_rate)
    state = opt.init(params)
    rewards = []
    for step in range(steps):
        params_list = [
            SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + step * 1000 + i)
            for i in range(samples)
        ]
        done = llm.generate([list(prompt)] * samples, params_list)
        outs = [d.token_ids for d in done]
        r = np.array([reward_fn(o) for o in outs], np.float32)
        rewards.append(float(r.mean()))
        adv = r - r.mean()
        seqs = [list(prompt) + o for o in outs]
        lp_of = forward_logprobs(config, dtype, params, seqs)
        # Each completion token's logprob, weighted by its rollout's advantage.
        weights = np.concatenate(
            [
                np.r_[np.zeros(len(prompt) - 1), np.full(len(o), a)]
                for o, a in zip(outs, adv, strict=True)
            ]
        ).astype(np.float32)

        def loss(p, lp_of=lp_of, weights=weights):
            return -(lp_of(p) * weights).sum() / samples

        grads = jax.grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        llm.update_weights(params)
    return rewards
