"""`jaxserve bench --profile host`: the engine's host work per step, apart from the device.

On an accelerator a small model's step takes a few milliseconds, and the host's work per step
(scheduling, packing, dispatch, taking the result in, building outputs) decides how much of that
time the device waits. On the CPU the two cannot be told apart by timing whole steps, so this
profile runs the real `Engine` (scheduler, KV pages, packing, sampling batch, outputs) over a
runner whose device call costs nothing: `HostOnlyRunner` keeps `ModelRunner`'s `pack` and
`execute` and replaces only `_dispatch`, the device call. By default that call is a trivial jitted
function of the very same inputs (the step's one int32 array crosses to the device and is
unpacked there, and the tokens come back as a device array, so dispatch and transfers are
measured as for the real step); it returns next = last + 1 for
each row at once, or `step_time_s` later to stand in for a device of that speed.

For each number of running decode requests (1/16/64/256/1024 by default) the engine is filled,
every request taken past its prefill, then `steps` steady decode steps are timed: the step's wall
time and the engine's own per-phase host clock (`Engine.step`'s `PhaseClock`, the same one behind
the `jaxserve_host_step_seconds` histogram), and the device-idle time of its `DeviceTimeline`.
With `step_time_s`, the fake device also keeps its own clock of the time its queue sat empty
before a dispatch ("fake device idle"): the engine sees a step done only when it next looks, so
the timeline's reading is a lower bound, and the fake's is the time the device really waited.
No model weights are compiled; the model's config (and only its vocabulary and EOS ids matter)
comes from `--model`, the embedded stories260k by default. Outputs are token ids unless
`detokenize` (`--detokenize`): then every request also streams text through the model's
tokenizer, as a serving engine does. Numbers are of one run on one machine:
compare them within a run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.build import build_engine
from jaxserve.engine.core import Engine
from jaxserve.engine.metrics import HOST_PHASES
from jaxserve.engine_config import EngineConfig
from jaxserve.models.loaded import LoadedModel
from jaxserve.models.sharding import ShardingPlan
from jaxserve.models.step_batch import StepBatch, StepWords, from_words, to_words
from jaxserve.runtime.builder import build_runner
from jaxserve.runtime.model_runner import ModelRunner, RunnerConfig
from jaxserve.runtime.sampling import MAX_TOP_LOGPROBS, SampleOutput, SamplingBatch
from jaxserve.sampling_params import SamplingParams

RUNNING = (1, 16, 64, 256, 1024)
# The phases the device waits on in a synchronous loop: from a result on the host to the next
# dispatch. `outputs` runs while the next step is in flight; `wait` is device time.
CRITICAL_PHASES = ("collect", "schedule", "pack", "dispatch")

# (batch, sampling) -> i32[S] sampled token per row, computed on the host.
NextTokens = Callable[[StepBatch, SamplingBatch], np.ndarray]


class _Delayed:
    """A result leaf that becomes ready at `ready_at` (perf_counter): a device of a given speed.

    It answers the calls the engine makes on a device array: a readiness probe, a blocking
    wait, and the copy to the host (`__array__`, which waits too).
    """

    def __init__(self, value, ready_at: float):
        self.value = value  # i32[S] sampled tokens (numpy or a jax.Array)
        self.ready_at = ready_at

    def is_ready(self) -> bool:
        return time.perf_counter() >= self.ready_at

    def block_until_ready(self) -> _Delayed:
        left = self.ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return self

    def __array__(self, dtype=None, copy=None):
        self.block_until_ready()
        return np.asarray(self.value, dtype=dtype)


class HostOnlyRunner(ModelRunner):
    """`ModelRunner` whose device call costs nothing: no params, no KV pool, no model compiled.

    `pack`, `execute` and the bucket ladders are the real ones; only `_dispatch` differs. With
    `next_tokens` the tokens are computed in numpy on the host (tests replay a real run that
    way); without it a jitted echo of the step's inputs runs on the device.
    """

    def __init__(
        self,
        model: LoadedModel,
        config: RunnerConfig,
        sharding: ShardingPlan | None = None,
        *,
        step_time_s: float = 0.0,
        next_tokens: NextTokens | None = None,
    ):
        # Deliberately not ModelRunner.__init__: it would place params and allocate the pool.
        self.model, self.config, self.sharding = model, config, sharding
        self.num_compiles = 0
        self.lockstep = None  # one host: nothing to send to followers
        self.step_time_s = step_time_s
        self.next_tokens = next_tokens
        # Each slot's last sampled token, as the real runner keeps it to feed pending tokens.
        self.last_tokens = np.zeros(config.seq_buckets[-1], np.int32)
        self._busy_until = 0.0  # perf_counter when the fake device finishes its queued steps
        # Seconds the fake device sat with its queue empty before a dispatch: its own clock of
        # the time it waited on the host (DeviceTimeline's reading is a lower bound of this).
        self.device_idle_s = 0.0
        self._echo = jax.jit(
            functools.partial(self._echo_impl, vocab_size=model.config.vocab_size),
            static_argnums=(2,),
            keep_unused=True,  # every input crosses to the device, as for the real step
            donate_argnums=(1,),
        )

    def _echo_impl(self, words: jax.Array, last: jax.Array, layout: tuple, *, vocab_size: int):
        self.num_compiles += 1  # runs only while tracing
        batch, _ = from_words(words, layout)  # unpacked as the real step does it
        tokens = jnp.where(batch.feed_slots >= 0, last[batch.feed_slots], batch.token_ids)
        nxt = (tokens[batch.logits_indices] + 1) % vocab_size  # i32[S] each row's last token + 1
        return _sample_output(nxt, jnp), last.at[batch.sample_slots].set(nxt, mode="drop")

    def _dispatch(
        self,
        batch: StepBatch,
        sampling: SamplingBatch,
        words: StepWords | None = None,
        mask: np.ndarray | None = None,  # grammar rows' allowed tokens: the echo ignores them
    ) -> SampleOutput:
        if self.next_tokens is None:
            words = words or to_words((batch, sampling))  # one array crosses, as for the real step
            out, self.last_tokens = self._echo(words.words, self.last_tokens, words.layout)
        else:
            last = np.asarray(self.last_tokens)
            fed = np.where(batch.feed_slots >= 0, last[batch.feed_slots], batch.token_ids)
            batch = dataclasses.replace(batch, token_ids=fed.astype(np.int32))
            tokens = np.asarray(self.next_tokens(batch, sampling), np.int32)
            self.last_tokens = last.copy()
            keep = batch.sample_slots < len(last)
            self.last_tokens[batch.sample_slots[keep]] = tokens[keep]
            out = _sample_output(tokens, np)
        if self.step_time_s > 0:
            # One step at a time, as on a device: a step queued behind another starts after it.
            now = time.perf_counter()
            if self._busy_until:
                self.device_idle_s += max(0.0, now - self._busy_until)
            ready_at = max(now, self._busy_until) + self.step_time_s
            self._busy_until = ready_at
            out = dataclasses.replace(out, token_ids=_Delayed(out.token_ids, ready_at))
        return out

    def precompile(self, progress: bool = True) -> float:
        """Nothing to compile ahead: the echo compiles per bucket on first use (milliseconds)."""
        return 0.0


def _sample_output(tokens, xp) -> SampleOutput:
    """A SampleOutput of `tokens` (i32[S]) with empty logprobs, in numpy or jax.numpy (`xp`)."""
    rows = tokens.shape[0]
    return SampleOutput(
        token_ids=tokens.astype(xp.int32),
        logprobs=xp.zeros(rows, xp.float32),
        top_ids=xp.zeros((rows, MAX_TOP_LOGPROBS), xp.int32),
        top_logprobs=xp.zeros((rows, MAX_TOP_LOGPROBS), xp.float32),
    )


def host_engine(
    config: EngineConfig,
    model: LoadedModel,
    *,
    step_time_s: float = 0.0,
    next_tokens: NextTokens | None = None,
) -> Engine:
    """The real `Engine` of `config` over a `HostOnlyRunner` (config.num_pages must be set).

    The runner is built as the engine's own would be (builder.py), of another class.
    """
    if config.num_pages is None:
        raise ValueError("A host-only engine needs config.num_pages: it has no memory to size.")
    config = dataclasses.replace(config, precompile=False)
    runner_class = functools.partial(
        HostOnlyRunner, step_time_s=step_time_s, next_tokens=next_tokens
    )
    return build_engine(config, runner=build_runner(config, model, runner_class))


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostSpec:
    """What `run_host` measures and how."""

    model: str | None = None
    running: tuple[int, ...] = RUNNING
    context: int = 1024  # prompt tokens of each request
    steps: int = 32  # steady decode steps timed per point
    warmup: int = 4  # steps run (the echo's bucket compiles) before timing
    step_time_s: float = 0.0
    page_size: int = 16
    seed: int = 0
    command: str = ""
    # False: each step planned after the last one's tokens are on the host (for comparison).
    async_scheduling: bool = True
    detokenize: bool = False  # outputs carry text through the model's tokenizer


def run_host(spec: HostSpec, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measures every point; returns the report `jaxserve bench` saves."""
    from checkpoints import load_model

    model = load_model(spec.model, dtype="float32", seed=spec.seed)
    if not spec.detokenize:  # token ids only: the host loop without the tokenizer
        model = dataclasses.replace(model, tokenizer=None)
    elif model.tokenizer is None:
        raise ValueError(f"--detokenize needs a tokenizer, and model {model.source} has none.")
    points = []
    for running in spec.running:
        point = _time_point(spec, model, running)
        points.append(point)
        log(
            f"{running} running: {point['step_us']:.0f} us/step, host {point['host_us']:.0f} us, "
            f"device waits {point['device_idle_us']:.0f} us"
        )
    return {
        "command": spec.command,
        "model": model.source,
        "platform": jax.devices()[0].platform,
        "step_time_s": spec.step_time_s,
        "async_scheduling": spec.async_scheduling,
        "detokenize": spec.detokenize,
        "context": spec.context,
        "steps": spec.steps,
        "load_avg_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "points": points,
    }


def _time_point(spec: HostSpec, model: LoadedModel, running: int) -> dict[str, Any]:
    """One engine with `running` decoding requests: host microseconds per step by phase."""
    # Prefill costs the fake nothing but steps: a large budget fills 1024 long prompts quickly,
    # so the first requests decode few tokens (and their context grows little) meanwhile.
    budget = max(8192, 2 * running)
    fill_steps = math.ceil(running * spec.context / (budget - running)) + 2
    max_tokens = fill_steps + spec.warmup + spec.steps + 8  # never reached while timed
    max_model_len = spec.context + max_tokens
    # The fake never runs the model, so its context limit is lifted to the one asked.
    mc = dataclasses.replace(
        model.config,
        max_position_embeddings=max(model.config.max_position_embeddings, max_model_len),
    )
    config = EngineConfig(
        max_num_seqs=running,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        page_size=spec.page_size,
        num_pages=running * math.ceil(max_model_len / spec.page_size),
        async_scheduling=spec.async_scheduling,
        show_progress=False,
        compilation_cache_dir=None,
    )
    engine = host_engine(
        config, dataclasses.replace(model, config=mc), step_time_s=spec.step_time_s
    )
    rng = np.random.default_rng(spec.seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, ignore_eos=True)
    for i in range(running):
        ids = rng.integers(3, mc.vocab_size, size=spec.context).tolist()
        engine.add_request(ids, dataclasses.replace(params, seed=i))
    started: set[str] = set()
    while len(started) < running:  # every request past its prefill
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    for _ in range(spec.warmup):  # the decode bucket's echo compiles here, not when timed
        engine.step()
    stats = engine.metrics.stats
    before = _snapshot(stats)
    fake_idle = engine.runner.device_idle_s
    walls = np.empty(spec.steps)
    for i in range(spec.steps):
        start = time.perf_counter()
        engine.step()
        walls[i] = time.perf_counter() - start
    after = _snapshot(stats)
    fake_idle = engine.runner.device_idle_s - fake_idle
    if after["generation_tokens"] - before["generation_tokens"] != running * spec.steps or (
        after["prompt_tokens"] != before["prompt_tokens"]
    ):
        raise RuntimeError(
            f"The timed steps of {running} running requests were not all decode-only steps of "
            f"{running} tokens ({before} -> {after})."
        )
    phases_us = {
        p: (after["phases"][p] - before["phases"][p]) / spec.steps * 1e6 for p in HOST_PHASES
    }
    idle = after["idle"] - before["idle"]
    busy = after["busy"] - before["busy"]
    return {
        "running": running,
        # Mean tokens per request in the cache over the timed steps.
        "context": spec.context
        + (before["generation_tokens"] + after["generation_tokens"]) / (2 * running),
        "step_us": float(walls.mean() * 1e6),
        "step_p50_us": float(np.median(walls) * 1e6),
        "phases_us": phases_us,
        "host_us": sum(v for p, v in phases_us.items() if p != "wait"),
        "critical_us": sum(phases_us[p] for p in CRITICAL_PHASES),
        "device_idle_us": idle / spec.steps * 1e6,
        # With a step time: the fake device's own idle time per step (None without one).
        "fake_device_idle_us": fake_idle / spec.steps * 1e6 if spec.step_time_s > 0 else None,
        "device_idle_share": idle / (idle + busy) if idle + busy else 0.0,
    }


def _snapshot(stats) -> dict[str, Any]:
    return {
        "phases": dict(stats.host_phase_s),
        "generation_tokens": stats.generation_tokens,
        "prompt_tokens": stats.prompt_tokens,
        "idle": stats.device_idle_s,
        "busy": stats.busy_wall_s,
    }


def format_host(report: dict[str, Any]) -> str:
    """The table printed to stdout: microseconds per step by phase at each batch."""
    lines = [
        f"host overhead: model {report['model']} (config only, no weights run), "
        f"fake step time {report['step_time_s'] * 1e3:g} ms, {report['steps']} steps/point, "
        f"{'asynchronous' if report.get('async_scheduling', True) else 'synchronous'} "
        "scheduling, "
        f"{'text' if report.get('detokenize') else 'token ids'} out, "
        f"load {report['load_avg_1m']:.1f} on {report['cpus']} CPUs",
        "",
        "| running | context | step us | " + " | ".join(HOST_PHASES) + " | host us | "
        "device waits us | idle share | fake device idle us |",
        "|" + "---:|" * (len(HOST_PHASES) + 7),
    ]
    for p in report["points"]:
        phases = " | ".join(f"{p['phases_us'][name]:.0f}" for name in HOST_PHASES)
        lines.append(
            f"| {p['running']} | {p['context']:.0f} | {p['step_us']:.0f} | {phases} | "
            f"{p['host_us']:.0f} | {p['device_idle_us']:.0f} | {p['device_idle_share']:.2f} | "
            + ("-" if p.get("fake_device_idle_us") is None else f"{p['fake_device_idle_us']:.0f}")
            + " |"
        )
    return "\n".join(lines)
