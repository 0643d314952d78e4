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
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.attention import import_kernels, warm_up_batches
from jaxserve.models.kv_keys import KeyTransform
from jaxserve.models.kv_pool import KVLayout, KVPages, init_kv_pages, resolve_kv_cache_dtype
from jaxserve.models.llama import logits_of_rows
from jaxserve.models.loaded import LoadedModel, layer_loop_of, model_for, pack_params
from jaxserve.models.lora import LoraAdapter, empty_slots, set_slot, slot_weights
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
    mask_words,
    prompt_logprobs,
    sample_step,
    verify,
)
from pallas_kernels.ragged_paged_attention import cpu_ffi

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
    # Multi-LoRA (models/lora.py): adapter slots on the device, each of rank max_lora_rank.
    # 0 slots: the step carries no adapter arrays and adds nothing.
    max_loras: int = 0
    max_lora_rank: int = 16
    # The pool's dtype (kv_pool.resolve_kv_cache_dtype): "auto" (the model's), "int8" or "fp8".
    kv_cache_dtype: str = "auto"
    # The pool's layer groups (kv_pool.KVLayout: a hybrid pool of local and global layers, set
    # by the engine from kv_pool.kv_layout); None: uniform, one group of every layer.
    kv_layout: KVLayout | None = None
    # An 8-bit pool's key conditioning (models/kv_keys.py), calibrated on the model at start-up
    # (runtime/key_calibration.py); None: keys stored as computed (a float pool, or a test).
    kv_keys: KeyTransform | None = None

    @property
    def num_groups(self) -> int:
        """Page tables per sequence: the layout's groups (1 for a uniform pool)."""
        return 1 if self.kv_layout is None else self.kv_layout.num_groups

    def __post_init__(self):
        if self.num_pages < 1 or self.page_size < 1:
            raise ValueError(f"Need {self.num_pages=} >= 1 and {self.page_size=} >= 1.")
        resolve_kv_cache_dtype(self.kv_cache_dtype, jnp.float32)  # a ValueError naming it
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"Need {self.max_loras=} >= 0 and {self.max_lora_rank=} >= 1.")
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


def step_impl(
    module,
    params,
    kv: KVPages,
    batch: StepBatch,
    sampling: SamplingBatch,
    pen: PenaltyState,
    last: jax.Array,  # i32[max_seqs] each batch slot's last sampled token
    mask: jax.Array
    | None = None,  # i32[S, ceil(V / 32)] allowed tokens (sampling.apply_token_mask)
    lora: dict | None = None,  # the adapters' slot arrays (lora.empty_slots); None: LoRA off
):
    """One step: the forward over the ragged batch, the LM head for the real rows, sampling,
    prompt logprobs; returns (SampleOutput, kv, penalties, last tokens)."""
    fed = last[jnp.maximum(batch.feed_slots, 0)]
    batch = dataclasses.replace(
        batch, token_ids=jnp.where(batch.feed_slots >= 0, fed, batch.token_ids), lora=lora
    )
    expert_load = None
    if module.config.moe is None:
        hidden, kv = module.apply({"params": params}, kv, batch)
    else:  # the experts' load rides back with the step's outputs (EngineMetrics.on_expert_load)
        (hidden, kv), state = module.apply({"params": params}, kv, batch, mutable="intermediates")
        (expert_load,) = state["intermediates"]["expert_load"]
    # The head runs for the real rows alone (packed on the CPU), else for the smallest tier of
    # rows that holds them, not for every padding row (jaxserve/models/llama.py's logits_of_rows).
    logits = logits_of_rows(
        lambda h, valid=None: module.apply({"params": params}, h, valid, method=module.logits),
        hidden,
        batch.logits_indices,
        batch.num_seqs if batch.num_rows is None else batch.num_rows,
        skips_padding=module.head_skips_padding(),
    )
    out, pen = sample_step(logits, sampling, pen, mask)
    after = out.token_ids  # each row's next token: its sample, or after its accepted proposals
    if batch.num_proposals is not None:  # static: batches packed with the verification fields
        accepted, after = verify(
            out.token_ids,
            batch.token_ids,
            batch.logits_indices,
            batch.num_proposals,
            batch.extra_start,
        )
        out = dataclasses.replace(out, num_accepted=accepted)

    def logits_of(h):  # the LM head over any tokens' hidden states
        return module.apply({"params": params}, h, method=module.logits)

    lp, top_ids, top_lp = prompt_logprobs(
        logits_of, hidden, batch.token_ids, batch.logits_indices, batch.num_seqs, sampling
    )
    out = dataclasses.replace(
        out,
        prompt_logprobs=lp,
        prompt_top_ids=top_ids,
        prompt_top_logprobs=top_lp,
        expert_load=expert_load,
    )
    last = last.at[batch.sample_slots].set(after, mode="drop")
    return out, kv, pen, last


def step_words(module, params, kv: KVPages, words: jax.Array, pen, last, mask, layout, lora=None):
    """`step_impl` over the words `batch.to_words` packed (words: i32[N]; mask: i32[S, W] the
    grammar rows' token bitmask; layout: static; lora: the adapter slots or None): the function
    the runner jits per bucket, and `jaxserve compile` compiles for a target."""
    batch, sampling = from_words(words, layout)
    return step_impl(module, params, kv, batch, sampling, pen, last, mask, lora)


def packs_weights(dtype, sharding: ShardingPlan, quant=None) -> bool:
    """Whether the step runs on weights packed for cpu_matmul.cc (LlamaForCausalLM's
    `packed_weights`): float32 on one CPU device with AVX-512 and the kernels' library, unless
    $JAXSERVE_CPU_PACKED_WEIGHTS=0. The runner then holds both trees: the canonical params (what
    update_weights, sleep and trainers read) and their packed kernels, a second copy of the
    matmul weights in host memory. Quantized weights (`quant`, models/quant.py) are packed
    where cpu_matmul_int8.cc has the scheme's vector kernel (weight-only int8 or e4m3:
    AVX-512F; W8A8, int8 only: VNNI too): their 8-bit panels, a quarter of float32's bytes.
    (XLA:CPU's dot widened e4m3 weights into a float32 copy every step, 7-15x slower than
    float32.) Block-scaled kernels (a pre-quantized fp8 checkpoint's 128-row scales) are not
    packed: the kernel applies one scale a column."""
    if quant is not None and not (
        (quant.weights == "int8" or quant.activations is None)
        and not quant.transposed
        and quant.block is None
        and cpu_ffi.int8_matmul_available("float" if quant.activations is None else "int8")
    ):
        return False
    return (
        os.environ.get("JAXSERVE_CPU_PACKED_WEIGHTS", "1") != "0"
        and jnp.dtype(dtype) == jnp.float32
        and sharding.platform == "cpu"
        and sharding.mesh.size == 1
        and cpu_ffi.packed_matmul_available()
    )


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
        packed = packs_weights(model.dtype, self.sharding, model.quant)
        self.module = model_for(
            model.config,
            model.dtype,
            config.attention_backend,
            self.sharding,
            layer_loop=layer_loop_of(model.params),  # the loop the params were laid out for
            packed_weights=packed,
            quant=model.quant,
            kv_layout=config.kv_layout,
            kv_keys=config.kv_keys,
        )
        if packed:
            logger.info(
                "The matmuls run on weights packed for the CPU (%s).",
                "cpu_matmul.cc"
                if model.quant is None
                else f"{model.quant.weights}, cpu_matmul_int8.cc",
            )
        # Jitted once: packing new weights (a swap, a wake-up) compiles nothing after the first.
        self._pack = (
            jax.jit(
                functools.partial(
                    pack_params, config=model.config, dtype=model.dtype, quant=model.quant
                )
            )
            if packed
            else None
        )
        self.params = self.sharding.place(model.params)  # a no-op when loaded so
        # The pool's dtype: the model's, or 8 bits with scale lanes (--kv-cache-dtype).
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, model.dtype)
        self.kv: KVPages = self.new_kv_pool()
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
        # Grammar rows' allowed tokens cross as a packed bitmask per row (sampling.py).
        self.mask_words = mask_words(model.config.vocab_size)
        self._all_allowed: dict[int, jax.Array] = {}
        # Adapter slots (models/lora.py): fixed shapes, written in place by set_lora_slot, so
        # loading or swapping an adapter never recompiles the step. None: LoRA off.
        self.lora = None
        self._layer_loop = layer_loop_of(model.params)  # the slots are laid out as the params
        if config.max_loras:
            slots = empty_slots(
                model.config,
                config.max_loras,
                config.max_lora_rank,
                model.dtype,
                self._layer_loop,
            )
            self.lora = jax.device_put(slots, self.sharding.replicated)
        self._set_lora_slot = jax.jit(set_slot, donate_argnums=(0,))
        self.num_compiles = 0
        # The pool is donated: the step updates it in place instead of copying it every step.
        # Shardings are pinned, so the pool keeps its split from step to step (no recompiles) and
        # the sampled tokens come back replicated (one small copy to the host).
        rep, kv = self.sharding.replicated, self.sharding.kv_pages
        # The step's host inputs cross as ONE int32 array (`batch.to_words`): on the CPU each array
        # passed to a jitted call costs a transfer of its own, ~1.5 ms a step for the ~30 arrays
        # of a StepBatch and SamplingBatch (a 2.5 ms decode step of `tiny` took 4 ms).
        self._step = jax.jit(
            self._step_words,
            static_argnums=(6,),
            donate_argnums=(1, 3, 4),
            # params, pool, words, penalties, last tokens, grammar mask, adapter slots
            in_shardings=(self.sharding.params(self.step_params), kv, rep, rep, rep, rep, rep),
            out_shardings=(rep, kv, rep, rep),
        )
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
                num_groups=config.num_groups,
            )

    @property
    def params(self) -> dict | None:
        """The canonical param tree (what update_weights, sleep and trainers read and set)."""
        return self._params

    @params.setter
    def params(self, params: dict | None) -> None:
        self._params = params
        # What the step runs on: the same tree, or its kernels packed for cpu_matmul.cc.
        self.step_params = params if self._pack is None or params is None else self._pack(params)

    def new_kv_pool(self) -> KVPages:
        """A zeroed pool of the configured shape on its sharding: at start-up, and again when a
        sleeping engine wakes (Engine.wake_up), the same shape, so the step does not recompile."""
        return init_kv_pages(
            self.model.config,
            num_pages=self.config.num_pages,
            page_size=self.config.page_size,
            dtype=self.kv_dtype,
            sharding=self.sharding.kv_pages,
            lanes=self.sharding.pool_lanes(self.kv_dtype),  # whole 128-lane tiles on TPU
            layout=self.config.kv_layout,
        )

    def _step_words(self, params, kv: KVPages, words: jax.Array, pen, last, mask, layout, lora):
        """The step over the words `batch.to_words` packed (words: i32[N]; mask: i32[S, W];
        layout: static; lora: the adapter slots or None)."""
        self.num_compiles += 1  # runs only while tracing: counts compilations
        return step_words(self.module, params, kv, words, pen, last, mask, layout, lora)

    def all_allowed(self, num_seqs: int) -> jax.Array:
        """The token mask of a step without grammar rows (i32[num_seqs, W], every bit set): one
        per row bucket, made once and kept on the device, so such a step ships no mask."""
        mask = self._all_allowed.get(num_seqs)
        if mask is None:
            host = np.full((num_seqs, self.mask_words), -1, np.int32)
            mask = self._all_allowed[num_seqs] = jax.device_put(host, self.sharding.replicated)
        return mask

    def set_lora_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Puts `adapter` (None: zeros) in device slot `slot` (1..max_loras), in place.

        Dispatched in order with the steps: a step dispatched before reads the old weights, one
        after reads the new. Single-host only, like the penalties.
        """
        if self.lora is None or not 1 <= slot <= self.config.max_loras:
            raise ValueError(
                f"LoRA slot {slot} does not exist: this runner has max_loras="
                f"{self.config.max_loras} slots, numbered from 1."
            )
        if self.lockstep is not None:
            raise RuntimeError("LoRA adapters are not supported on a multi-host mesh yet.")
        rc = self.config
        weights = slot_weights(
            adapter, self.model.config, rc.max_lora_rank, self.model.dtype, self._layer_loop
        )
        self.lora = self._set_lora_slot(self.lora, np.int32(slot - 1), weights)

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
        self,
        batch: StepBatch,
        sampling: SamplingBatch,
        words: StepWords | None = None,
        mask: np.ndarray | None = None,
    ) -> SampleOutput:
        """Dispatches one step; returns device arrays without waiting for them.

        `words`, when given, is the same step already packed as one int32 array (the input
        batch packs into one; batch.StepWords), which then crosses as is. `mask` (i32[S, W]):
        the allowed tokens of a step with grammar rows (`sampling.constrained` set); None for
        any other step.
        """
        if self.lockstep is not None:  # the other hosts must run this same step
            if mask is not None:
                raise RuntimeError("Structured output is not supported on a multi-host mesh yet.")
            self.lockstep.send(batch, sampling)
        return self._dispatch(batch, sampling, words, mask)

    def _dispatch(
        self,
        batch: StepBatch,
        sampling: SamplingBatch,
        words: StepWords | None = None,
        mask: np.ndarray | None = None,
    ) -> SampleOutput:
        if words is None:
            words = to_words((batch, sampling))
        if mask is None:
            mask = self.all_allowed(batch.logits_indices.shape[0])
        else:
            # Placed as the all-ones mask is: a host array would be a second signature of the
            # jitted step, compiled again for every bucket at warm-up.
            mask = jax.device_put(mask, self.sharding.replicated)
        out, self.kv, self.penalties, self.last_tokens = self._step(
            self.step_params,
            self.kv,
            words.words,
            self.penalties,
            self.last_tokens,
            mask,
            words.layout,
            self.lora,
        )
        if jax.process_count() > 1:  # this host's copy of the replicated result, readable here
            out = jax.tree.map(lambda a: a.addressable_data(0), out)
        return out

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
                num_groups=self.config.num_groups,
            )
            # Every process compiles the same buckets in the same order: nothing to send.
            out = self._dispatch(batch, SamplingBatch.empty(num_seqs))
            # Then once through the branches an all-padding batch skips (XLA:CPU sets a branch's
            # kernels up on its first run), writing nothing: the first real step of a bucket
            # then costs what later ones do.
            shape = dict(page_size=self.config.page_size, num_pages=self.config.num_pages)
            for warm in warm_up_batches(
                num_tokens,
                num_seqs,
                pages_per_seq=self.config.pages_per_seq,
                num_groups=self.config.num_groups,
                **shape,
            ):
                out = self._dispatch(warm, SamplingBatch.empty(num_seqs))
            # And through the grammar mask's branch (a step with a constrained row), with a
            # mask from the host as such steps ship one.
            constrained = dataclasses.replace(
                SamplingBatch.empty(num_seqs), constrained=np.bool_(True)
            )
            mask = np.full((num_seqs, self.mask_words), -1, np.int32)
            out = self._dispatch(batch, constrained, None, mask)
            jax.block_until_ready(out.token_ids)
        if self.lockstep is not None:
            self.lockstep.warm_up()
        else:  # the penalty initialiser (single host only), on a slot past the end: no write
            self.set_penalty_row(self.config.seq_buckets[-1], (), 0)
            if self.lora is not None:  # the slot writer, on a slot no adapter holds yet
                self.set_lora_slot(1, None)
        return time.perf_counter() - start

    def time_buckets(
        self, context: int, chunk: int, rounds: int = 5
    ) -> dict[int, tuple[float, float, float | None]]:
        """Per token bucket, the seconds of (a step with one decode at `context`: the decode
        loop runs every sequence slot of the bucket, so this is what the bucket's decodes
        cost; a step without decodes, its padding alone; what one `chunk`-token chunk at that
        context adds, None where the bucket cannot hold it). The best of `rounds` rounds, each
        timing every bucket once (interleaved: a busy moment of the machine cannot make one
        bucket look dearer).

        For pricing steps (speculative decoding). Call it before serving: its steps write the
        keys and values of made-up tokens into the pool's first pages, which no request holds
        yet and which every request writes before it reads.
        """
        cfg = self.config
        context = max(1, min(context, cfg.max_model_len - chunk - 1))
        table = list(range(min(cfg.pages_per_seq, cfg.num_pages)))
        if len(table) * cfg.page_size < context + chunk + 1:
            raise ValueError(
                f"Timing steps at context {context} needs {context + chunk + 1} cache slots; "
                f"the pool has {cfg.num_pages} pages of {cfg.page_size}."
            )
        decode = SeqChunk([1], context - 1, table)
        verify = SeqChunk([1] * chunk, context, table)

        def batch_of(chunks, num_tokens):
            return pack_chunks(
                chunks,
                page_size=cfg.page_size,
                num_tokens=num_tokens,
                num_seqs=cfg.seq_bucket_for(num_tokens),
                pages_per_seq=cfg.pages_per_seq,
                num_pages=cfg.num_pages,
                num_groups=cfg.num_groups,
            )

        def seconds(batch) -> float:
            start = time.perf_counter()
            out = self._dispatch(batch, SamplingBatch.empty(len(batch.kv_lens)))
            jax.block_until_ready(out.token_ids)
            return time.perf_counter() - start

        best = {t: [math.inf, math.inf, math.inf] for t in cfg.token_buckets}
        for _ in range(rounds):
            for t, times in best.items():
                times[0] = min(times[0], seconds(batch_of([decode], t)))
                times[1] = min(times[1], seconds(batch_of([], t)))
                if t >= chunk:
                    times[2] = min(times[2], seconds(batch_of([verify], t)))
        return {
            t: (d, p, None if math.isinf(c) else max(0.0, c - p)) for t, (d, p, c) in best.items()
        }


@functools.cache
def enable_compilation_cache(path: str) -> None:
    """Points JAX's persistent compilation cache at `path` (start-up compiles then reload)."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
