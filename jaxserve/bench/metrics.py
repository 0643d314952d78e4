"""Bench metrics: percentiles, throughput and goodput of one run, as a flat JSON-ready dict.

Throughputs divide by the run's span (first arrival to last finish), not by the engine's busy
time: a scheduler that leaves the device idle while requests wait is charged for it. Goodput
counts requests per second that finished normally and met both the TTFT and the TPOT target,
following DistServe's definition; a request with a single output token has no TPOT and is judged
on TTFT alone. A request the server refused under load (finish reason "refused": shed by
--shed-late, or turned away by a full queue when online) is counted apart from failures: it is
neither good nor a fault, the load shedding the SLO asked for.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from jaxserve.bench.runner import RequestRecord, RunResult, kv_use, occupancy

PERCENTILES = (50, 95, 99)
LATENCIES = ("ttft", "tpot", "e2e", "queue_wait")


@dataclasses.dataclass(frozen=True)
class SLO:
    """The goodput targets, in seconds."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self):
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"The {name[:-2].upper()} target {value!r} must be > 0 seconds.")

    def met_by(self, r: RequestRecord) -> bool:
        if r.finish_reason not in ("stop", "length") or r.ttft is None:
            return False
        return r.ttft <= self.ttft_s and (r.tpot is None or r.tpot <= self.tpot_s)


def distribution(values: Iterable[float | None]) -> dict[str, float | None]:
    """mean, p50, p95, p99 and max of the values that exist (None where there are none)."""
    xs = np.asarray([v for v in values if v is not None], np.float64)  # f64[n]
    if xs.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    out = {"mean": float(xs.mean())}
    out.update({f"p{p}": float(np.percentile(xs, p)) for p in PERCENTILES})
    out["max"] = float(xs.max())
    return out


def summarize(result: RunResult, slo: SLO) -> dict:
    """Every bench metric of one (configuration, load) run."""
    records = result.records
    done = [r for r in records if r.finish_reason in ("stop", "length")]
    span = result.duration_s
    per_s = (lambda n: n / span) if span and span > 0 else (lambda n: math.nan)
    good = sum(slo.met_by(r) for r in records)
    refused = sum(r.finish_reason == "refused" for r in records)
    missing = len(result.workload.requests) - len(records)  # never came back
    out_tokens = sum(r.output_len for r in done)
    summary = {
        "label": result.label,
        "workload": result.workload.name,
        "load": _finite_or_str(result.workload.load),
        "load_kind": result.workload.load_kind,
        "num_requests": len(result.workload.requests),
        "num_finished": len(done),
        "num_refused": refused,
        "num_failed": missing + len(records) - len(done) - refused,
        "duration_s": span,
        "request_throughput": per_s(len(done)),
        "output_token_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(out_tokens + sum(r.prompt_len for r in done)),
        "output_tokens": out_tokens,
        "goodput": per_s(good),
        "good_requests": good,
        "slo_attainment": good / len(records) if records else math.nan,
    }
    for name in LATENCIES:
        summary[name] = distribution(getattr(r, name) for r in done)
    kv = kv_use(result)
    occ = occupancy(result)
    summary["kv_cache"] = {
        "pages_total": result.kv_pages_total,
        "peak_use": kv[0] if kv else None,
        "mean_use": kv[1] if kv else None,
    }
    summary["batch_occupancy"] = {
        "max_num_seqs": result.max_num_seqs,
        "peak": occ[0] if occ else None,
        "mean": occ[1] if occ else None,
    }
    summary["memory"] = result.memory or {
        "param_bytes": None,
        "kv_pool_bytes": None,
        "device_peak_bytes": None,
    }
    engine = result.engine or {}
    summary["prefix_cache"] = prefix_cache_use(done)
    summary["preemptions"] = engine.get("preemptions")
    summary["requests_preempted"] = sum(r.preemptions > 0 for r in records) if engine else None
    summary["compiles_after_warmup"] = engine.get("compiles_after_warmup")
    summary["steps"] = engine.get("steps")
    summary["padding_efficiency"] = engine.get("padding_efficiency")
    summary["device_idle_share"] = engine.get("device_idle_share")
    # Speculative decoding (EngineConfig.speculative): tokens proposed and accepted, the share
    # accepted and the accepted per verification; None without an engine's counters.
    summary["speculation"] = {
        "proposed_tokens": engine.get("spec_proposed_tokens"),
        "accepted_tokens": engine.get("spec_accepted_tokens"),
        "verifications": engine.get("spec_verifications"),
        "acceptance_rate": engine.get("spec_acceptance_rate"),
        "mean_accepted_length": engine.get("spec_mean_accepted_length"),
    }
    return summary


def prefix_cache_use(records: Sequence[RequestRecord]) -> dict[str, float | None]:
    """Prompt tokens served from the prefix cache over all prompt tokens: over every request,
    and over all but the first to arrive (the one that finds the cache cold). None where the
    records do not say (an online server that does not report cached tokens)."""
    known = [r for r in records if r.cached_tokens is not None]
    if not known:
        return {"hit_rate": None, "hit_rate_after_first": None}
    later = sorted(known, key=lambda r: r.arrival)[1:]

    def rate(rs: Sequence[RequestRecord]) -> float | None:
        total = sum(r.prompt_len for r in rs)
        return sum(r.cached_tokens for r in rs) / total if total else None

    return {"hit_rate": rate(known), "hit_rate_after_first": rate(later)}


def _finite_or_str(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"
