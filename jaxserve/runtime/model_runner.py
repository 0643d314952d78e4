"""The model runner: one jitted step (forward + logits + sampling) over bucketed shapes.

    runner = ModelRunner(model, RunnerConfig(...))
    runner.precompile()                     # every (num_tokens, num_seqs) bucket, once
    out = runner.execute(batch, sampling)   # async dispatch; np.asarray(out.token_ids) syncs

The runner owns the device state (params and the donated KV pool) and never looks at requests:
it runs whatever packed batch it is given. Shapes come only from buckets, so serving never traces
again after `precompile`; `num_compiles` counts traces to prove it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.attention import import_kernels, warm_up_batches
from jaxserve.models.kv_pool import KVPages, init_kv_pages
from jaxserve.models.llama import logits_of_rows, step_compiler_options
from jaxserve.models.loaded import LoadedModel, layer_loop_of, model_for
from jaxserve.models.sharding import ShardingPlan, make_mesh
from jaxserve.models.step_batch import (
    SeqChunk,
    StepBatch,
    StepWords,
    from_words,
    pack_chunks,
    to_words,
)
from jaxserve.runtime.buckets import bucket_ladder, pick_bucket  # noqa: F401 - re-exported
from jaxserve.runtime.multihost import StepLink, is_leader
from jaxserve.runtime.sampling import (
    PenaltyState,
    SampleOutput,
    SamplingBatch,
    init_penalty_row,
    prompt_logprobs,
    sample_step,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """Device-side sizes: the KV pool and the bucket ladders the step is compiled for."""

    num_pages: int
    page_size: int
    max_model_len: int
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    attention_backend: str = "auto"

    def __post_init__(self):
        if self.num_pages < 1 or self.page_size < 1:
            raise ValueError(f"Need {self.num_pages=} >= 1 and {self.page_size=} >= 1.")
        if list(self.token_buckets) != sorted(set(self.token_buckets)) or not self.token_buckets:
            raise ValueError(f"token_buckets={self.token_buckets} must be strictly increasing.")
        if list(self.seq_buckets) != sorted(set(self.seq_buckets)) or not self.seq_buckets:
            raise ValueError(f"seq_buckets={self.seq_buckets} must be strictly increasing.")

    @property
    def pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)

    def seq_bucket_for(self, num_tokens: int) -> int:
        """The sequence rows of a step of `num_tokens` (a token bucket): one shape per bucket.

        A sequence runs >= 1 token, so a step of T tokens has at most min(T, max seqs) of them.
        Padding the rows to that bound, rather than to the smallest bucket of the real count,
        makes one compiled shape per token bucket (9 by default instead of 39, each compile
        costs seconds at start-up). Decode-only steps, where rows cost the most (one LM-head row
        each), are unchanged: there T is already the bucket of the sequence count. A mixed step
        of T >= max seqs tokens pays for all max-seqs rows of sampling and head, small beside
        its T tokens through every layer.
        """
        return pick_bucket(self.seq_buckets, min(num_tokens, self.seq_buckets[-1]))

    def buckets(self) -> list[tuple[int, int]]:
        """Every (num_tokens, num_seqs) shape a step can take, one per token bucket."""
        return [(t, self.seq_bucket_for(t)) for t in self.token_buckets]


class ModelRunner:
    """Holds params and the KV pool on the device and runs bucketed steps."""

    def __init__(
        self, model: LoadedModel, config: RunnerConfig, sharding: ShardingPlan | None = None
    ):
        self.model = model
        self.config = config
        # One device unless a sharding plan splits the model over a mesh
        # (jaxserve/models/sharding.py).
        self.sharding = sharding or ShardingPlan.create(make_mesh(1), model.config)
        import_kernels(config.attention_backend)  # before the first trace: see its docstring
        self.module = model_for(
            model.config,
            model.dtype,
            config.attention_backend,
            self.sharding,
            layer_loop=layer_loop_of(model.params),  # the loop the params were laid out for
        )
        self.params = self.sharding.place(model.params)  # a no-op when loaded so
        self.kv: KVPages = init_kv_pages(
            model.config,
            num_pages=config.num_pages,
            page_size=config.page_size,
            dtype=model.dtype,
            sharding=self.sharding.kv_pages,
        )
        # Token counts of the penalties, one row per batch slot (sampling.PenaltyState).
        self.penalties = jax.device_put(
            PenaltyState.zeros(config.seq_buckets[-1], model.config.vocab_size),
            self.sharding.replicated,  # where the step keeps it, so the first step moves nothing
        )
        # Each batch slot's last sampled token, where the next step finds a pending token
        # (StepBatch.feed_slots): sampled tokens feed the next step without visiting the host.
        self.last_tokens = jax.device_put(
            jnp.zeros(config.seq_buckets[-1], jnp.int32), self.sharding.replicated
        )
        self.num_compiles = 0
        # The pool is donated: the step updates it in place instead of copying it every step.
        # Shardings are pinned, so the pool keeps its split from step to step (no recompiles) and
        # the sampled tokens come back replicated (one small copy to the host).
        rep, kv = self.sharding.replicated, self.sharding.kv_pages
        # The step's host inputs cross as ONE int32 array (`batch.to_words`): on the CPU each array
        # passed to a jitted call costs a transfer of its own, ~1.5 ms a step for the ~30 arrays
        # of a StepBatch and SamplingBatch (a 2.5 ms decode step of `tiny` took 4 ms).
        self._jit_step = functools.partial(
            jax.jit,
            self._step_words,
            static_argnums=(5,),
            donate_argnums=(1, 3, 4),
            in_shardings=(self.sharding.params(self.params), kv, rep, rep, rep),
            out_shardings=(rep, kv, rep, rep),
        )
        # Buckets that compile with XLA options of their own (llama.step_compiler_options) get
        # a jitted step of their own: one per option set, made on first use.
        self._option_steps = {(): self._jit_step()}
        self._bucket_steps = {}  # num_tokens -> its jitted step
        # One shape (the context length) for every request: compiled once, on first use.
        self._init_penalty_row = jax.jit(init_penalty_row, donate_argnums=(0,))
        # Multi-host: process 0 sends every step to the others (jaxserve/runtime/multihost.py).
        self.lockstep = None
        if jax.process_count() > 1:
            self.lockstep = StepLink(
                page_size=config.page_size,
                pages_per_seq=config.pages_per_seq,
                num_pages=config.num_pages,
                max_tokens=config.token_buckets[-1],
                max_seqs=config.seq_buckets[-1],
            )

    def _step_impl(
        self,
        params,
        kv: KVPages,
        batch: StepBatch,
        sampling: SamplingBatch,
        pen: PenaltyState,
        last: jax.Array,  # i32[max_seqs] each batch slot's last sampled token
    ):
        self.num_compiles += 1  # runs only while tracing: counts compilations
        fed = last[jnp.maximum(batch.feed_slots, 0)]
        batch = dataclasses.replace(
            batch, token_ids=jnp.where(batch.feed_slots >= 0, fed, batch.token_ids)
        )
        hidden, kv = self.module.apply({"params": params}, kv, batch)
        # The head runs for the smallest tier of rows that holds the real ones, not for every
        # padding row of the bucket (jaxserve/models/llama.py's logits_of_rows).
        logits = logits_of_rows(
            lambda h: self.module.apply({"params": params}, h, method=self.module.logits),
            hidden,
            batch.logits_indices,
            batch.num_seqs,
        )
        out, pen = sample_step(logits, sampling, pen)

        def logits_of(h):  # the LM head over any tokens' hidden states
            return self.module.apply({"params": params}, h, method=self.module.logits)

        lp, top_ids, top_lp = prompt_logprobs(
            logits_of, hidden, batch.token_ids, batch.logits_indices, batch.num_seqs, sampling
        )
        out = dataclasses.replace(
            out, prompt_logprobs=lp, prompt_top_ids=top_ids, prompt_top_logprobs=top_lp
        )
        last = last.at[batch.sample_slots].set(out.token_ids, mode="drop")
        return out, kv, pen, last

    def _step_words(self, params, kv: KVPages, words: jax.Array, pen, last, layout):
        """`_step_impl` over the words `batch.to_words` packed (words: i32[N]; layout: static)."""
        batch, sampling = from_words(words, layout)
        return self._step_impl(params, kv, batch, sampling, pen, last)

    def set_penalty_row(self, slot: int, token_ids: Sequence[int], num_prompt: int) -> None:
        """Fills batch slot `slot`'s penalty counts from a request's prompt and outputs so far.

        Called when a request with penalties takes a slot, before the step that samples for it
        (the device runs both in dispatch order). Single-host only: a multi-host mesh would need
        the followers to make the same call.
        """
        if self.lockstep is not None:
            raise RuntimeError("Penalties are not supported on a multi-host mesh yet.")
        ids = np.zeros(self.config.max_model_len, np.int32)
        ids[: len(token_ids)] = token_ids  # padded so every request reuses one compiled shape
        self.penalties = self._init_penalty_row(
            self.penalties, np.int32(slot), ids, np.int32(num_prompt), np.int32(len(token_ids))
        )

    def execute(
        self, batch: StepBatch, sampling: SamplingBatch, words: StepWords | None = None
    ) -> SampleOutput:
        """Dispatches one step; returns device arrays without waiting for them.

        `words`, when given, is the same step already packed as one int32 array (the input
        batch packs into one; batch.StepWords), which then crosses as is.
        """
        if self.lockstep is not None:  # the other hosts must run this same step
            self.lockstep.send(batch, sampling)
        return self._dispatch(batch, sampling, words)

    def _dispatch(
        self, batch: StepBatch, sampling: SamplingBatch, words: StepWords | None = None
    ) -> SampleOutput:
        if words is None:
            words = to_words((batch, sampling))
        out, self.kv, self.penalties, self.last_tokens = self._step_for(batch)(
            self.params, self.kv, words.words, self.penalties, self.last_tokens, words.layout
        )
        if jax.process_count() > 1:  # this host's copy of the replicated result, readable here
            out = jax.tree.map(lambda a: a.addressable_data(0), out)
        return out

    def _step_for(self, batch: StepBatch):
        """The jitted step of `batch`'s bucket: with that bucket's XLA options, if it has any."""
        num_tokens = batch.token_ids.shape[0]
        step = self._bucket_steps.get(num_tokens)
        if step is None:  # a bucket's first step: looked up once, then a dict hit per step
            options = step_compiler_options(num_tokens, jax.default_backend())
            key = tuple(sorted(options.items()))
            if key not in self._option_steps:
                self._option_steps[key] = self._jit_step(compiler_options=options or None)
            step = self._bucket_steps[num_tokens] = self._option_steps[key]
        return step

    def follow(self) -> None:
        """Processes other than 0 of a multi-host mesh: runs process 0's steps until released."""
        if self.lockstep is None or is_leader():
            raise RuntimeError("Only processes other than 0 of a multi-host mesh follow.")
        while (step := self.lockstep.receive()) is not None:
            self._dispatch(*step)

    def stop_followers(self) -> None:
        """Process 0, at exit: lets the other processes' `follow` return (no-op on one host)."""
        if self.lockstep is not None and is_leader():
            self.lockstep.stop()

    def pack(self, chunks: Sequence[SeqChunk]) -> StepBatch:
        """Pads host chunks to the smallest bucket that holds them."""
        num_tokens = pick_bucket(self.config.token_buckets, sum(len(c.token_ids) for c in chunks))
        num_seqs = self.config.seq_bucket_for(num_tokens)
        return pack_chunks(
            chunks,
            page_size=self.config.page_size,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            pages_per_seq=self.config.pages_per_seq,
            num_pages=self.config.num_pages,
        )

    def precompile(self, progress: bool = True) -> float:
        """Compiles every bucket now (or loads it from the persistent cache); returns seconds."""
        from tqdm import tqdm

        start = time.perf_counter()
        buckets = self.config.buckets()
        for num_tokens, num_seqs in tqdm(
            buckets, desc="compiling", disable=not progress, unit="bucket"
        ):
            # All-padding batches: every token writes past the pool's end, so no page changes.
            batch = pack_chunks(
                [],
                page_size=self.config.page_size,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                pages_per_seq=self.config.pages_per_seq,
                num_pages=self.config.num_pages,
            )
            # Every process compiles the same buckets in the same order: nothing to send.
            out = self._dispatch(batch, SamplingBatch.empty(num_seqs))
            # Then once through the branches an all-padding batch skips (XLA:CPU sets a branch's
            # kernels up on its first run), writing nothing: the first real step of a bucket
            # then costs what later ones do.
            shape = dict(page_size=self.config.page_size, num_pages=self.config.num_pages)
            for warm in warm_up_batches(
                num_tokens, num_seqs, pages_per_seq=self.config.pages_per_seq, **shape
            ):
                out = self._dispatch(warm, SamplingBatch.empty(num_seqs))
            jax.block_until_ready(out.token_ids)
        if self.lockstep is not None:
            self.lockstep.warm_up()
        return time.perf_counter() - start


@functools.cache
def enable_compilation_cache(path: str) -> None:
    """Points JAX's persistent compilation cache at `path` (start-up compiles then reload)."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
