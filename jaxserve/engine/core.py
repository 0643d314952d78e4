"""`Engine`: the iteration loop, and the only module that sees both scheduler and runner.

    engine = Engine(EngineConfig())
    engine.add_request("Once upon a time", SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...

One `step()` plans and dispatches the next step *before* taking in the one in flight
(asynchronous scheduling, scheduler.py): the tokens a step samples stay on the device and feed
the next step there, so the host plans step t+1 while the device runs step t, and the device
always has the next step queued. Then it waits for step t, hands its tokens to the scheduler,
and detokenizes and checks stop strings while step t+1 computes. What the host learns late costs
one wasted row at most: a request that samples EOS, or whose stop string is found, has already
run one more step, whose token is dropped, never emitted. `EngineConfig.async_scheduling=False`
plans each step only after the last one's tokens are on the host (the same outputs, slower).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import math
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from checkpoints import ModelLoadError
from jaxserve.engine.adapters import Adapters
from jaxserve.engine.grammar import GrammarCompiler, RequestGrammar
from jaxserve.engine.metrics import EngineMetrics, PhaseClock
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine_config import EngineConfig
from jaxserve.models.loaded import LoadedModel
from jaxserve.models.quant import quantize_params
from jaxserve.outputs import RequestOutput, TokenLogprob
from jaxserve.runtime import compiles, kv_transfer
from jaxserve.runtime.buckets import pick_bucket
from jaxserve.runtime.builder import build_runner, load_params
from jaxserve.runtime.input_batch import InputBatch
from jaxserve.runtime.model_runner import ModelRunner
from jaxserve.runtime.sampling import SamplingBatch
from jaxserve.runtime.weight_swap import match_layout, place_like
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.cost_model import work_of
from jaxserve.scheduling.offload import SwapPricer, prefill_seconds_by
from jaxserve.scheduling.request import FinishReason, Request
from jaxserve.scheduling.scheduler import Scheduler, SchedulerOutput, StepResult
from jaxserve.scheduling.types import RequestUpdate

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _InFlight:
    """A dispatched plan awaiting its update; `out` is None for a plan with nothing to run."""

    plan: SchedulerOutput
    out: object  # SampleOutput of device arrays, or None
    padded_tokens: int
    seen_done: bool = False  # the device timeline already counts it finished
    # Some row asked for logprobs / prompt logprobs (the SamplingBatch's flags): only then does
    # taking the step in look at them, row by row.
    want_logprobs: bool = False
    want_prompt_logprobs: bool = False


class Engine:
    """Continuous batching over one model on one device mesh."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        model: LoadedModel | None = None,
        *,
        runner: ModelRunner | None = None,
        budget_policy: Callable[[Engine], object | None] | None = None,
        devices: Sequence | None = None,
        mesh=None,
    ):
        """Builds the runner (builder.py) unless one built from this config is given: on the
        config's mesh, or on `devices` (a list of jax.Device) or a jax.sharding.Mesh `mesh` (a
        trainer's chips: builder.engine_mesh, docs/rl.md).

        `budget_policy(engine)`, called once the buckets are compiled, returns the policy the
        scheduler sizes steps by (the SLO policy, attached to the scheduler) or None. The core
        knows no policy of its own: `jaxserve.engine.build.build_engine` passes the one the
        config asks for (calibration.slo_policy_for), which may time steps of this engine.
        """
        self.config = config = config or EngineConfig()
        if budget_policy is None and (
            config.slo_scheduling or config.cost_model or config.calibrate_cost_model
        ):
            raise ValueError(
                f"EngineConfig asks for SLO-aware scheduling or a cost model "
                f"(slo_scheduling={config.slo_scheduling}, cost_model={config.cost_model!r}, "
                f"calibrate_cost_model={config.calibrate_cost_model}), which an Engine built "
                "without a budget policy cannot serve; build it with "
                "jaxserve.engine.build.build_engine(config)."
            )
        # Every compile in the process is counted (compiles.py); this engine's start-up ones
        # are expected, those after it break the contract of Decision 3 (docs/architecture.md).
        compiles.install()
        with compiles.warming_up():
            if runner is None:  # the model on its mesh, the KV pool sized
                runner = build_runner(config, model, devices=devices, mesh=mesh)
            self._build(config, runner, budget_policy)
        self._warm_compiles = compiles.serving()
        self._refresh_gauges()
        _freeze_heap_once()

    def _build(self, config: EngineConfig, runner: ModelRunner, budget_policy) -> None:
        """Everything `__init__` makes, all of it start-up: compiles here are expected."""
        self.runner = runner
        self.model, self.sharding = self.runner.model, self.runner.sharding
        self.tokenizer = self.model.tokenizer
        self.max_model_len = self.runner.config.max_model_len
        self.weights_version = 0  # bumped by update_weights; salts the page hashes
        self._sleeping = 0  # the level of the last sleep(), 0 while awake
        self._host_params = None  # the weights while asleep at level 2
        num_pages = self.runner.config.num_pages
        # The host KV pool (swapped requests, the prefix cache's host tier): its copies compiled
        # and the host copy rate measured now, at start-up.
        # A runner without a device pool (the host benchmark's fake device) has nothing to copy.
        pool = getattr(self.runner, "kv", None)
        num_host_pages = 0
        self.kv_bytes = 0  # the device pool's bytes, as EngineInfo reports them
        layout = self.runner.config.kv_layout  # None: uniform
        if pool is not None:
            bytes_per_page = kv_transfer.pool_bytes_per_page(pool)
            self.kv_bytes = bytes_per_page * num_pages
            if layout is None:  # the host tier copies pages without their groups
                num_host_pages = kv_transfer.host_pages_for(
                    config.host_kv_gb, bytes_per_page, num_pages
                )
        self.kv_transfer = None
        self._restores_ahead = []  # staged by the last plan, written before the next step
        if num_host_pages:
            self.kv_transfer = kv_transfer.KVTransfer(self.runner.kv, num_host_pages)
            self.runner.kv = self.kv_transfer.warm_up(self.runner.kv)
        # Copies of forked partial pages (beams, n > 1): on one host only, since the followers
        # of a multi-host mesh run nothing but the steps (multihost.py).
        self.page_copies = None
        if pool is not None and getattr(self.runner, "lockstep", None) is None:
            self.page_copies = kv_transfer.PageCopies(self.runner.kv)
            self.runner.kv = self.page_copies.warm_up(self.runner.kv)
        scheduler_config = config.scheduler_config(
            max_model_len=self.max_model_len,
            num_pages=num_pages,
            num_host_pages=num_host_pages,
            # Caches of different weights must never match (one engine, one model; the key
            # matters where pages could outlive a model swap).
            prefix_cache_key=self._prefix_cache_key(),
            kv_windows=(None,) if layout is None else layout.windows,
        )
        self.scheduler = Scheduler(
            dataclasses.replace(scheduler_config, fork_partial_pages=self.page_copies is not None)
        )
        # KV events for KV-aware routers (engine/kv_events.py, docs/kv_events.md): the scheduler
        # records the prefix cache's changes, published once an iteration. Off: no log, no
        # socket, nothing imported.
        self.kv_events = self._kv_event_log = None
        if config.kv_events_endpoint is not None:
            from jaxserve.engine.kv_events import KVEventPublisher

            self.kv_events = KVEventPublisher(
                config.kv_events_endpoint,
                config.kv_events_replay_endpoint,
                config.kv_events_topic,
                wire_format=config.kv_events_format,
            )
            self._kv_event_log = self.scheduler.record_kv_events()
        rc = self.runner.config
        self.input_batch = InputBatch(
            max_seqs=rc.seq_buckets[-1],
            pages_per_seq=rc.pages_per_seq,
            page_size=rc.page_size,
            num_pages=rc.num_pages,
            token_buckets=rc.token_buckets,
            seq_bucket_for=rc.seq_bucket_for,
            num_groups=rc.num_groups,  # a hybrid pool's page tables per sequence
        )
        # LoRA adapters in host memory (adapters.py); the device holds up to max_loras of them.
        self.adapters = Adapters(self.model.config, rc.max_loras, rc.max_lora_rank)
        for name, path in config.lora_modules.items():
            self.add_lora(name, path)
        self.metrics = EngineMetrics(config.ttft_slo_s, config.tpot_slo_s)
        self.metrics.describe_engine(
            page_size=rc.page_size,
            num_pages=num_pages,
            prefix_caching=self.scheduler.prefix is not None,
            max_loras=rc.max_loras,
        )
        # Structured output: grammars compile on the compiler's threads; each constrained
        # request's matcher lives here, by request id, until its update says it finished.
        self.grammars = GrammarCompiler(
            self.tokenizer,
            self.model.config.vocab_size,
            self.model.config.eos_token_ids,
            timeout_s=config.grammar_compile_timeout_s,
        )
        self._request_grammars: dict[str, RequestGrammar] = {}
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, self.metrics)
        # Dispatched plans awaiting their update, oldest first: at most two (the one being
        # taken in and the one just dispatched ahead of it).
        self._inflight: collections.deque[_InFlight] = collections.deque()
        self._clock = PhaseClock()  # host time of each step by phase
        self._next_id = 0
        self._warm_compiles = compiles.serving()
        if config.precompile:
            seconds = self.runner.precompile(progress=config.show_progress)
            logger.info("compiled %d buckets in %.1fs", len(self.runner.config.buckets()), seconds)
        # SLO-aware scheduling, when configured; after precompile, since measuring the step-cost
        # model at warm-up times steps of the compiled buckets.
        self.slo_policy = budget_policy(self) if budget_policy is not None else None
        if self.scheduler.config.preemption == "auto":
            self.scheduler.offload.pricer = self._swap_pricer()
        if self.scheduler.spec is not None:
            self.scheduler.set_step_cost(self._spec_step_cost(), config.async_scheduling)

    def _swap_pricer(self) -> SwapPricer:
        """Prices a swap against a recompute: the host copy rate measured at warm-up against the
        step-cost model's prefill (the SLO policy's), else timed full steps."""
        cost = getattr(self.slo_policy, "cost", None)
        budget = self.config.max_num_batched_tokens
        return SwapPricer(
            bytes_per_page=self.kv_transfer.bytes_per_page,
            host_bytes_per_s=self.kv_transfer.host_bytes_per_s,
            prefill_seconds=(
                prefill_seconds_by(cost, budget)
                if cost is not None
                else kv_transfer.timed_prefill_seconds(self.runner)
            ),
        )

    def _spec_step_cost(self):
        """What speculative decoding prices steps by (scheduling/speculation.py): the SLO
        policy's step-cost model when the engine has one, else steps of each token bucket
        timed now (`ModelRunner.time_buckets`): a bucket's decodes (every sequence slot of it
        runs the decode loop, whatever the rows) and what each verification chunk adds."""
        cost = getattr(self.slo_policy, "cost", None)
        if cost is not None:
            return lambda spans: cost.predict(work_of(spans))
        rc = self.runner.config
        buckets = rc.token_buckets
        chunk = self.config.num_speculative_tokens + 1
        # A typical context, within the pool (a small pool holds fewer slots than a context).
        context = max(1, min(256, self.max_model_len // 2, rc.num_pages * rc.page_size - chunk - 1))
        times = self.runner.time_buckets(context, chunk)
        logger.info(
            "speculative decoding prices steps at context %d (decodes / padding / a %d-token "
            "chunk): %s",
            context,
            chunk,
            ", ".join(
                f"{t}: {1e3 * d:.2f}/{1e3 * p:.2f}/{'-' if c is None else f'{1e3 * c:.2f}'} ms"
                for t, (d, p, c) in times.items()
            ),
        )

        def step_cost(spans) -> float:
            tokens = sum(n for _, n in spans)
            decode, padding, chunk_s = times[pick_bucket(buckets, min(max(tokens, 1), buckets[-1]))]
            chunks = sum(n > 1 for _, n in spans)
            # The decode loop runs only in a step that has a decode.
            base = decode if chunks < len(spans) else padding
            if chunks and chunk_s is None:
                return math.inf
            return base + chunks * (chunk_s or 0.0)

        return step_cost

    # ---- requests -------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's BOS, as the model was trained)."""
        if self.tokenizer is None:
            raise ValueError(
                f"Model {self.model.source} has no tokenizer; send prompt token ids instead."
            )
        return list(self.tokenizer(prompt)["input_ids"])

    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora: str | None = None,
    ) -> str:
        """Queues a request; raises ValueError (or scheduler's RequestRejected) if it cannot run.

        `lora` names a registered adapter (`add_lora`) the request runs with; None: the base
        model."""
        if self._sleeping:
            raise EngineAsleep(
                f"The engine is asleep (sleep(level={self._sleeping})); wake_up() before "
                "adding requests."
            )
        params = sampling_params or SamplingParams()
        self.adapters.check_name(lora)
        if params.beam_width > 1:
            raise ValueError(
                f"beam_width={params.beam_width} asks for a beam search, which runs over the "
                f"engine rather than inside one request: use LLM.beam_search or "
                f"jaxserve.engine.beam_search."
            )
        if params.seed is None:  # drawn now, so a preempted request resamples the same tokens
            params = dataclasses.replace(params, seed=random.getrandbits(32))
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("The prompt is empty.")
            ids = self.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("The prompt has no tokens.")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab}).")
        # SamplingParams bounds ids to int32 but does not know the model: a bias on an id past
        # the vocabulary would be dropped on the device without a word, and a stop id there
        # could never match.
        for name, ids_of in (
            ("logit_bias", [t for t, _ in params.logit_bias]),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = [t for t in ids_of if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"{name} token ids {bad[:5]} are outside the vocabulary [0, {vocab})."
                )
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        if request_id in self.outputs.tracked:
            raise ValueError(f"A request with id {request_id!r} is already running.")
        if params.has_penalties and jax.process_count() > 1:
            raise ValueError(
                "presence_penalty, frequency_penalty and repetition_penalty are not supported "
                f"on a multi-host mesh ({jax.process_count()} processes) yet."
            )
        grammar = None
        if params.structured_output is not None:
            if jax.process_count() > 1:
                raise ValueError(
                    "Structured output is not supported on a multi-host mesh "
                    f"({jax.process_count()} processes) yet."
                )
            # Compiled on the compiler's threads; already cached when the AsyncEngine awaited
            # it before sending the request here (grammar.py).
            grammar = self.grammars.matcher(params.structured_output)
        request = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            eos_token_ids=self.model.config.eos_token_ids,
            lora_name=lora,
            # Pages computed under an adapter are its own (docs/architecture.md, Multi-LoRA).
            cache_salt=None if lora is None else self.adapters.salt(lora),
        )
        self.scheduler.add_request(request)  # raises when it can never fit or the queue is full
        self.outputs.add(request)
        if grammar is not None:
            self._request_grammars[request_id] = grammar
        return request_id

    def add_lora(self, name: str, source) -> None:
        """Registers adapter `name` (a PEFT folder, or a models.lora.LoraAdapter) for requests
        to name; it takes a device slot when one needs it. Nothing compiles."""
        if self.runner.lockstep is not None:
            raise ValueError("LoRA adapters are not supported on a multi-host mesh yet.")
        self.adapters.register(name, source)

    def remove_lora(self, name: str) -> None:
        """Unregisters adapter `name`; ValueError while an unfinished request uses it."""
        self.adapters.check_name(name)
        # A copy first: the output thread removes finished requests meanwhile (AsyncEngine).
        tracked = list(self.outputs.tracked.values())
        users = [t.request.request_id for t in tracked if t.request.lora_name == name]
        if users:
            raise ValueError(
                f"Adapter {name!r} is in use by {len(users)} unfinished requests "
                f"({', '.join(map(repr, users[:3]))}{', ...' if len(users) > 3 else ''})."
            )
        self.scheduler.lora_slots.forget(name)
        self.adapters.unregister(name)

    def abort(self, request_id: str) -> None:
        """Ends a request at the next iteration boundary, freeing its slot and pages."""
        if request_id in self.outputs.tracked:
            self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.outputs.tracked) or bool(self._inflight)

    def has_work(self) -> bool:
        """A request the scheduler holds, or a step in flight: what `step_updates` still has
        to run, whoever makes the outputs (requests whose last update is made may still await
        their output)."""
        return self.scheduler.has_unfinished() or bool(self._inflight)

    def finish(self, request_id: str, reason: FinishReason) -> None:
        """Ends a request whose output already ended it (its stop string, found by an output
        processor off the engine thread), freeing its slot and pages; a no-op once it ended."""
        self.scheduler.finish_request(request_id, reason)
        self._request_grammars.pop(request_id, None)

    # ---- the rollout API (docs/rl.md; docs/architecture.md, "The rollout API") ------------

    def update_weights(self, params) -> list[RequestOutput]:
        """Serves `params` from now on: a param tree in the model's structure, arrays under
        their Hugging Face names (a mapping of `model.layers.0.mlp.up_proj.weight` to arrays),
        or a checkpoint folder (Hugging Face safetensors or orbax) read by the checkpoints
        loaders.

        Requests in flight are drained first: every request added before this call finishes
        on the old weights, so a rollout is sampled from one policy; their outputs from the
        drain are returned. Then the new weights are checked against the old (structure,
        shapes, dtypes: a ValueError names the offending path), placed on the old ones'
        shardings, and swapped in; the prefix cache, device and host tier, is dropped and its
        hashes salted with the new weights' version, so no page of the old weights is reused.
        Nothing compiles: the jitted step takes the params as an argument of pinned shardings.
        """
        new = self.read_weights(params)  # raises before anything changes
        outputs = []
        while self.has_unfinished():
            outputs += self.step()
        self.swap_weights(new)
        return outputs

    def read_weights(self, params) -> dict:
        """`params` (as `update_weights` takes them) as the served tree, checked and on the
        served params' shardings, nothing swapped: any thread may call it while the engine
        serves (AsyncEngine reads a folder so, off the engine thread). Raises ValueError
        naming the mismatch, or the folder it cannot read and why."""
        if self._sleeping == 2:  # its weights are on the host: nothing to place them like
            raise EngineAsleep("The engine is asleep; call wake_up() before update_weights().")
        if isinstance(params, (str, os.PathLike)) or _is_hf_named(params):
            try:
                params = load_params(params, self.model, self.sharding)
            except ModelLoadError as e:  # the caller's folder: a ValueError like the rest
                raise ValueError(str(e)) from e
        elif self.model.quant is not None:  # a trainer's float tree, in the served scheme
            # Laid out and placed as at start-up first, so the quantizers compiled then serve
            # (numpy leaves or another layout would compile them again).
            params = self.sharding.place(match_layout(params, self.runner.params))
            params = quantize_params(params, self.model.quant, self.sharding)
        return place_like(params, self.runner.params)

    def swap_weights(self, new: dict) -> None:
        """Serves `new` (from `read_weights`) from the next step on: only between steps with
        no work left (update_weights drains first; AsyncEngine holds new requests back until
        then), and while asleep at level 1 (the weights are on the device; the pool is not).
        Drops the prefix cache and salts its hashes with the new weights' version."""
        if self._sleeping == 2:
            raise EngineAsleep("The engine is asleep; call wake_up() before update_weights().")
        if self.has_work():
            raise RuntimeError(
                f"Cannot swap weights with {self.scheduler.num_running} running and "
                f"{self.scheduler.num_waiting} waiting requests; drain them first."
            )
        self.runner.params = self.model.params = new
        self.weights_version += 1
        self.scheduler.reset_prefix_cache(self._prefix_cache_key())
        self._publish_kv_events()
        self._refresh_gauges()

    def _prefix_cache_key(self) -> str:
        """What the page hash is salted with besides tokens and adapters: the model and the
        version of its weights (Decision 9)."""
        return f"{self.model.source}:{self.model.dtype}:weights-v{self.weights_version}"

    def sleep(self, level: int = 1) -> int:
        """Frees device memory while a trainer uses it: level 1 the KV pool (and the prefix
        cache it held), level 2 the weights too (kept in host memory). Returns the bytes of
        device arrays freed (jax.live_arrays before and after). Only while no request is
        unfinished; `wake_up` undoes it."""
        if level not in (1, 2):
            raise ValueError(f"sleep(level={level}) must be 1 (the KV pool) or 2 (and weights).")
        if self._sleeping:
            raise EngineAsleep("The engine is asleep already.")
        if self.has_work():  # (outputs still being made need no device memory)
            raise RuntimeError(
                f"Cannot sleep with {self.scheduler.num_running} running and "
                f"{self.scheduler.num_waiting} waiting requests; finish or abort them first."
            )
        live = _live_bytes()
        self.scheduler.reset_prefix_cache(self._prefix_cache_key())  # their pages go now
        self._publish_kv_events()
        for leaf in jax.tree.leaves(self.runner.kv):  # the engine's own: deleted at once
            leaf.delete()
        self.runner.kv = None
        self._sleep_shardings = None
        if level == 2:
            params = self.runner.params
            self._sleep_shardings = jax.tree.map(lambda a: a.sharding, params)
            self._host_params = jax.device_get(params)
            # Dropped, not deleted: a trainer that handed them to update_weights may hold the
            # same arrays (device_put onto their own sharding is a no-op), and keeps them alive.
            self.runner.params = self.model.params = params = None
        self._sleeping = level
        return live - _live_bytes()

    def wake_up(self) -> None:
        """Allocates again what `sleep` freed, the same shapes on the same shardings, and
        serves as before (the prefix cache starts empty). Nothing compiles."""
        if not self._sleeping:
            raise RuntimeError("The engine is not asleep.")
        if self._sleeping == 2:
            params = jax.device_put(self._host_params, self._sleep_shardings)
            self.runner.params = self.model.params = params
            self._host_params = None
        self.runner.kv = self.runner.new_kv_pool()
        self._sleeping = 0

    @property
    def is_sleeping(self) -> bool:
        return bool(self._sleeping)

    # ---- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns the outputs of requests that made progress or finished."""
        updates = self._iterate()
        outputs = self.outputs.process(updates)  # overlaps with the step in flight
        self._end_iteration()
        return outputs

    def step_updates(self) -> list[RequestUpdate]:
        """One iteration without its outputs: schedule, dispatch and take the last step in.

        The scheduler's updates, for `self.outputs.process` to make into outputs on another
        thread (AsyncEngine), so that the step loop does only its own work. Their order must
        be kept; the processor's `finish_request` must then reach the engine thread (`finish`).
        """
        updates = self._iterate()
        self._end_iteration()
        return updates

    def _iterate(self) -> list[RequestUpdate]:
        """Plans and dispatches the next step and takes in the ones before it: the updates."""
        self._clock.start()
        updates = []
        # Speculative decoding plans on known tokens: a verification in flight (how many of
        # its proposals it accepts decides where its request goes on), or a proposal that
        # waits for its request's pending token, makes this iteration synchronous.
        if self.config.async_scheduling and not self.scheduler.wants_known_tokens():
            # Plan and dispatch the next step first; then take in the ones before it.
            self._dispatch(self.scheduler.schedule())
            while len(self._inflight) > 1 or self._inflight[-1].out is None:
                updates += self._collect()
                if not self._inflight:
                    break
        else:
            if not self._inflight:
                self._dispatch(self.scheduler.schedule())
            while self._inflight:
                updates += self._collect()
            self._dispatch(self.scheduler.schedule())
            if self._inflight[-1].out is None:
                updates += self._collect()
        if not self._inflight:
            # The last plan was empty: nothing is in flight for want of work, so the time until
            # the next dispatch is not the device waiting on the host.
            self.metrics.device.no_work(time.perf_counter())
        return updates

    def _end_iteration(self) -> None:
        """KV events, gauges, the device timeline, and the iteration's host time by phase."""
        self._publish_kv_events()
        self._refresh_gauges()
        self._probe_done()
        if self.kv_transfer is not None:
            self.kv_transfer.poll()  # saves whose bytes reached the host land, without waiting
        self._clock.lap("outputs")
        self.metrics.on_host_step(self._clock.phases)

    def _publish_kv_events(self) -> None:
        """Hands the prefix cache's events since the last call to the publisher, one batch,
        without waiting; after a dropped batch, a snapshot of the whole cache instead."""
        if self._kv_event_log is not None:
            self.kv_events.publish_log(self._kv_event_log)

    def close(self) -> None:
        """Releases what the engine holds outside its arrays: the KV events' sockets, if open
        (their queued batches are sent first)."""
        if self.kv_events is not None:
            self.kv_events.close()

    def _probe_done(self) -> None:
        """Tells the device timeline which steps in flight are done, without waiting for them
        (the caller's time until the next `step()` is then device idle, not busy)."""
        for flight in self._inflight:  # they finish in order: stop at the first still running
            if flight.seen_done or flight.out is None:
                continue
            is_ready = getattr(flight.out.token_ids, "is_ready", None)  # numpy: always ready
            if is_ready is not None and not is_ready():
                return
            flight.seen_done = True
            self.metrics.device.finished(time.perf_counter())

    def _dispatch(self, plan: SchedulerOutput) -> None:
        """Packs the plan and starts it on the device, without waiting; queues it for its update.

        An empty plan has nothing to run but may carry aborts: its update follows the plans
        before it.
        """
        now = self._clock.lap("schedule")  # the plan was made just before this call
        # Page copies (kv_transfer.py): the restores the last plan staged are written before
        # this step, the first their requests run in; this plan's wait for the next step.
        if self._restores_ahead:
            self.runner.kv = self.kv_transfer.write(self.runner.kv, self._restores_ahead)
            self._restores_ahead = []
        if plan.swap_out or plan.swap_in:
            self._restores_ahead = self.kv_transfer.copy(
                self.runner.kv, plan.swap_out, plan.swap_in
            )
        # Forked partial pages, after the saves' reads: a fork's destination may be a page
        # this plan evicted, whose old content the host tier is saving (offload.forked).
        if plan.page_copies:
            self.runner.kv = self.page_copies.run(self.runner.kv, plan.page_copies)
        # A step that finished while this one was planned (or packed, below) starts the device's
        # wait there, not at the next look, which would come after this dispatch and miss it.
        self._probe_done()
        if not plan.seqs:
            if not self._inflight:
                # Idle for want of work, not waiting on the host: not device idle time.
                self.metrics.device.no_work(now)
            self._inflight.append(_InFlight(plan, None, 0, seen_done=True))
            return
        for slot, name in plan.lora_loads:  # before the step that reads them (dispatch order)
            self.runner.set_lora_slot(slot, self.adapters.get(name))
        step = self.input_batch.pack(plan.seqs)
        sampling = step.sampling
        for row in step.special_rows.tolist():  # logit bias, min_tokens, penalties: rare rows
            self._fill_special_row(sampling, row, plan.seqs[row])
        mask = None
        if step.constrained_rows.size:  # grammar rows: their allowed tokens, the rest all ones
            mask = self._token_mask(step.constrained_rows, plan.seqs, len(sampling.temperature))
        self._clock.lap("pack")
        self._probe_done()
        out = self.runner.execute(step.batch, sampling, step.words, mask)
        # In flight only once the dispatch (and its copy to the device) has returned.
        self.metrics.device.dispatched(self._clock.lap("dispatch"))
        self._inflight.append(
            _InFlight(
                plan,
                out,
                len(step.batch.token_ids),
                want_logprobs=bool(sampling.want_logprobs),
                want_prompt_logprobs=bool(sampling.want_prompt_logprobs),
            )
        )

    def _fill_special_row(self, sb: SamplingBatch, row: int, seq) -> None:
        """Row `row`'s logit bias, min_tokens mask and penalties (a request that asked for them).

        A request with penalties fills its slot's counts on the device when it takes the slot.
        """
        request = seq.request
        p = request.sampling_params
        if p.logit_bias or p.min_tokens:
            _fill_bias(sb, row, request, int(sb.positions[row]))
        if p.has_penalties:
            tracked = self.outputs.tracked.get(seq.request_id)
            if tracked is None:  # its output ended it already: this step's token is dropped
                return
            here = (seq.slot, request.num_preemptions)
            if tracked.penalty_row != here:
                # Everything known so far (nothing is pending when a request takes a slot): the
                # step that samples next sees all of it.
                self.runner.set_penalty_row(
                    seq.slot, request.all_token_ids, request.num_prompt_tokens
                )
                tracked.penalty_row = here
            sb.presence_penalty[row] = p.presence_penalty
            sb.frequency_penalty[row] = p.frequency_penalty
            sb.repetition_penalty[row] = p.repetition_penalty
            sb.count_sampled[row] = seq.sample

    def _token_mask(self, rows: np.ndarray, seqs, num_seqs: int) -> np.ndarray:
        """The step's token bitmask (i32[num_seqs, W]): each grammar row's allowed tokens, every
        token for the other rows (which then sample as without a mask).

        A new array per step: the device may read a host array in place while the step runs.
        A grammar row is never planned while its token is pending (running.py), so its
        request's outputs are all known here and its matcher follows them first.
        """
        mask = np.full((num_seqs, self.runner.mask_words), -1, np.int32)
        address = mask.ctypes.data
        for row in rows.tolist():
            seq = seqs[row]
            grammar = self._request_grammars.get(seq.request_id)
            if grammar is None:  # ended since its plan (an abort): its token is dropped
                continue
            if not grammar.sync(seq.request.output_token_ids):
                # Only a token the mask forbade could do this: a bug, not the client's input.
                logger.error(
                    "Request %s: its grammar refused a token: %s", seq.request_id, grammar.error
                )
                seq.request.status_message = f"The grammar refused a token: {grammar.error}"
                self.scheduler.abort_request(seq.request_id, FinishReason.ERROR)
                continue
            grammar.fill(mask, row, address)
        return mask

    def _collect(self) -> list:
        """Waits for the oldest step in flight and applies its tokens to the scheduler."""
        flight = self._inflight[0]
        plan = flight.plan
        if flight.out is None:  # an empty plan: nothing ran
            self._inflight.popleft()
            updates = self.scheduler.update(plan, StepResult(sampled_token_ids=[]))
            self._drop_grammars(updates)
            self._clock.lap("collect")
            return updates
        if not flight.seen_done:
            # The same wait device_get would do, split off so the copy back counts as idle.
            jax.block_until_ready(flight.out.token_ids)
            flight.seen_done = True
            self.metrics.device.finished(self._clock.lap("wait"))
        self._inflight.popleft()
        out = flight.out
        seqs = plan.seqs
        n = len(seqs)
        # The step's one copy to the host; plain ints, and rows that do not sample are ignored.
        sampled = np.asarray(out.token_ids)
        tokens = sampled[:n].tolist()
        verified = None
        if plan.num_proposed:  # rows of tokens, one per output position (`_verified_rows`)
            verified = _verified_rows(seqs, np.asarray(out.num_accepted))
            for i, rows in verified.items():
                tokens[i] = sampled[rows].tolist()
        logprobs = None
        if flight.want_logprobs:
            asked = [s.sample and s.request.sampling_params.logprobs is not None for s in seqs]
            host = jax.device_get(dataclasses.replace(out, **_NO_PROMPT_LOGPROBS))
            logprobs = [
                _logprob_of(host, i, s) if a else None
                for i, (s, a) in enumerate(zip(seqs, asked, strict=True))
            ]
            for i, rows in (verified or {}).items():
                if asked[i]:
                    logprobs[i] = [_logprob_of(host, r, seqs[i]) for r in rows]
        if verified:
            accepted = sum(len(rows) - 1 for rows in verified.values())
            self.metrics.on_speculation(
                proposed=plan.num_proposed, accepted=accepted, verifications=len(verified)
            )
        if flight.want_prompt_logprobs:
            self._take_prompt_logprobs(out, seqs)
        if out.expert_load is not None:  # a mixture of experts: [layers, experts], a few KB
            self.metrics.on_expert_load(np.asarray(out.expert_load))
        updates = self.scheduler.update(
            plan, StepResult(sampled_token_ids=tokens, logprobs=logprobs), now=time.monotonic()
        )
        self._drop_grammars(updates)
        generated = plan.num_sampled
        if verified:
            generated += sum(len(rows) - 1 for rows in verified.values())
        real = plan.num_batched_tokens
        self.metrics.on_step(
            real_tokens=real,
            padded_tokens=flight.padded_tokens,
            prompt_tokens=real - plan.num_sampled - plan.num_proposed,
            generated=generated,
        )
        self._clock.lap("collect")
        return updates

    def _drop_grammars(self, updates) -> None:
        """Forgets the matchers of the requests these updates finished."""
        if self._request_grammars:
            for update in updates:
                if update.finished:
                    self._request_grammars.pop(update.request.request_id, None)

    def _take_prompt_logprobs(self, out, seqs) -> None:
        """Copies the prompt logprobs of the rows that asked into their requests' lists.

        The [T] and [T, 20] arrays cross to the host only when some row of the step asked.
        """
        rows = [
            (i, s, tracked)
            for i, s in enumerate(seqs)
            if s.request.sampling_params.prompt_logprobs is not None
            and s.start_pos < s.request.num_prompt_tokens - 1
            and (tracked := self.outputs.tracked.get(s.request_id)) is not None
            and tracked.request is s.request
            and not tracked.prompt_logprobs_sent  # a recomputed prompt after a preemption
        ]
        if not rows:
            return
        lp, ids, top = jax.device_get(
            (out.prompt_logprobs, out.prompt_top_ids, out.prompt_top_logprobs)
        )
        starts = np.cumsum([0] + [len(s.token_ids) for s in seqs])  # each row's first token
        for i, seq, tracked in rows:
            prompt = seq.request.prompt_token_ids
            if tracked.prompt_logprobs is None:
                tracked.prompt_logprobs = [None] * len(prompt)
            k = seq.request.sampling_params.prompt_logprobs
            # Token j of the chunk (position start_pos + j) scores the prompt token after it.
            last = min(seq.end_pos, len(prompt) - 1)
            for pos in range(seq.start_pos, last):
                t = starts[i] + pos - seq.start_pos
                top_k = list(zip(ids[t, :k].tolist(), top[t, :k].tolist(), strict=True))
                tracked.prompt_logprobs[pos + 1] = TokenLogprob(
                    prompt[pos + 1], float(lp[t]), top_k
                )

    # ---- outputs --------------------------------------------------------------------------

    def _refresh_gauges(self) -> None:
        s = self.scheduler
        self.metrics.set_gauges(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            slots_used=s.num_slots_used,
            kv_pages_used=s.num_pages_used,
            kv_pages_total=self.runner.config.num_pages,
            kv_pages_cached=s.kv.num_cached_pages,
        )
        if s.lora_slots is not None:  # the engine's start set the no-adapter state for good
            self.metrics.set_lora_adapters(*s.lora_adapters())
        cache = s.kv.stats
        self.metrics.on_prefix_cache(
            queries=cache.queries, hits=cache.hits, evictions=cache.evictions
        )
        self.metrics.on_preemptions(s.num_preemptions)
        host = s.offload.host
        self.metrics.on_kv_offload(
            vars(host.stats),  # copied only when it changed: asdict would cost every step
            host_kv_pages_total=host.num_pages,
            host_kv_pages_used=host.num_used_pages,
            host_kv_pages_swapped=host.num_swapped_pages,
            host_kv_bytes=0 if self.kv_transfer is None else self.kv_transfer.host_bytes,
        )
        # Every compile of the process, and those outside any warm-up since this one's.
        self.metrics.on_compiles(compiles.total(), compiles.serving() - self._warm_compiles)


class EngineAsleep(RuntimeError):
    """The engine sleeps (Engine.sleep): it runs no request and takes no weights until
    `wake_up()`. A server answers it as unavailable (HTTP 503, gRPC UNAVAILABLE)."""


def _is_hf_named(params) -> bool:
    """Whether `params` holds arrays under Hugging Face names ("model.norm.weight", ...) rather
    than the model's own tree (whose keys, "layers_0" or "embed_tokens", have no dots)."""
    return isinstance(params, Mapping) and bool(params) and all("." in str(k) for k in params)


def _live_bytes() -> int:
    """Bytes of every device array alive in the process (what sleep() frees is their drop)."""
    return sum(a.nbytes for a in jax.live_arrays())


def freeze_heap() -> None:
    """Puts every object alive now out of the garbage collector's reach; call it once the
    engine is built and warm, in a process that then serves.

    Importing JAX, flax and transformers and building an engine leaves ~600k objects that the
    collector tracks, and a full collection walks all of them: 1.1 s in the middle of serving
    3,000 requests through the AsyncEngine (fake device, busy 2-core machine; the same walk
    took 0.4-1.7 s on its own), a stall every running stream sees as one very late token.
    They live as long as the process serves, so freezing them loses nothing; objects made
    later are collected as before, and what dies is still freed by reference counting.

    Collected first, so no garbage is frozen. The first engine of a process calls it when
    built (what `serve` and `batch` rely on); call it again after building several (the bench).
    Not after every engine of a process that builds and drops many (tests, notebooks): a dropped
    engine's reference cycles (its runner's) would be frozen too, and never freed.
    """
    gc.collect()
    gc.freeze()


_heap_frozen = False


def _freeze_heap_once() -> None:
    """`freeze_heap` for the first engine of a process only, so that a process that builds and
    drops engines keeps at most the first one's reference cycles for good."""
    global _heap_frozen
    if not _heap_frozen:
        _heap_frozen = True
        freeze_heap()


# What the generated tokens' logprobs do not need of a step's SampleOutput: left on the device.
_NO_PROMPT_LOGPROBS = dict(prompt_logprobs=None, prompt_top_ids=None, prompt_top_logprobs=None)


def _verified_rows(seqs, accepted: np.ndarray) -> dict[int, list[int]]:
    """For each verification row i of a plan, the sampling rows of the tokens it adds, in
    order: its accepted proposals' extra rows, then the row of the token after them (the first
    rejected proposal's, or row i itself when all were accepted). The extra rows follow the
    sequences in plan order (InputBatch._pack_proposals); accepted: i32[S] per sequence row."""
    rows, extra = {}, len(seqs)
    for i, seq in enumerate(seqs):
        k = seq.num_proposals
        if not k:
            continue
        a = int(accepted[i])
        rows[i] = [*range(extra, extra + a), extra + a if a < k else i]
        extra += k
    return rows


def _logprob_of(host, row: int, seq) -> TokenLogprob:
    """Row `row`'s chosen-token logprob and top-n, as its request asked (host: SampleOutput).

    A token masked out (a grammar's mask, min_tokens' EOS) has logprob -inf: it could not have
    been chosen, so it is not an alternative, and the top-n lists only the tokens that could
    (fewer than n where fewer are allowed). -inf is not JSON either (RFC 8259)."""
    n = seq.request.sampling_params.logprobs
    top = [(int(host.top_ids[row, j]), float(host.top_logprobs[row, j])) for j in range(n)]
    top = [(token_id, logprob) for token_id, logprob in top if logprob != -math.inf]
    return TokenLogprob(int(host.token_ids[row]), float(host.logprobs[row]), top)


def _fill_bias(sb: SamplingBatch, row: int, request: Request, position: int) -> None:
    """Row `row`'s bias slots: its logit_bias, and -inf on the ids that would end it while its
    output (the token at `position` is output number position - prompt length) is shorter than
    min_tokens."""
    p = request.sampling_params
    bias = list(p.logit_bias)
    if position - request.num_prompt_tokens < p.min_tokens:
        eos = () if p.ignore_eos else request.eos_token_ids
        bias += [(t, -np.inf) for t in dict.fromkeys((*eos, *p.stop_token_ids))]
    bias = bias[: sb.bias_ids.shape[1]]  # SamplingParams bounds both lists to fit
    if bias:
        ids, values = zip(*bias, strict=True)
        sb.bias_ids[row, : len(ids)] = ids
        sb.bias_values[row, : len(values)] = values
