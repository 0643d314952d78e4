"""Engine metrics: a plain Python object for library users, mirrored into Prometheus.

Each engine has its own `CollectorRegistry`, so several engines (or tests) in one process do not
collide; the service exposes `registry` on its metrics port. The gauges a router reads (queue,
running, KV-cache use, cache config, LoRA adapters) follow the model server protocol of the
Gateway API Inference Extension: docs/routing.md names them.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.outputs import RequestMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Host phases of one `Engine.step()`, in loop order. `wait` is the host blocked on the device for
# a result: device time seen from the host, not host work. `collect` is the rest of taking a
# result in (the copy to the host, the scheduler's update, step counters).
HOST_PHASES = ("schedule", "pack", "dispatch", "wait", "collect", "outputs")
# A phase costs microseconds on a small batch and milliseconds on a large one.
_HOST_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
# Gauges exported under another name than their EngineStats field: a name ending in _total is a
# counter's in Prometheus (promtool check metrics refuses a gauge so named).
_EXPORTED_AS = {"kv_pages_total": "kv_pages", "host_kv_pages_total": "host_kv_pages"}


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
    # The host KV pool (scheduling/offload.py): its size and use, and counters since start by
    # OffloadStats' names (swap_preemptions, pages_swapped_out, host_hits, device_hits, ...).
    host_kv_pages_total: int = 0
    host_kv_pages_used: int = 0  # swapped requests' pages and the prefix cache's host tier
    host_kv_pages_swapped: int = 0
    host_kv_bytes: int = 0  # the host pool's arrays (mapped lazily: RAM taken as pages are used)
    kv_offload: dict[str, int] = dataclasses.field(default_factory=dict)
    num_compiles: int = 0
    compiles_after_warmup: int = 0
    num_steps: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    busy_wall_s: float = 0.0  # working wall time with a step in flight (DeviceTimeline)
    device_idle_s: float = 0.0  # working wall time with no step in flight (DeviceTimeline)
    host_steps: int = 0  # Engine.step() calls timed by phase
    host_phase_s: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(HOST_PHASES, 0.0)
    )  # host seconds per phase of Engine.step(), summed over host_steps
    finished: dict[str, int] = dataclasses.field(default_factory=dict)
    good_requests: int = 0  # met both SLO targets (or every finished one when none are set)
    # The step-cost model SLO-aware scheduling plans with (calibration.slo_policy_for): its
    # file, source ("file" or "calibrated" at warm-up), key, fits and fit error; None without.
    cost_model: dict | None = None
    cost_model_fit_rel_rms: float = -1.0  # its fit's relative RMS error; -1: no cost model
    # Speculative decoding (scheduling/speculation.py): tokens proposed and verified, of those
    # accepted, and the rows that verified them (one per request per verifying step).
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0
    # LoRA adapters for a router (docs/routing.md): those of running requests, those of
    # waiting ones (comma-separated names), and the wall time (Unix seconds) they were last
    # set. One tuple, replaced whole, so that a scrape on another thread reads one state.
    lora_adapters: tuple[str, str, float] = ("", "", 0.0)
    # A mixture of experts: the tokens routed to each expert of each layer since start,
    # int64[num_layers, num_experts] (None for a dense model).
    expert_load: np.ndarray | None = None

    @property
    def kv_cache_usage_perc(self) -> float:
        """Pages held by requests over the pool's pages, 0 to 1 (vLLM's meaning): cached pages
        that no request holds are free to take, so they do not count."""
        total = self.kv_pages_total
        return self.kv_pages_used / total if total else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Proposed tokens the target accepted, a share (0.0 before any)."""
        p = self.spec_proposed_tokens
        return self.spec_accepted_tokens / p if p else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Proposals accepted per verification (0.0 before any): each saves a step."""
        v = self.spec_verifications
        return self.spec_accepted_tokens / v if v else 0.0

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
        """Share of the wall time the engine had work with no step in flight on the device."""
        total = self.busy_wall_s + self.device_idle_s
        return self.device_idle_s / total if total else 0.0


class EngineMetrics:
    """Updates `EngineStats` and the Prometheus series together."""

    def __init__(self, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None):
        self.stats = EngineStats()
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        r = self.registry = CollectorRegistry()
        self._gauges = {
            name: Gauge(f"jaxserve_{_EXPORTED_AS.get(name, name)}", doc, registry=r)
            for name, doc in [
                ("num_running", "Requests running."),
                ("num_waiting", "Requests waiting."),
                ("slots_used", "Decode-batch slots held."),
                ("kv_pages_used", "KV-cache pages in use."),
                ("kv_pages_total", "KV-cache pages in the pool."),
                ("kv_pages_cached", "KV-cache pages held only by the prefix cache (evictable)."),
                (
                    "kv_cache_usage_perc",
                    "KV-cache pages held by requests over the pool's, 0 to 1 (cached pages no "
                    "request holds are free).",
                ),
                ("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache, a share."),
                ("padding_efficiency", "Real over padded tokens since start."),
                ("device_idle_share", "Share of working wall time with no step in flight."),
                ("cost_model_fit_rel_rms", "Step-cost model's relative RMS error; -1: none."),
                ("host_kv_pages_total", "Pages of the host KV pool."),
                ("host_kv_pages_used", "Host KV pages holding swapped requests or the host tier."),
                ("host_kv_pages_swapped", "Host KV pages holding swapped requests."),
                ("host_kv_bytes", "Bytes of the host KV pool."),
                ("spec_acceptance_rate", "Speculative proposals accepted, a share."),
                ("spec_mean_accepted_length", "Speculative proposals accepted per verification."),
            ]
        }
        # Read from the stats when scraped, not set every step (each set takes a lock).
        for name, gauge in self._gauges.items():
            gauge.set_function(functools.partial(getattr, self.stats, name))
        self._preemptions = Counter("jaxserve_preemptions", "Preemptions.", registry=r)
        self._compiles = Counter(
            "jaxserve_compiles", "XLA compiles in the process (runtime/compiles.py).", registry=r
        )
        self._prefix = {
            name: Counter(f"jaxserve_prefix_cache_{name}", doc, registry=r)
            for name, doc in [
                ("queries", "Prompt tokens looked up in the prefix cache."),
                ("hits", "Prompt tokens served from the prefix cache."),
                ("evictions", "Cached KV pages evicted for fresh ones."),
            ]
        }
        self._offload = Counter(
            "jaxserve_kv_offload",
            "Host KV pool events since start (swap preemptions, pages copied each way, prefix "
            "cache hits by tier in tokens, recomputed tokens), by kind.",
            ["kind"],
            registry=r,
        )
        self._spec = {
            name: Counter(f"jaxserve_spec_{name}", doc, registry=r)
            for name, doc in [
                ("proposed_tokens", "Speculative tokens proposed and verified."),
                ("accepted_tokens", "Speculative tokens accepted."),
                ("verifications", "Rows that verified speculative proposals."),
            ]
        }
        self._prompt = Counter("jaxserve_prompt_tokens", "Prompt tokens computed.", registry=r)
        self._gen = Counter("jaxserve_generation_tokens", "Tokens generated.", registry=r)
        self._finished = Counter(
            "jaxserve_requests_finished", "Finished requests.", ["reason"], registry=r
        )
        self._good = Counter("jaxserve_goodput_requests", "Requests within the SLO.", registry=r)
        self._cache_config = Info(
            "jaxserve_cache_config",
            "The KV cache's layout, as labels: page_size and num_pages (and the same as vLLM's "
            "block_size and num_gpu_blocks, which routers read).",
            registry=r,
        )
        self._lora = _LoraInfo(self.stats)
        r.register(self._lora)
        r.register(_ExpertLoad(self.stats))
        self.device = DeviceTimeline(self.stats)
        host = Histogram(
            "jaxserve_host_step_seconds",
            "Host time of each engine step in one phase (wait: blocked on the device).",
            ["phase"],
            buckets=_HOST_BUCKETS,
            registry=r,
        )
        self._host = {phase: host.labels(phase=phase) for phase in HOST_PHASES}
        self.last_host_phases: dict[str, float] = dict.fromkeys(HOST_PHASES, 0.0)
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
    ) -> None:
        s = self.stats
        s.num_steps += 1
        s.real_tokens += real_tokens
        s.padded_tokens += padded_tokens
        s.prompt_tokens += prompt_tokens
        s.generation_tokens += generated
        self._prompt.inc(prompt_tokens)
        self._gen.inc(generated)

    def on_speculation(self, *, proposed: int, accepted: int, verifications: int) -> None:
        """One step's verifications: tokens proposed, accepted, and the rows verifying them."""
        s = self.stats
        s.spec_proposed_tokens += proposed
        s.spec_accepted_tokens += accepted
        s.spec_verifications += verifications
        self._spec["proposed_tokens"].inc(proposed)
        self._spec["accepted_tokens"].inc(accepted)
        self._spec["verifications"].inc(verifications)

    def on_expert_load(self, load: np.ndarray) -> None:
        """One step's routing (i32[num_layers, num_experts] real tokens per expert) added to
        the totals /metrics shows, so an operator sees imbalance."""
        s = self.stats
        if s.expert_load is None:
            s.expert_load = np.zeros(load.shape, np.int64)
        s.expert_load = s.expert_load + load  # replaced whole: a scrape reads one state

    def on_host_step(self, phases: dict[str, float]) -> None:
        """Takes one `Engine.step()`'s host seconds per phase (a `PhaseClock`'s laps)."""
        s = self.stats
        s.host_steps += 1
        for phase, seconds in phases.items():
            s.host_phase_s[phase] += seconds
            self._host[phase].observe(seconds)
        self.last_host_phases = phases

    def describe_engine(
        self, *, page_size: int, num_pages: int, prefix_caching: bool, max_loras: int
    ) -> None:
        """The engine's fixed shape, as the cache-config and LoRA info metrics' labels."""
        self._cache_config.info(
            {
                "page_size": str(page_size),
                "num_pages": str(num_pages),
                "block_size": str(page_size),
                "num_gpu_blocks": str(num_pages),
                "enable_prefix_caching": str(prefix_caching).lower(),
            }
        )
        self._lora.max_loras = max_loras
        self.set_lora_adapters([], [])

    def set_lora_adapters(self, running: list[str], waiting: list[str]) -> None:
        """The adapters of running and of waiting requests now, stamped with the wall time."""
        self.stats.lora_adapters = (",".join(running), ",".join(waiting), time.time())

    def set_gauges(self, **values: int) -> None:
        """The engine's gauges now (Prometheus reads them from the stats when scraped)."""
        stats = self.stats
        for name, value in values.items():
            setattr(stats, name, value)

    def on_compiles(self, total: int, after_warmup: int) -> None:
        if total > self.stats.num_compiles:
            self._compiles.inc(total - self.stats.num_compiles)
        self.stats.num_compiles, self.stats.compiles_after_warmup = total, after_warmup

    def on_preemptions(self, total: int) -> None:
        if total > self.stats.num_preemptions:
            self._preemptions.inc(total - self.stats.num_preemptions)
        self.stats.num_preemptions = total

    def on_kv_offload(self, totals: dict[str, int], **gauges: int) -> None:
        """Takes the host pool's counters since start (OffloadStats' fields, read, not kept) and
        its gauges; Prometheus gets the increments."""
        s = self.stats
        self.set_gauges(**gauges)
        if totals == s.kv_offload:
            return  # most steps: nothing new
        for kind, total in totals.items():
            change = total - s.kv_offload.get(kind, 0)
            if change > 0:
                self._offload.labels(kind=kind).inc(change)
        s.kv_offload = dict(totals)

    def on_prefix_cache(self, *, queries: int, hits: int, evictions: int) -> None:
        """Takes the KV manager's totals since start; Prometheus gets the increments."""
        s = self.stats
        if (queries, hits, evictions) == (
            s.prefix_cache_queries,
            s.prefix_cache_hits,
            s.prefix_cache_evictions,
        ):
            return  # most steps: nothing new (this runs every step)
        for name, total in (("queries", queries), ("hits", hits), ("evictions", evictions)):
            attr = f"prefix_cache_{name}"
            self._prefix[name].inc(max(0, total - getattr(s, attr)))
            setattr(s, attr, total)

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


class _LoraInfo:
    """vLLM's `lora_requests_info` as routers read it: one series whose labels are `max_lora`
    and the running and waiting adapters, its value the Unix time they were last set (a
    router takes the series of largest value; there is only ever the current one)."""

    NAME = "jaxserve_lora_requests_info"
    DOC = (
        "LoRA adapters of running and of waiting requests (comma-separated) and the device's "
        "adapter slots, as labels; the value is the Unix time they were last set."
    )
    LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")

    def __init__(self, stats: EngineStats):
        self._stats = stats
        self.max_loras = 0

    def describe(self):
        """The family without samples: the registry checks names against it."""
        return [GaugeMetricFamily(self.NAME, self.DOC, labels=self.LABELS)]

    def collect(self):
        """The current state, read once from the stats (replaced whole by the engine)."""
        running, waiting, updated = self._stats.lora_adapters
        family = GaugeMetricFamily(self.NAME, self.DOC, labels=self.LABELS)
        family.add_metric([str(self.max_loras), running, waiting], updated)
        yield family


class _ExpertLoad:
    """Tokens routed to each expert of each layer of a mixture of experts (a counter per
    layer and expert), and each layer's imbalance: its busiest expert's tokens over the mean
    (1 is perfectly even; top_k experts of E taking everything gives E / top_k). Nothing for a
    dense model. Read from the stats' totals at scrape time: the step only adds an array."""

    TOKENS = "jaxserve_moe_expert_tokens"
    IMBALANCE = "jaxserve_moe_expert_imbalance"

    def __init__(self, stats: EngineStats):
        self._stats = stats

    def _families(self) -> tuple[CounterMetricFamily, GaugeMetricFamily]:
        tokens = CounterMetricFamily(
            self.TOKENS, "Tokens routed to an expert.", labels=["layer", "expert"]
        )
        imbalance = GaugeMetricFamily(
            self.IMBALANCE, "A layer's busiest expert's tokens over the mean.", labels=["layer"]
        )
        return tokens, imbalance

    def describe(self):
        """The families without samples: the registry checks names against them."""
        return list(self._families())

    def collect(self):
        """The totals since start, read once from the stats (replaced whole by the engine)."""
        load = self._stats.expert_load
        if load is None:
            return
        tokens, imbalance = self._families()
        for layer, row in enumerate(load.tolist()):
            for expert, n in enumerate(row):
                tokens.add_metric([str(layer), str(expert)], n)
            mean = sum(row) / len(row)
            imbalance.add_metric([str(layer)], max(row) / mean if mean else 0.0)
        yield tokens
        yield imbalance


class PhaseClock:
    """Host time of one engine step by phase, as contiguous laps of `time.perf_counter`.

    Each `lap(phase)` charges the time since the previous lap (or `start`) to `phase`, so every
    moment between `start` and the last lap belongs to exactly one phase and the phases sum to at
    most the step's wall time. One clock read per lap: cheap enough to run on every step.
    """

    __slots__ = ("_last", "phases")

    def __init__(self):
        self.phases = dict.fromkeys(HOST_PHASES, 0.0)
        self._last = 0.0

    def start(self) -> None:
        """Begins a step: fresh phases (the previous step's dict is kept by whoever took it)."""
        self.phases = dict.fromkeys(HOST_PHASES, 0.0)
        self._last = time.perf_counter()

    def lap(self, phase: str) -> float:
        """Charges the time since the last lap to `phase`; returns the clock reading."""
        now = time.perf_counter()
        self.phases[phase] += now - self._last
        self._last = now
        return now


class DeviceTimeline:
    """Splits the engine's working wall time into "a step in flight" and "device idle".

    A step is in flight from the moment its dispatch returns (inputs copied over, work queued)
    until the engine sees it done. The rest of the time the engine has work is device idle, so
    scheduling, packing, the dispatch call with its host-to-device copy, and taking the result in
    all count as idle: the device cannot run a step the host has not finished handing over. Time
    without work (an empty plan) counts as neither.

    The engine sees a step done when it blocks on it or when a cheap readiness probe (no sync)
    finds it ready, never before the device finished, so the idle time is a lower bound: at most
    the stretch between the device finishing and the engine's next look is missed. Several steps
    may be in flight at once; the device is busy while any one is.
    """

    def __init__(self, stats: EngineStats):
        self._stats = stats
        self._in_flight = 0
        self._mark: float | None = None  # start of the current busy or idle stretch; None: no work

    def dispatched(self, now: float) -> None:
        """A step's dispatch returned at `now` (a `time.perf_counter` reading)."""
        self._charge(now)
        self._in_flight += 1

    def finished(self, now: float) -> None:
        """The engine saw a step in flight done at `now`."""
        if self._in_flight <= 0:
            raise ValueError(f"A step finished at {now} with {self._in_flight} steps in flight.")
        self._charge(now)
        self._in_flight -= 1

    def _charge(self, now: float) -> None:
        """Books the stretch since the last event as busy or idle. Every event books, so the
        stats grow while the engine always keeps a step in flight (asynchronous scheduling)."""
        if self._mark is not None:
            if self._in_flight:
                self._stats.busy_wall_s += now - self._mark
            else:
                self._stats.device_idle_s += now - self._mark
        self._mark = now

    def no_work(self, now: float) -> None:
        """The engine found nothing to run at `now`: the wall clock stops until the next step."""
        if self._in_flight == 0:
            if self._mark is not None:
                self._stats.device_idle_s += now - self._mark
            self._mark = None
