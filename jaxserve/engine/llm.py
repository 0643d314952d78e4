"""`LLM.generate` and `LLM.beam_search`: offline generation over a list of prompts on the engine."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from jaxserve.engine import beam_search
from jaxserve.engine.beam_search import Beam
from jaxserve.engine.build import build_engine
from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.outputs import RequestMetrics, TokenLogprob
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass
class Completion:
    """A finished request: all its tokens and text."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # With SamplingParams.beam_width > 1: every beam found, best first (token_ids and text are
    # the first's).
    beams: list[Beam] | None = None
    # Speculative decoding (EngineConfig.speculative): tokens proposed and verified, of those
    # accepted, and the steps that verified them (RequestOutput's fields of the same names).
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0


class LLM:
    """Runs batches of prompts to completion, with continuous batching underneath."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        engine: Engine | None = None,
        model=None,
        devices=None,
        mesh=None,
    ):
        """An engine for `config` (or the `engine` given), of `model` (a LoadedModel; default:
        the config's), on the config's mesh, or on `devices` (a list of jax.Device) or `mesh`
        (a jax.sharding.Mesh): a trainer's chips, for colocation (docs/rl.md)."""
        if engine is not None and (model is not None or devices is not None or mesh is not None):
            raise ValueError("Give LLM an engine, or what to build one from, not both.")
        self.engine = engine or build_engine(config, model, devices=devices, mesh=mesh)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_logprobs: int | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[Completion]:
        """Generates for every prompt; results come back in the prompts' order.

        `prompt_logprobs=k` sets SamplingParams.prompt_logprobs on every request (each prompt
        token's logprob and top k in `Completion.prompt_logprobs`). `lora` names the adapter
        (Engine.add_lora) of every prompt, or one per prompt; None: the base model.
        """
        if lora is None or isinstance(lora, str):
            lora = [lora] * len(prompts)
        if len(lora) != len(prompts):
            raise ValueError(f"Got {len(lora)} adapters for {len(prompts)} prompts.")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if prompt_logprobs is not None:
            sampling_params = [
                dataclasses.replace(p, prompt_logprobs=prompt_logprobs) for p in sampling_params
            ]
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"Got {len(sampling_params)} SamplingParams for {len(prompts)} prompts."
            )
        engine = self.engine
        ids, results = [], {}
        searches = {}  # beam searches (beam_width > 1), run beside the other requests
        driver = beam_search.BeamDriver(engine)
        for prompt, params, adapter in zip(prompts, sampling_params, lora, strict=True):
            prompt_ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if params.beam_width > 1:
                rid = f"beam-{len(searches)}"
                searches[rid] = beam_search.start_search(engine, prompt_ids, params, adapter)
            else:
                rid = engine.add_request(prompt_ids, params, lora=adapter)
            ids.append(rid)
            results[rid] = Completion(rid, prompt_ids, [], "", "", None)
        start = time.monotonic()
        for search in searches.values():
            driver.submit(search)
        while engine.has_unfinished():
            for out in engine.step():
                if driver.take(out):
                    continue
                done = results.get(out.request_id)
                if done is None:
                    continue
                done.token_ids += out.new_token_ids
                done.text += out.text_delta
                if out.prompt_logprobs is not None:
                    done.prompt_logprobs = out.prompt_logprobs
                if out.logprobs is not None:
                    done.logprobs = (done.logprobs or []) + out.logprobs
                if out.finished:
                    done.finish_reason, done.metrics = out.finish_reason, out.metrics
                    done.num_proposed_tokens = out.num_proposed_tokens
                    done.num_accepted_tokens = out.num_accepted_tokens
                    done.num_verifications = out.num_verifications
        for rid, search in searches.items():
            beams = beam_search.label(engine, search.prompt_token_ids, search.result())
            best = beam_search.best_output(rid, search, beams, start)
            done = results[rid]
            done.token_ids, done.text, done.beams = best.new_token_ids, best.text_delta, beams
            done.finish_reason, done.metrics = best.finish_reason, best.metrics
        return [results[rid] for rid in ids]

    def beam_search(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        beam_width: int,
        max_tokens: int = 16,
        length_penalty: float = 1.0,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        lora: str | None = None,
    ) -> list[list[Beam]]:
        """Every beam of a beam search per prompt (best score first; jaxserve/engine/beam_search.py
        has the rule), in the prompts' order. beam_width=1 is greedy decoding; stop_token_ids
        end a beam as EOS does; `lora` names the adapter every search runs with."""
        params = SamplingParams(
            beam_width=beam_width,
            max_tokens=max_tokens,
            length_penalty=length_penalty,
            ignore_eos=ignore_eos,
            stop_token_ids=tuple(stop_token_ids),
        )
        engine = self.engine
        searches = [
            beam_search.start_search(
                engine, engine.encode(p) if isinstance(p, str) else list(p), params, lora
            )
            for p in prompts
        ]
        return beam_search.run(engine, searches)

    # ---- the rollout API (docs/rl.md) -----------------------------------------------------

    def update_weights(self, params) -> None:
        """Serves `params` (a param tree in the model's structure, or a checkpoint folder)
        from now on, with no compile and an emptied prefix cache (Engine.update_weights)."""
        self.engine.update_weights(params)

    def sleep(self, level: int = 1) -> int:
        """Frees the KV pool (level 2: the weights too, kept on the host); returns the bytes
        freed (Engine.sleep)."""
        return self.engine.sleep(level)

    def wake_up(self) -> None:
        """Allocates what `sleep` freed again; serving resumes with no compile."""
        self.engine.wake_up()

    def score(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """Teacher-forced logprobs of each completion's tokens after its prompt: for a trainer's
        importance ratios, nothing sampled. One list per pair, one float per completion token:
        log p(completion[j] | prompt + completion[:j]) of the raw model (no temperature).

        Runs each pair as one request with prompt logprobs; its one sampled token is dropped.
        """
        if len(prompts) != len(completions):
            raise ValueError(f"Got {len(completions)} completions for {len(prompts)} prompts.")
        if any(not c for c in completions) or any(not p for p in prompts):
            raise ValueError("Every prompt and every completion needs at least one token.")
        seqs = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
        done = self.generate(seqs, SamplingParams(max_tokens=1, temperature=0.0), prompt_logprobs=0)
        return [
            [e.logprob for e in d.prompt_logprobs[len(p) :]]
            for d, p in zip(done, prompts, strict=True)
        ]
