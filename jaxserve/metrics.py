"""Engine metrics: a plain Python object for library users, mirrored into Prometheus.

Each engine has its own `CollectorRegistry`, so several engines (or tests) in one process do not
collide; the service exposes `registry` on its metrics port.
"""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jaxserve.outputs import RequestMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclasses.dataclass
class EngineStats:
    """Counters and gauges since the engine started (wall times in seconds)."""

    num_running: int = 0
    num_waiting: int = 0
    slots_used: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    kv_pages_cached: int = 0  # free of any request but holding a prefix the cache may serve
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission
    prefix_cache_hits: int = 0  # of those, tokens served from cached pages
    prefix_cache_evictions: int = 0  # cached pages dropped to make fresh ones
    num_preemptions: int = 0
    num_compiles: int = 0
    compiles_after_warmup: int = 0
    num_steps: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    busy_wall_s: float = 0.0  # wall time of steps (dispatch to result), summed
    device_idle_s: float = 0.0  # device waiting for the host between a result and the next step
    finished: dict[str, int] = dataclasses.field(default_factory=dict)
    good_requests: int = 0  # met both SLO targets (or every finished one when none are set)

    @property
    def padding_efficiency(self) -> float:
        """Real tokens over padded tokens run: 1.0 means no padding."""
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the cache over those looked up (0.0 before any)."""
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    @property
    def device_idle_share(self) -> float:
        total = self.busy_wall_s + self.device_idle_s
        return self.device_idle_s / total if total else 0.0


class EngineMetrics:
    """Updates `EngineStats` and the Prometheus series together."""

    def __init__(self, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None):
        self.stats = EngineStats()
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        r = self.registry = CollectorRegistry()
        self._gauges = {
            name: Gauge(f"jaxserve_{name}", doc, registry=r)
            for name, doc in [
                ("num_running", "Requests running."),
                ("num_waiting", "Requests waiting."),
                ("slots_used", "Decode-batch slots held."),
                ("kv_pages_used", "KV-cache pages in use."),
                ("kv_pages_total", "KV-cache pages in the pool."),
                ("kv_pages_cached", "KV-cache pages held only by the prefix cache (evictable)."),
                ("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache, a share."),
                ("padding_efficiency", "Real over padded tokens since start."),
                ("device_idle_share", "Share of step wall time the device waited for the host."),
            ]
        }
        self._preemptions = Counter("jaxserve_preemptions", "Preemptions.", registry=r)
        self._compiles = Counter("jaxserve_compiles", "Step compilations.", registry=r)
        self._prefix = {
            name: Counter(f"jaxserve_prefix_cache_{name}", doc, registry=r)
            for name, doc in [
                ("queries", "Prompt tokens looked up in the prefix cache."),
                ("hits", "Prompt tokens served from the prefix cache."),
                ("evictions", "Cached KV pages evicted for fresh ones."),
            ]
        }
        self._prompt = Counter("jaxserve_prompt_tokens", "Prompt tokens computed.", registry=r)
        self._gen = Counter("jaxserve_generation_tokens", "Tokens generated.", registry=r)
        self._finished = Counter(
            "jaxserve_requests_finished", "Finished requests.", ["reason"], registry=r
        )
        self._good = Counter("jaxserve_goodput_requests", "Requests within the SLO.", registry=r)
        self._hist = {
            name: Histogram(f"jaxserve_{name}_seconds", doc, buckets=_LATENCY_BUCKETS, registry=r)
            for name, doc in [
                ("queue_wait", "Arrival to first scheduled."),
                ("ttft", "Arrival to first token."),
                ("tpot", "Mean time per output token after the first."),
                ("e2e", "Arrival to finish."),
            ]
        }

    def on_step(
        self,
        *,
        real_tokens: int,
        padded_tokens: int,
        prompt_tokens: int,
        generated: int,
        busy_s: float,
        idle_s: float,
    ) -> None:
        s = self.stats
        s.num_steps += 1
        s.real_tokens += real_tokens
        s.padded_tokens += padded_tokens
        s.prompt_tokens += prompt_tokens
        s.generation_tokens += generated
        s.busy_wall_s += busy_s
        s.device_idle_s += idle_s
        self._prompt.inc(prompt_tokens)
        self._gen.inc(generated)

    def set_gauges(self, **values: int) -> None:
        for name, value in values.items():
            setattr(self.stats, name, value)
            self._gauges[name].set(value)
        self._gauges["padding_efficiency"].set(self.stats.padding_efficiency)
        self._gauges["device_idle_share"].set(self.stats.device_idle_share)

    def on_compiles(self, total: int, after_warmup: int) -> None:
        self._compiles.inc(max(0, total - self.stats.num_compiles))
        self.stats.num_compiles, self.stats.compiles_after_warmup = total, after_warmup

    def on_preemptions(self, total: int) -> None:
        self._preemptions.inc(max(0, total - self.stats.num_preemptions))
        self.stats.num_preemptions = total

    def on_prefix_cache(self, *, queries: int, hits: int, evictions: int) -> None:
        """Takes the KV manager's totals since start; Prometheus gets the increments."""
        s = self.stats
        for name, total in (("queries", queries), ("hits", hits), ("evictions", evictions)):
            attr = f"prefix_cache_{name}"
            self._prefix[name].inc(max(0, total - getattr(s, attr)))
            setattr(s, attr, total)
        self._gauges["prefix_cache_hit_rate"].set(s.prefix_cache_hit_rate)

    def on_finished(self, reason: str, m: RequestMetrics, num_output_tokens: int) -> None:
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        self._finished.labels(reason=reason).inc()
        tpot = m.tpot(num_output_tokens)
        for name, value in (
            ("queue_wait", m.queue_wait),
            ("ttft", m.ttft),
            ("tpot", tpot),
            ("e2e", m.e2e),
        ):
            if value is not None:
                self._hist[name].observe(value)
        if reason in ("stop", "length") and self.is_good(m.ttft, tpot):
            self.stats.good_requests += 1
            self._good.inc()

    def is_good(self, ttft: float | None, tpot: float | None) -> bool:
        """Whether a request met the TTFT and TPOT targets (a missing target always holds)."""
        ok_ttft = self.ttft_slo_s is None or (ttft is not None and ttft <= self.ttft_slo_s)
        ok_tpot = self.tpot_slo_s is None or tpot is None or tpot <= self.tpot_slo_s
        return ok_ttft and ok_tpot
