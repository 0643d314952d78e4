"""Measures the step-cost model on a live engine: the one calibration jaxserve has.

`jaxserve bench --profile steps` runs it on an engine of its own (bench/steps.py), and an
engine runs a shorter one at warm-up when SLO-aware scheduling has no cost model file that
applies (`EngineConfig.calibrate_cost_model`, `slo_policy_for` below). Both time steps as
the engine loop runs them (`recording_steps`) while requests of fresh random ids go through its
public add_request / step: decode-only batches of every size of the ladder at a few contexts,
then a stream of prompts whose chunks share steps with decodes, so every token bucket is
stepped with small and large attention. The samples are fitted by cost_model.fit.

Warm-up cost: `WARM_UP` runs 2 x log2(rows) decode-only batches, whose rows decode 4 tokens
together once the batch has prefilled, and one mixed prompt per row, a few steps per token
bucket; the calibration's requests and their counters are forgotten afterwards (`forget`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np

from jaxserve import target
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling import cost_model, slo_policy

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """Which steps a calibration times."""

    # Prompt tokens of the decode-only batches (clipped to the engine's context), and the tokens
    # each generates. Static and dynamic batches end in decode steps of a few rows at long
    # contexts, and the next group waits for them: their simulated TTFT moved 10% for 15% on
    # those steps' cost, so the full calibration times many of them, up to long contexts.
    contexts: tuple[int, ...] = (32, 128, 512, 768)
    decode_tokens: int = 24
    mixed_per_row: float = 3.0  # prompts of the mixed stream, per row of the engine
    max_mixed_output: int = 32  # outputs of the mixed stream's requests: 2 to this many
    seed: int = 0


# At warm-up: fewer, shorter requests (a few steps per bucket), still both kinds of step.
WARM_UP = Calibration(contexts=(16, 128), decode_tokens=4, mixed_per_row=1.0, max_mixed_output=8)


def feature_set(engine) -> str:
    """The cost model's terms for `engine`'s attention (cost_model.FEATURE_SETS): the CPU's
    tiled attention costs by its loops' trips, a kernel by the pairs it attends."""
    from jaxserve.models.attention import resolve_backend

    return "tiles" if resolve_backend(engine.runner.config.attention_backend) == "xla" else "pairs"


def cost_key(engine) -> cost_model.CostKey:
    """The key a cost model measured on `engine` carries (and a loaded one must match)."""
    return cost_model.CostKey(
        model=engine.model.source,
        dtype=str(np.dtype(engine.model.dtype)),
        device_kind=target.current().device_kind,
        token_buckets=tuple(engine.runner.config.token_buckets),
    )


@contextlib.contextmanager
def recording_steps(
    engine, spans: list[list[tuple[int, int]]] | None = None
) -> Iterator[list[cost_model.StepSample]]:
    """Yields a list that, when the block ends, holds one sample per step the engine ran in it
    (and fills `spans`, when given, with each sample's chunks as (start_pos, num_tokens), for
    fitting other features to the same steps offline).

    The engine plans once per loop iteration, so the interval between two plans is what one
    step held the loop (its device time, or the host's when longer), which is what a request
    waits for. Which step: synchronous, a plan is made right after the previous step's tokens
    came back, so the interval after plan k is step k's; asynchronous, plan k+1 is made before
    step k is waited for, so step k's interval is the one after plan k+1. Intervals touching an
    empty plan (the engine idled) are not counted.
    """
    scheduler = engine.scheduler
    schedule = scheduler.schedule
    lag = 1 if getattr(engine.config, "async_scheduling", False) else 0
    calls: list[tuple[float, cost_model.StepWork | None]] = []  # (perf_counter, work) per plan
    chunks: list[list[tuple[int, int]]] = []  # per plan, with `spans`

    def timed(now=None):
        plan = schedule(now)
        feats = cost_model.plan_features(plan) if plan.seqs else None
        calls.append((time.perf_counter(), feats))
        if spans is not None:
            chunks.append([(s.start_pos, len(s.token_ids)) for s in plan.seqs])
        return plan

    samples: list[cost_model.StepSample] = []
    outer = scheduler.__dict__.get("schedule")  # a recording around this one, if any
    scheduler.schedule = timed
    try:
        yield samples
    finally:
        if outer is None:
            del scheduler.schedule  # the class's method again
        else:
            scheduler.schedule = outer
    for k in range(len(calls) - lag - 1):
        window = calls[k : k + lag + 2]
        if all(feats is not None for _, feats in window):
            start, end = window[-2][0], window[-1][0]
            samples.append(cost_model.StepSample(calls[k][1], end - start))
            if spans is not None:
                spans.append(chunks[k])


def calibrate(
    engine, spec: Calibration = WARM_UP, log: Callable[[str], None] | None = None
) -> cost_model.CostModel:
    """Times steps of every token bucket of `engine` (module docstring); returns the fit."""
    rows = engine.config.max_num_seqs
    budget = engine.config.max_num_batched_tokens
    room = engine.max_model_len - spec.decode_tokens
    contexts = sorted({max(1, min(c, room)) for c in spec.contexts})
    rng = np.random.default_rng(spec.seed)
    names = (f"calibrate-{i}" for i in range(1 << 62))
    start = time.perf_counter()
    with recording_steps(engine) as samples:
        # Decode-only steps: every batch of the ladder, at each context. The batch's prompts
        # prefill a budget at a time, so each request decodes as many steps longer as that
        # takes: its rows then all decode together, at the batch's size (serving's commonest
        # step, a full batch decoding at long contexts, was otherwise never timed).
        for ctx in contexts:
            b = 1
            while b <= rows:
                wait = -(-b * ctx // budget)
                tokens = min(spec.decode_tokens + wait, engine.max_model_len - ctx)
                for _ in range(b):
                    _request(engine, next(names), ctx, tokens, rng)
                drain(engine)
                b *= 2
        # Mixed steps: prompts of random lengths arriving while others decode, so prefill
        # chunks of every size share steps with decode batches of every size.
        longest = max(contexts)
        most = max(2, min(spec.max_mixed_output, engine.max_model_len - longest))
        for _ in range(max(1, round(spec.mixed_per_row * rows))):
            prompt = int(rng.integers(min(8, longest), longest + 1))
            _request(engine, next(names), prompt, int(rng.integers(2, most + 1)), rng)
            for _ in range(int(rng.integers(0, 3))):
                engine.step()
        drain(engine)
    if log is not None:
        log(f"cost model: {len(samples)} steps timed in {time.perf_counter() - start:.1f}s")
    runner = engine.runner.config
    slots = {b: runner.seq_bucket_for(b) for b in runner.token_buckets}
    return cost_model.fit(samples, cost_key(engine), feature_set(engine), slots)


def check_single_host() -> None:
    """Refuses to calibrate on a multi-host mesh: every host times its own steps, so each would
    fit another model and plan other steps, while the hosts must plan the same ones."""
    if jax.process_count() > 1:
        raise ValueError(
            f"The step-cost model cannot be measured at warm-up on a multi-host mesh "
            f"({jax.process_count()} processes would each fit their own): measure it once with "
            f"`jaxserve bench --profile steps` and give every host the same --cost-model file."
        )


def forget(engine) -> None:
    """Restarts the engine's counters after a calibration at warm-up, so its stats and
    Prometheus series count served requests only (the calibration's pages stay cached, free)."""
    from jaxserve.engine.metrics import EngineMetrics
    from jaxserve.scheduling.kv_cache_manager import PrefixCacheStats

    config = engine.config
    engine.metrics = EngineMetrics(config.ttft_slo_s, config.tpot_slo_s)
    engine.scheduler.num_preemptions = 0
    engine.scheduler.kv.stats = PrefixCacheStats()


def drain(engine) -> None:
    """Steps the engine until every request it holds has finished."""
    while engine.has_unfinished():
        engine.step()


def _request(engine, request_id: str, prompt_len: int, max_tokens: int, rng) -> str:
    """Adds a greedy request of fresh random ids (no cached prefix can serve it)."""
    ids = rng.integers(3, engine.model.config.vocab_size, size=prompt_len).tolist()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.add_request(ids, params, request_id=request_id)


# ---- the SLO policy of an engine: its cost model loaded or measured here --------------------


def slo_policy_for(engine) -> slo_policy.SloPolicy | None:
    """The SLO policy an engine's config asks for, attached to its scheduler after the engine's
    precompile; None when the config asks for none (nothing is loaded or measured). The engine
    core calls it through `Engine(budget_policy=...)`, so the core knows nothing of calibration.

    The cost model is `config.cost_model`'s file when it was measured for this model, dtype,
    device kind and bucket ladder, in the terms of this engine's attention. Otherwise, unless
    `calibrate_cost_model` is False, it is measured now (`calibrate`, the warm-up one) and saved
    to that path for the next start; a file that does not apply is then replaced, with a warning
    that says why. With `calibrate_cost_model` False such a file is an error; with True the model
    is measured even without SLO-aware scheduling (its stats alone).
    """
    config = engine.config
    calibrate_now = config.calibrate_cost_model
    if not (config.cost_model or config.slo_scheduling or calibrate_now):
        return None
    cost, source = None, "file"
    if config.cost_model and calibrate_now is not True:
        try:
            cost = cost_model.CostModel.load(
                config.cost_model, expect=cost_key(engine), features=feature_set(engine)
            )
        except cost_model.CostModelError as e:
            if calibrate_now is False or not config.slo_scheduling:
                raise  # told not to measure one, or nothing needs one
            logger.warning("%s Measuring a cost model at warm-up instead.", e)
    if cost is None:
        check_single_host()
        cost, source = calibrate(engine, log=logger.info), "calibrated"
        forget(engine)  # the stats count served requests only
        if config.cost_model:
            cost.save(config.cost_model)
    saved = cost.to_json()
    engine.metrics.stats.cost_model = {
        "path": config.cost_model,
        "source": source,
        **saved["key"],
        "fit_error": saved["fit_error"],
        "buckets": saved["buckets"],
    }
    rel_rms = cost.fit_error.get("rel_rms")
    engine.metrics.set_gauges(cost_model_fit_rel_rms=-1.0 if rel_rms is None else rel_rms)
    return slo_policy.attach(engine.scheduler, config, cost)


# Fewer served steps than this say too little about the machine's pace to replace the scale.
MIN_SERVED_STEPS = 200


def save_served_scale(engine) -> cost_model.CostModel | None:
    """Saves, to the engine's `--cost-model` file, its cost model with the serving scale its SLO
    policy measured on the steps it served (at least MIN_SERVED_STEPS), so that the next start
    and the simulator plan served steps; returns that model, or None when nothing was saved.
    Called when the engine stops."""
    policy = engine.slo_policy
    path = engine.config.cost_model
    if not isinstance(policy, slo_policy.SloPolicy) or not path:
        return None
    measured = policy.served_scale()
    if measured is None or measured[1] < MIN_SERVED_STEPS:
        return None
    cost = policy.cost.with_serving_scale(*measured)
    cost.save(path)
    logger.info(
        "cost model: served steps ran x%.2f of calibration's; saved to %s", measured[0], path
    )
    return cost
