"""jaxserve as Tunix's rollout engine: `JaxserveRollout` implements `tunix.rl.rollout.base_rollout.
BaseRollout` over an `LLM`, so Tunix's RL learners (GRPO, PPO) sample on jaxserve (docs/rl.md).

Tunix (PyPI `google-tunix`, the `tunix` extra) is optional: when it imports, the adapter is a
real `BaseRollout` subclass and `generate` returns Tunix's own `RolloutOutput`; without it, the
same class is duck-typed (a dataclass of the same fields), so a loop written against Tunix's
interface runs either way and the adapter is tested on every machine.

The mapping, one call each:
- `generate(prompts, rollout_config)`: one request per prompt, `RolloutConfig`'s sampling knobs
  as `SamplingParams` (top_k None or -1: off; `eos_tokens` as stop tokens; prompts cut to their
  last `max_prompt_length` tokens and left-padded with `pad_id()` in
  `left_padded_prompt_tokens`); logprobs, when `return_logprobs`, of the distribution each token
  was drawn from (`logprobs_mode="processed"`, what Tunix asks of vLLM by default) or raw when
  `rollout_vllm_logprobs_mode` says "raw_logprobs".
- `get_per_token_logps(prompt_tokens, completion_tokens)`: teacher-forced logprobs of the raw
  model (`LLM.score`), f32[B, C], 0 at the padding.
- `update_params(params)`: `LLM.update_weights` (jaxserve's tree, Hugging Face names, or what the
  `params_map` given at construction makes of a trainer's tree): drains, swaps, no compile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxserve.engine.llm import LLM
from jaxserve.sampling_params import SamplingParams

try:  # the `tunix` extra
    from tunix.rl.rollout import base_rollout as _tunix

    _Base: type = _tunix.BaseRollout
    RolloutOutput = _tunix.RolloutOutput
    RolloutConfig = _tunix.RolloutConfig
    HAVE_TUNIX = True
except ImportError:  # the same fields, so that code written against Tunix's runs unchanged
    HAVE_TUNIX = False
    _Base = object

    @dataclasses.dataclass
    class RolloutOutput:  # type: ignore[no-redef]
        """Tunix's RolloutOutput, for machines without Tunix."""

        text: list[str]
        logits: list | None
        tokens: list[np.ndarray]
        left_padded_prompt_tokens: np.ndarray
        logprobs: list[np.ndarray] | None

    @dataclasses.dataclass
    class RolloutConfig:  # type: ignore[no-redef]
        """The sampling fields of Tunix's RolloutConfig that this adapter reads."""

        max_tokens_to_generate: int = 64
        temperature: float = 0.9
        top_p: float | None = 1.0
        top_k: int | None = None
        seed: Any = None
        max_prompt_length: int = 64
        eos_tokens: list[int] | None = None
        return_logprobs: bool = False
        rollout_vllm_logprobs_mode: str = "processed_logprobs"


class JaxserveRollout(_Base):
    """Tunix's rollout interface over a jaxserve `LLM` (module docstring)."""

    def __init__(
        self,
        llm: LLM,
        *,
        pad_id: int | None = None,
        params_map: Callable[[Any], Any] | None = None,
    ):
        """`llm` serves the rollouts. `pad_id`: the padding of prompt and completion arrays
        (default: the tokenizer's pad token, else its EOS). `params_map`: turns what the trainer
        hands `update_params` into a tree `LLM.update_weights` takes (default: as it is)."""
        self.llm = llm
        tokenizer = llm.engine.tokenizer
        eos = None if tokenizer is None else tokenizer.eos_token_id
        if eos is None and llm.engine.model.config.eos_token_ids:
            eos = llm.engine.model.config.eos_token_ids[-1]
        if eos is None:
            raise ValueError("The model has no EOS token id; JaxserveRollout needs one.")
        self._eos = int(eos)
        pad = pad_id if pad_id is not None or tokenizer is None else tokenizer.pad_token_id
        self._pad = int(self._eos if pad is None else pad)
        self._params_map = params_map

    def sampling_params(self, config, index: int = 0) -> SamplingParams:
        """The request `config` (a RolloutConfig) makes of prompt `index`: seeds go seed + index,
        so a batch of the same prompt (GRPO's group) draws different samples, reproducibly."""
        top_k = config.top_k if config.top_k is not None and config.top_k > 0 else 0
        mode = getattr(config, "rollout_vllm_logprobs_mode", "processed_logprobs")
        seed = None if config.seed is None else (int(np.asarray(config.seed).ravel()[0]) + index)
        return SamplingParams(
            max_tokens=config.max_tokens_to_generate,
            temperature=config.temperature,
            top_p=1.0 if config.top_p is None else config.top_p,
            top_k=top_k,
            seed=None if seed is None else seed % 2**32,
            stop_token_ids=tuple(config.eos_tokens or ()),
            logprobs=0 if config.return_logprobs else None,
            logprobs_mode=mode,
        )

    def generate(self, prompts: Sequence[str], rollout_config, **kwargs) -> RolloutOutput:
        """One completion per prompt (Tunix repeats a prompt for a group); see the module
        docstring for the mapping. Unknown keyword arguments are refused, not ignored."""
        if kwargs:
            raise TypeError(
                f"JaxserveRollout.generate got keyword arguments {sorted(kwargs)} it does not "
                "know; sampling settings go in the RolloutConfig."
            )
        if rollout_config.max_prompt_length < 1:
            raise ValueError(
                f"max_prompt_length={rollout_config.max_prompt_length} must be at least 1."
            )
        engine = self.llm.engine
        limit = rollout_config.max_prompt_length
        ids = [engine.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        ids = [p[-limit:] for p in ids]
        params = [self.sampling_params(rollout_config, i) for i in range(len(ids))]
        done = self.llm.generate(ids, params)
        padded = np.full((len(ids), limit), self._pad, np.int32)
        for row, p in enumerate(ids):
            padded[row, limit - len(p) :] = p
        logprobs = None
        if rollout_config.return_logprobs:
            logprobs = [np.array([e.logprob for e in d.logprobs or []], np.float32) for d in done]
        return RolloutOutput(
            text=[d.text for d in done],
            logits=None,  # the step keeps no logits; logprobs stand for them
            tokens=[np.asarray(d.token_ids, np.int32) for d in done],
            left_padded_prompt_tokens=padded,
            logprobs=logprobs,
        )

    def get_per_token_logps(self, prompt_tokens, completion_tokens) -> np.ndarray:
        """f32[B, C]: log p(completion[b, j] | prompt[b] + completion[b, :j]) of the raw model.

        prompt_tokens: i32[B, P] left-padded with pad_id(); completion_tokens: i32[B, C]
        right-padded with it. Positions in the completion's trailing padding are 0."""
        prompts = np.asarray(prompt_tokens)
        completions = np.asarray(completion_tokens)
        if prompts.ndim != 2 or completions.ndim != 2 or len(prompts) != len(completions):
            raise ValueError(
                f"prompt_tokens {prompts.shape} and completion_tokens {completions.shape} must "
                "be [B, P] and [B, C] with the same B."
            )
        out = np.zeros(completions.shape, np.float32)
        pairs = []
        for row in range(len(prompts)):
            prompt = _strip(prompts[row], self._pad, leading=True)
            completion = _strip(completions[row], self._pad, leading=False)
            if not prompt:
                raise ValueError(f"Row {row} of prompt_tokens is all padding ({self._pad}).")
            if completion:
                pairs.append((row, prompt, completion))
        if pairs:
            scores = self.llm.score([p for _, p, _ in pairs], [c for _, _, c in pairs])
            for (row, _, completion), score in zip(pairs, scores, strict=True):
                out[row, : len(completion)] = score
        return out

    def update_params(self, params, filter_types=None) -> None:
        """Serves the trainer's new `params` from now on (LLM.update_weights: requests in flight
        finish first, nothing compiles). `filter_types` (Tunix's nnx filter for LoRA-only
        updates) is not supported: jaxserve swaps whole trees."""
        if filter_types is not None:
            raise NotImplementedError(
                f"update_params(filter_types={filter_types!r}): jaxserve swaps the whole param "
                "tree; pass the merged params instead."
            )
        self.llm.update_weights(params if self._params_map is None else self._params_map(params))

    def pad_id(self) -> int:
        """The padding id of the arrays `generate` returns and `get_per_token_logps` reads."""
        return int(self._pad)

    def eos_id(self) -> int:
        """The tokenizer's end-of-sequence id."""
        return int(self._eos)

    def model(self):
        """The served model (a jaxserve LoadedModel: config, dtype, tokenizer)."""
        return self.llm.engine.model


def _strip(row: np.ndarray, pad: int, *, leading: bool) -> list[int]:
    """row's tokens without its padding: leading for a left-padded prompt, else trailing (so
    where pad_id() is the EOS id, as by default without a pad token, a completion's final EOS is
    padding: Tunix's own masks read it so too)."""
    real = np.flatnonzero(row != pad)
    if not real.size:
        return []
    return row[real[0] :].tolist() if leading else row[: real[-1] + 1].tolist()
