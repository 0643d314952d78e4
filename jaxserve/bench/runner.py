"""Runs a `Workload` against an engine and records what every request saw.

Offline: an in-process `Engine`, driven from this thread. Requests are injected at their arrival
offsets against the wall clock between engine steps; a request whose time came while a step ran
joins after it, but keeps its scheduled arrival time, so the wait it suffered behind the busy
engine counts in its queue wait and TTFT, as it would behind a server. Closed-loop workloads
keep `concurrency` requests outstanding, a new one arriving the moment one finishes.

Online: the same workloads sent over gRPC to a running `jaxserve serve`, or over the OpenAI API
to any server that speaks it (`--backend openai`, jaxserve/bench/openai_backend.py), timed on
the client (`run_online`, one thread per request in flight). Engine-side numbers (KV use,
preemptions, batch occupancy; over the OpenAI API also the queue wait) are not visible from
there and stay None.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.bench.workload import RequestSpec, Workload, random_prompt_ids
from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the records and metrics also serve `jaxserve simulate`, which has no JAX
    from jaxserve.engine.core import Engine

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RequestRecord:
    """One finished request, times in seconds since the start of its run."""

    request_id: str
    prompt_len: int
    output_len: int
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None
    finish_reason: str | None
    preemptions: int = 0
    cached_tokens: int | None = None  # prompt tokens the prefix cache served; None: not known

    @property
    def queue_wait(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finished is None or self.first_token is None or self.output_len < 2:
            return None
        return (self.finished - self.first_token) / (self.output_len - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclasses.dataclass
class Timeline:
    """Engine gauges after every step: what the occupancy and KV plots draw."""

    t: list[float] = dataclasses.field(default_factory=list)  # s since the run started
    running: list[int] = dataclasses.field(default_factory=list)  # slots holding a request
    waiting: list[int] = dataclasses.field(default_factory=list)
    kv_pages_used: list[int] = dataclasses.field(default_factory=list)

    def add(self, t: float, running: int, waiting: int, kv_pages_used: int) -> None:
        self.t.append(t)
        self.running.append(running)
        self.waiting.append(waiting)
        self.kv_pages_used.append(kv_pages_used)


@dataclasses.dataclass
class RunResult:
    """Everything one (configuration, load) cell of a bench produced."""

    label: str  # the configuration's name
    workload: Workload
    records: list[RequestRecord]
    duration_s: float  # first arrival to last finish
    max_num_seqs: int | None = None
    kv_pages_total: int | None = None
    timeline: Timeline | None = None
    engine: dict[str, Any] | None = None  # counters over this run (see `_engine_counters`)
    memory: dict[str, Any] | None = None  # bytes: params, KV pool, device peak when known


def sampling_for(spec: RequestSpec) -> SamplingParams:
    """Greedy, EOS ignored: every request runs exactly `max_tokens`, in every configuration."""
    return SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)


def prompt_for(spec: RequestSpec, vocab_size: int, seed: int) -> str | list[int]:
    if spec.prompt_token_ids is not None:
        return list(spec.prompt_token_ids)
    if spec.prompt is not None:
        return spec.prompt
    return random_prompt_ids(spec, vocab_size, seed)


# ---- offline ------------------------------------------------------------------------------


def run_offline(engine: Engine, workload: Workload, *, label: str, seed: int = 0) -> RunResult:
    """Serves `workload` on `engine` against the wall clock; the engine must be idle.

    Counters are read before and after, so one engine can serve several workloads in turn.
    """
    if engine.has_unfinished():
        raise RuntimeError("run_offline needs an idle engine.")
    vocab = engine.model.config.vocab_size
    before = _engine_counters(engine)
    pending = collections.deque(workload.requests)
    closed = workload.concurrency
    outstanding = 0
    records: list[RequestRecord] = []
    timeline = Timeline()
    t0 = time.monotonic()

    def admit(now: float) -> None:
        nonlocal outstanding
        while pending and (outstanding < closed if closed else t0 + pending[0].arrival_s <= now):
            spec = pending.popleft()
            arrival = now if closed else t0 + spec.arrival_s
            engine.add_request(
                prompt_for(spec, vocab, seed),
                sampling_for(spec),
                request_id=spec.request_id,
                priority=spec.priority,
                arrival_time=arrival,
            )
            outstanding += 1

    while pending or engine.has_unfinished():
        admit(time.monotonic())
        if not engine.has_unfinished():
            _sleep_until(t0 + pending[0].arrival_s)
            continue
        outputs = engine.step()
        now = time.monotonic()
        s = engine.scheduler
        timeline.add(now - t0, s.num_slots_used, s.num_waiting, s.num_pages_used)
        for out in outputs:
            if out.finished:
                outstanding -= 1
                records.append(_record(out, t0))
        if s.num_running == 0 and not outputs:
            # Nothing runs (a dynamic batch waits to fill): do not spin on empty steps.
            next_at = t0 + pending[0].arrival_s if pending and not closed else math.inf
            _sleep_until(min(next_at, now + 1e-3))
    duration = max((r.finished or 0.0) for r in records) if records else 0.0
    return RunResult(
        label=label,
        workload=workload,
        records=records,
        duration_s=duration,
        max_num_seqs=engine.config.max_num_seqs,
        kv_pages_total=engine.runner.config.num_pages,
        timeline=timeline,
        engine=_diff(_engine_counters(engine), before),
        memory=memory_use(engine),
    )


def _record(out, t0: float) -> RequestRecord:
    m = out.metrics

    def rel(x: float | None) -> float | None:
        return None if x is None else x - t0

    return RequestRecord(
        request_id=out.request_id,
        prompt_len=out.num_prompt_tokens,
        output_len=out.num_output_tokens,
        arrival=m.arrival_time - t0,
        first_scheduled=rel(m.first_scheduled_time),
        first_token=rel(m.first_token_time),
        finished=rel(m.finished_time),
        finish_reason=out.finish_reason,
        preemptions=m.num_preemptions,
        cached_tokens=out.num_cached_tokens,
    )


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _engine_counters(engine: Engine) -> dict[str, float]:
    s = engine.metrics.stats
    return {
        "preemptions": s.num_preemptions,
        "compiles_after_warmup": s.compiles_after_warmup,
        "steps": s.num_steps,
        "real_tokens": s.real_tokens,
        "padded_tokens": s.padded_tokens,
        "busy_wall_s": s.busy_wall_s,
        "device_idle_s": s.device_idle_s,
        "spec_proposed_tokens": s.spec_proposed_tokens,
        "spec_accepted_tokens": s.spec_accepted_tokens,
        "spec_verifications": s.spec_verifications,
    }


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    d = {k: after[k] - before[k] for k in after}
    d["padding_efficiency"] = d["real_tokens"] / d["padded_tokens"] if d["padded_tokens"] else 1.0
    total = d["busy_wall_s"] + d["device_idle_s"]
    d["device_idle_share"] = d["device_idle_s"] / total if total else 0.0
    proposed, verified = d["spec_proposed_tokens"], d["spec_verifications"]
    d["spec_acceptance_rate"] = d["spec_accepted_tokens"] / proposed if proposed else None
    d["spec_mean_accepted_length"] = d["spec_accepted_tokens"] / verified if verified else None
    return d


def memory_use(engine: Engine) -> dict[str, Any]:
    """Bytes of params and of the KV pool, and the device's peak when the backend reports one
    (accelerators do; the CPU backend does not, and then the two pools are the footprint)."""
    import jax

    nbytes = lambda tree: int(sum(x.nbytes for x in jax.tree_util.tree_leaves(tree)))  # noqa: E731
    peak = None
    try:
        stats = [d.memory_stats() for d in jax.local_devices()]
        peaks = [st["peak_bytes_in_use"] for st in stats if st and "peak_bytes_in_use" in st]
        peak = max(peaks) if peaks else None
    except (RuntimeError, NotImplementedError):  # a backend without the query
        pass
    return {
        "param_bytes": nbytes(engine.model.params),
        "kv_pool_bytes": nbytes(engine.runner.kv),
        "device_peak_bytes": peak,
    }


# ---- online -------------------------------------------------------------------------------

# service/proto/jaxserve/v1/jaxserve.proto, enum FinishReason.
_FINISH_REASONS = {1: "stop", 2: "length", 3: "abort", 4: "error"}


class OnlineUnavailable(RuntimeError):
    """The gRPC client is not importable or the server cannot be reached."""


def connect(address: str, *, timeout_s: float = 10.0, backend: str = "grpc"):
    """A `service.grpc.client.JaxServeClient` of a running `jaxserve serve`, checked to be serving;
    with backend "openai", an `OpenAIBenchClient` of the OpenAI-compatible server at the URL.

    Imported lazily, so offline benches need neither grpc nor the generated stubs.
    """
    if backend == "openai":
        from jaxserve.bench import openai_backend

        try:
            return openai_backend.connect(address, timeout_s=timeout_s)
        except (OSError, ValueError, openai_backend.OpenAIError) as e:
            raise OnlineUnavailable(
                f"No OpenAI-compatible server answers at {address}: {e}"
            ) from None
    if backend != "grpc":
        raise ValueError(f"backend={backend!r} must be 'grpc' or 'openai'.")
    try:
        from service.grpc.client import JaxServeClient
    except ImportError as e:
        raise OnlineUnavailable(
            f"Online mode needs the gRPC client service.grpc.client, which cannot be imported "
            f"({e}); run the bench offline (without --online) meanwhile."
        ) from None
    # The same bearer token `jaxserve serve` reads by default, when the server requires one.
    client = JaxServeClient(address, token=os.environ.get("JAXSERVE_AUTH_TOKEN") or None)
    try:
        status = client.health(timeout=timeout_s)
    except Exception as e:  # grpc.RpcError, but grpc stays a lazy import
        client.close()
        detail = e.details() if hasattr(e, "details") else str(e)  # RpcError: one line
        raise OnlineUnavailable(f"No jaxserve server answers at {address}: {detail}") from None
    if status != "SERVING":
        client.close()
        raise OnlineUnavailable(f"The server at {address} is {status}, not SERVING.")
    return client


def server_info(client) -> dict[str, Any]:
    """The served model and the engine's limits, for the report (the bench cannot set them)."""
    info = client.model_info()
    lim = info.limits
    known = {
        "model": info.model,
        "dtype": info.dtype,
        "vocab_size": info.vocab_size,
        "max_model_len": info.context_length,
    }
    if lim is None:  # an OpenAI-compatible server does not tell its engine's limits
        return known
    return {
        **known,
        "max_num_seqs": lim.max_num_seqs,
        "max_num_batched_tokens": lim.max_num_batched_tokens,
        "num_pages": lim.num_kv_pages,
        "page_size": lim.page_size,
        "policy": lim.policy,
    }


def run_online(
    client, workload: Workload, *, label: str, vocab_size: int, seed: int = 0
) -> RunResult:
    """Serves `workload` through a blocking, thread-safe `JaxServeClient`, one thread per
    request in flight, timing each on this side: arrival when sent, first token at the first
    streamed token ids, finish at the last response. Queue wait comes from the server's timings.

    Open loop: a thread per request (the workload's size bounds them), each started at its
    arrival offset. Closed loop: `concurrency` threads, each sending its next request as soon
    as its previous one finished.
    """
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.monotonic()

    def one(spec: RequestSpec) -> RequestRecord:
        if workload.concurrency is None:
            _sleep_until(t0 + spec.arrival_s)
        arrival = time.monotonic() - t0
        record = RequestRecord(
            spec.request_id, spec.prompt_len, 0, arrival, None, None, None, "error"
        )
        try:
            call = client.generate(
                prompt_for(spec, vocab_size, seed),
                max_tokens=spec.max_tokens,
                temperature=0.0,
                ignore_eos=True,
                request_id=spec.request_id,
                priority=spec.priority,
            )
            for resp in call:
                if record.first_token is None and len(resp.token_ids):
                    record.first_token = time.monotonic() - t0
                record.output_len += len(resp.token_ids)
                if resp.finish_reason:
                    record.finish_reason = _FINISH_REASONS.get(resp.finish_reason, "error")
                    record.prompt_len = resp.usage.prompt_tokens or spec.prompt_len
                    record.cached_tokens = getattr(resp.usage, "cached_prompt_tokens", None)
                    if resp.timings is not None:  # None over the OpenAI API: not visible
                        record.first_scheduled = arrival + resp.timings.queue_wait_s
        except Exception as e:  # RpcError, OpenAIError: the request failed; counted, not raised
            refused = _is_refusal(e)
            if not refused:
                logger.warning("request %s failed: %s", spec.request_id, e)
            record.finish_reason = "refused" if refused else "error"
        record.finished = time.monotonic() - t0
        return record

    workers = workload.concurrency or len(workload.requests)
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="bench") as pool:
        records = list(pool.map(one, workload.requests))
    finished = [r.finished for r in records if r.finish_reason in ("stop", "length")]
    return RunResult(
        label=label,
        workload=workload,
        records=records,
        duration_s=max(finished) if finished else math.nan,
    )


def kv_use(result: RunResult) -> tuple[float, float] | None:
    """(peak, time-weighted mean) share of the KV pool in use over the run."""
    tl = result.timeline
    if tl is None or not tl.t or not result.kv_pages_total:
        return None
    used = np.asarray(tl.kv_pages_used, np.float64) / result.kv_pages_total  # f64[steps]
    return float(used.max()), _time_mean(tl.t, used)


def occupancy(result: RunResult) -> tuple[float, float] | None:
    """(peak, time-weighted mean) share of the batch slots holding a request."""
    tl = result.timeline
    if tl is None or not tl.t or not result.max_num_seqs:
        return None
    used = np.asarray(tl.running, np.float64) / result.max_num_seqs  # f64[steps]
    return float(used.max()), _time_mean(tl.t, used)


def _time_mean(t: list[float], values: np.ndarray) -> float:
    """Mean of a step function sampled after each step, weighted by each step's duration."""
    ts = np.asarray([0.0, *t], np.float64)  # f64[steps + 1]
    dt = np.diff(ts)  # f64[steps]: the step that ended at t[i] took dt[i]
    return float((values * dt).sum() / dt.sum()) if dt.sum() > 0 else float(values.mean())


def _is_refusal(error: Exception) -> bool:
    """Whether a failed call was the server refusing it under load (gRPC RESOURCE_EXHAUSTED,
    HTTP 429: a full queue, or a request shed by --shed-late), not a fault."""
    code = getattr(error, "code", None)
    if callable(code):  # grpc.RpcError; grpc stays a lazy import
        return getattr(code(), "name", None) == "RESOURCE_EXHAUSTED"
    return str(error).startswith("HTTP 429")
