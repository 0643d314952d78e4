"""jaxserve as the rollout engine of an RL loop: a differentiable teacher-forced forward of the
same flax model the engine serves, a toy REINFORCE loop on `LLM`, and a toy GRPO loop through
Tunix's rollout interface (integrations/tunix.py; docs/rl.md).

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


def grpo(
    rollout,
    prompt: str,
    reward_fn,
    *,
    steps: int = 8,
    group: int = 8,
    max_tokens: int = 8,
    learning_rate: float = 2e-2,
    seed: int = 0,
    on_step=None,
) -> list[float]:
    """A toy GRPO loop through Tunix's rollout interface (`rollout`: a JaxserveRollout, or any
    object with Tunix's BaseRollout methods over a jaxserve model): each step samples a group
    of `group` completions of `prompt` (`generate`), scores them with `reward_fn(token_ids)`,
    normalises the rewards within the group (GRPO's advantages), takes the old policy's
    logprobs from `get_per_token_logps`, one Adam step on the ratio-weighted loss of the
    trainer's own forward, and hands the weights back with `update_params`. Returns each
    step's mean reward; `on_step(step, mean_reward)`, if given, hears of each as it is had."""
    import optax

    from jaxserve.integrations.tunix import RolloutConfig

    model = rollout.model()
    params = jax.device_get(rollout.llm.engine.runner.params)
    opt = optax.adam(learning_rate)
    state = opt.init(params)
    pad, rewards = rollout.pad_id(), []
    for step in range(steps):
        config = RolloutConfig(
            max_tokens_to_generate=max_tokens, temperature=1.0, top_p=1.0, seed=seed + step * 1000
        )
        out = rollout.generate([prompt] * group, config)
        r = np.array([reward_fn(t.tolist()) for t in out.tokens], np.float32)
        rewards.append(float(r.mean()))
        if on_step is not None:
            on_step(step, rewards[-1])
        adv = (r - r.mean()) / (r.std() + 1e-6)
        prompt_ids = out.left_padded_prompt_tokens
        width = max(max(len(t) for t in out.tokens), 1)
        completions = np.full((group, width), pad, np.int32)
        for row, t in enumerate(out.tokens):
            completions[row, : len(t)] = t
        old = rollout.get_per_token_logps(prompt_ids, completions)  # f32[group, width]
        prompt = prompt_ids[0, np.flatnonzero(prompt_ids[0] != pad)[0] :].tolist()  # unpadded
        prompt_len = len(prompt)
        seqs = [prompt + t.tolist() for t in out.tokens]
        lp_of = forward_logprobs(model.config, model.dtype, params, seqs)
        starts = np.cumsum([0] + [len(s) - 1 for s in seqs])
        rows = [np.arange(len(t)) + starts[i] + prompt_len - 1 for i, t in enumerate(out.tokens)]
        index = np.concatenate(rows).astype(np.int32)
        old_flat = np.concatenate([old[i, : len(t)] for i, t in enumerate(out.tokens)])
        weights = np.concatenate(
            [np.full(len(t), a / max(len(t), 1)) for t, a in zip(out.tokens, adv, strict=True)]
        ).astype(np.float32)

        def loss(p, lp_of=lp_of, index=index, old_flat=old_flat, weights=weights):
            ratio = jnp.exp(lp_of(p)[index] - old_flat)  # 1 at the rollout's weights
            return -(ratio * weights).sum() / group

        grads = jax.grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        rollout.update_params(params)
    return rewards


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m jaxserve.integrations.rollout`: the toy GRPO loop on the embedded model, on
    the CPU, through JaxserveRollout; prints each step's mean reward (the share of even token
    ids in the rollouts) as it goes."""
    import argparse
    import time

    from jaxserve.engine.llm import LLM
    from jaxserve.engine_config import EngineConfig
    from jaxserve.integrations.tunix import HAVE_TUNIX, JaxserveRollout

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt", default="Once upon a time")
    args = parser.parse_args(argv)
    start = time.monotonic()
    config = EngineConfig(
        max_num_seqs=16, max_num_batched_tokens=64, min_token_bucket=16, show_progress=False
    )
    rollout = JaxserveRollout(LLM(config))
    print(f"engine ready in {time.monotonic() - start:.1f} s (tunix installed: {HAVE_TUNIX})")

    def even_share(ids: list[int]) -> float:
        return float(np.mean([t % 2 == 0 for t in ids])) if ids else 0.0

    start = time.monotonic()
    grpo(
        rollout,
        args.prompt,
        even_share,
        steps=args.steps,
        group=args.group,
        on_step=lambda step, reward: print(f"step {step}: mean reward {reward:.3f}", flush=True),
    )
    print(f"{args.steps} GRPO steps in {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
