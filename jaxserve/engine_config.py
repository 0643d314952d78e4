"""`EngineConfig`: every knob of an engine, validated once, frozen."""

from __future__ import annotations

import dataclasses
import math
import os

from jaxserve.quantization import KV_CACHE_DTYPES, QUANTIZATIONS
from jaxserve.runtime.buckets import bucket_ladder
from jaxserve.scheduling.kv_events import KV_EVENTS_FORMATS
from jaxserve.scheduling.speculation import SpeculativeConfig
from jaxserve.scheduling.types import (
    BATCHING_MODES,
    POLICIES,
    PREEMPTION_MODES,
    SchedulerConfig,
)


def default_compilation_cache_dir() -> str | None:
    """$JAXSERVE_COMPILATION_CACHE if set ("" to disable), else ~/.cache/jaxserve/xla."""
    env = os.environ.get("JAXSERVE_COMPILATION_CACHE")
    if env is not None:
        return env or None
    return os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla")


def _check_kv_events(config) -> None:
    """Raises ValueError, naming the value, for a KV events endpoint ZeroMQ could not open as
    meant, or a replay endpoint or topic without one."""
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
        value = getattr(config, name)
        if value is None:
            continue
        scheme, sep, rest = value.partition("://") if isinstance(value, str) else ("", "", "")
        host, colon, port = rest.rpartition(":")
        if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
            raise ValueError(
                f"{name}={value!r} must be a ZeroMQ endpoint: tcp://HOST:PORT, tcp://*:PORT, "
                f"ipc://PATH or inproc://NAME."
            )
        if scheme == "tcp" and not (colon and host and port.isdigit() and int(port) < 65536):
            raise ValueError(
                f"{name}={value!r} must name a host and a port 0..65535: tcp://HOST:PORT "
                f"(tcp://127.0.0.1:5557, or tcp://*:5557 to listen on every interface)."
            )
    if config.kv_events_endpoint is None and (
        config.kv_events_replay_endpoint is not None or config.kv_events_topic
    ):
        raise ValueError(
            f"kv_events_replay_endpoint={config.kv_events_replay_endpoint!r} and "
            f"kv_events_topic={config.kv_events_topic!r} need kv_events_endpoint, which is None."
        )
    if config.kv_events_format not in KV_EVENTS_FORMATS:
        raise ValueError(
            f"kv_events_format={config.kv_events_format!r} must be one of "
            f"{KV_EVENTS_FORMATS}: map for vLLM since vllm-project/vllm#42892, array for "
            f"vLLM before it (docs/kv_events.md)."
        )


KV_LAYOUTS = ("auto", "hybrid", "uniform")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How one engine serves one model. Defaults suit the CPU and the embedded model.

    Each field's docstring is its meaning and the help of its command-line flag, which
    jaxserve/engine_args.py declares for every command (`jaxserve serve --help`).
    """

    model: str | None = None
    """Model folder (Hugging Face, or written by `jaxserve convert`) or named random-weight shape
    (llama-tiny, qwen3-tiny, smollm2-135m, llama3.2-1b, llama3.1-8b, qwen3-0.6b, ...); None: the
    embedded stories260k."""
    dtype: str | None = None
    """Parameter dtype; None: float32 on the CPU, bfloat16 on accelerators."""
    quantization: str = "none"
    """8-bit decoder weights, quantized at load from the float checkpoint, one scale per output
    column (jaxserve/quantization.py): int8 (weight-only), fp8 (e4m3 weights, with per-token
    e4m3 activations on H100/H200/TPU7x, weight-only elsewhere), int8-w8a8 (int8 weights and
    per-token int8 activations, an int8 dot: v4/v5e/v5p/v6e and the CPU), or none. The
    embedding, LM head, norms and a router stay in dtype."""
    seed: int = 0
    """Weight seed of named random shapes."""
    max_num_seqs: int = 32
    """Slots: rows of the decode batch."""
    max_num_batched_tokens: int = 256
    """Token budget of one iteration (the largest token bucket)."""
    max_model_len: int | None = None
    """Context of a request, prompt and output, in tokens; None: the model's, capped at 4096."""
    page_size: int = 16
    """Tokens per KV-cache page."""
    num_pages: int | None = None
    """KV-cache pages; None: sized from free device memory (or kv_cache_memory_gb)."""
    kv_cache_memory_gb: float = 1.0
    """KV-cache memory per device, where JAX reports no device memory (the CPU)."""
    kv_cache_dtype: str = "auto"
    """The KV cache's dtype: auto (the model's), int8 or fp8 (e4m3): 8-bit keys and values, each
    token's keys and values of each KV head with a power-of-two scale kept in the page beside
    them, so a page takes about half the bytes of bfloat16 (a quarter of float32) and the pool
    sized from memory holds about twice as many. The keys are first centred, smoothed and (int8)
    rotated by a transform calibrated on the model at start-up, which leaves attention exact and
    shrinks the rounding error (models/kv_keys.py; docs/architecture.md, "Quantized KV cache")."""
    kv_layout: str = "auto"
    """How the KV pool holds the layers of a model whose layers differ (Gemma's local and
    global ones): 'hybrid' gives each group of layers its own page tables over one pool of
    pages, and a local layer's pages go back to the pool once they leave its window (about 79%
    fewer pages for gemma3-1b at 8k context); 'uniform' keeps every page for every layer.
    'auto': hybrid where the layers differ and no host KV pool was asked for (host_kv_gb, swap
    preemption: the host tier does not carry groups yet), uniform otherwise."""
    kv_cache_memory_fraction: float = 0.9
    """Share of each device's memory, free once params are placed, that the KV cache takes."""
    tensor_parallel: int = 1
    """Devices the model is split over (jaxserve/models/sharding.py)."""
    mesh_shape: tuple[int, int] | None = None
    """Device mesh (data, model); given, it wins over tensor_parallel."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the token budget over steps; off: each prompt runs whole in one
    step (needs a budget of max_model_len tokens)."""
    async_scheduling: bool = True
    """Plan step t+1 while the device runs step t, its sampled tokens fed on the device (engine
    module docstring); off: each step is planned once the last one's tokens are on the host."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full pages a request shares with one served before (a system prompt, a
    chat's history): admission skips them, and freed pages stay cached until needed."""
    host_kv_gb: float | None = None
    """Host memory for KV pages beyond the device pool (jaxserve/scheduling/offload.py): preempted
    requests' pages swapped out, and the host tier of the prefix cache. None: twice the device
    pool's bytes, at most a quarter of the memory free at start-up and 64 GB (taken only as pages
    are used; `serve` logs the size at start, /metrics shows it as jaxserve_host_kv_bytes); 0:
    off."""
    preemption: str | None = None
    """What a preempted request's KV becomes: recompute (dropped, computed again), swap (copied to
    the host pool and restored) or auto (per request, whichever the cost model prices cheaper);
    None: auto with a host pool, else recompute."""
    policy: str = "fcfs"
    """Order of admission: fcfs (arrival), or priority (a request's priority, then arrival)."""
    priority_aging_s: float | None = 10.0
    """Priority policy: a waiting request gains one priority level per this many seconds, so low
    priorities are never starved (SchedulerConfig.priority_aging_s); None: strict priority."""
    batching: str = "continuous"
    """continuous (any waiting request joins any step), static (groups of batch_size run until
    all members finish) or dynamic (static, but a group waits to be full unless its oldest
    request has waited dynamic_timeout_s); static and dynamic are kept for comparison."""
    batch_size: int | None = None
    """Group size of static and dynamic batching; None: max_num_seqs."""
    dynamic_timeout_s: float = 0.05
    """Dynamic batching: seconds a short group's oldest request waits before the group starts."""
    max_waiting_requests: int = 4096
    """Waiting requests beyond which new ones are refused as the queue is full."""
    attention_backend: str = "auto"
    """auto: xla on the CPU, the Pallas kernel on TPU/GPU; or one of
    jaxserve/models/attention.py's ATTENTION_BACKENDS (reference, xla, pallas, ...)."""
    min_token_bucket: int = 1
    """Smallest token bucket; 1: decode-only steps run exactly as many tokens as sequences."""
    token_bucket_factor: int = 2
    """Token buckets grow geometrically by this factor, up to max_num_batched_tokens."""
    token_bucket_step: int | None = None
    """Token buckets grow by at most this many tokens (model_runner.bucket_ladder): less padding
    for large steps, more buckets to compile; None: geometric by token_bucket_factor."""
    seq_bucket_factor: int = 2
    """Sequence buckets (rows of a step) grow geometrically by this factor."""
    precompile: bool = True
    """Compile every bucket at start-up, so that no request waits for a compile."""
    compilation_cache_dir: str | None = dataclasses.field(
        default_factory=default_compilation_cache_dir
    )
    """JAX's persistent compilation cache: a restart (or another engine of the same shapes)
    loads its buckets instead of compiling them again; $JAXSERVE_COMPILATION_CACHE sets the
    default; None or "" turns it off."""
    show_progress: bool = True
    """Progress bars while buckets compile."""
    ttft_slo_s: float | None = None
    """Time-to-first-token target, seconds: a request meeting both targets counts toward
    goodput; None: no target."""
    tpot_slo_s: float | None = None
    """Time-per-output-token target, seconds (see ttft_slo_s)."""
    slo_scheduling: bool = False
    """SLO-aware scheduling (jaxserve/scheduling/slo_policy.py): each step's prefill is sized so
    that the step's predicted time keeps decodes within tpot_slo_s, by the step-cost model
    (cost_model.py)."""
    cost_model: str | None = None
    """The step-cost model's JSON file (`jaxserve bench --profile steps`, or an earlier engine's
    calibration): loaded when it was measured for this model, dtype, device kind and buckets."""
    calibrate_cost_model: bool | None = None
    """Measure the cost model at warm-up (jaxserve/engine/calibration.py: a few timed steps per
    bucket, after precompile), saved to cost_model when a path is given. None: only when
    slo_scheduling has no file that applies; True: always; False: never (a file must apply)."""
    grammar_compile_timeout_s: float = 10.0
    """Structured output: seconds a request's grammar (JSON schema, regex, ...) may take to
    compile before the request is refused as too complex (jaxserve/engine/grammar.py)."""
    speculative: str | None = None
    """Speculative decoding: "ngram" proposes the tokens that followed the latest earlier
    occurrence of a request's last few tokens in its prompt and output (prompt lookup), and each
    step verifies them where that makes tokens cheaper; outputs are the same as without; None:
    off."""
    num_speculative_tokens: int = 4
    """Speculative decoding: tokens proposed per request per step, at most."""
    prompt_lookup_min: int = 2
    """Speculative decoding: the shortest n-gram of a request's last tokens looked up."""
    prompt_lookup_max: int = 3
    """Speculative decoding: the longest n-gram of a request's last tokens looked up (tried
    first)."""
    lora: tuple[str, ...] = ()
    """LoRA adapters served beside the base model, each NAME=PATH (a PEFT adapter folder:
    adapter_config.json and adapter_model.safetensors); a request names one by NAME (the OpenAI
    `model` field). Repeat the flag for more."""
    max_loras: int | None = None
    """Adapter slots on the device: adapters one step may mix (more may be registered; they wait
    in host memory and take a slot when a request needs them). None: 4 when lora names any, else
    0 (no adapters, and the step pays nothing for them)."""
    max_lora_rank: int = 16
    """Largest adapter rank served; every slot is this rank (smaller ones zero-padded)."""
    shed_late: bool = False
    """With slo_scheduling and a TTFT target: refuse (finish reason "refused") a waiting request
    that would miss ttft_slo_s even if started now, rather than spend capacity on one lost."""
    kv_events_endpoint: str | None = None
    """Publish the prefix cache's changes as vLLM's KV events on this ZeroMQ PUB endpoint, for a
    KV-aware router (docs/kv_events.md): tcp://*:PORT binds, tcp://HOST:PORT connects to a
    subscriber that binds (llm-d's indexer), ipc:// and inproc:// bind. None: off (no socket,
    nothing recorded). Needs pip install -e ".[serve]"."""
    kv_events_replay_endpoint: str | None = None
    """A ZeroMQ ROUTER endpoint, always bound, where a subscriber that missed batches asks for
    them again from a sequence number (vLLM's replay); None: no replay. Needs
    kv_events_endpoint."""
    kv_events_topic: str = ""
    """The topic frame of every KV events message (llm-d's indexer filters on one such as
    kv@POD@MODEL); "" : none."""
    kv_events_format: str = "map"
    """How each KV event is laid out (docs/kv_events.md): map, keyed by field name, as vLLM
    publishes since vllm-project/vllm#42892 and its current decoders and llm-d's indexer read;
    array, positional, as vLLM published before, for consumers that decode only that."""

    def __post_init__(self):
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "page_size",
            "min_token_bucket",
            "max_waiting_requests",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)} must be >= 1.")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs}: every running request needs a token a step."
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}: 'auto' "
                "keeps the KV cache in the model's dtype, 'int8' and 'fp8' (e4m3) store it in "
                "8 bits with scales."
            )
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(
                f"kv_layout={self.kv_layout!r} is not one of {KV_LAYOUTS}: 'hybrid' frees a "
                "local layer's pages past its window, 'uniform' keeps every page for every layer."
            )
        if self.kv_layout == "hybrid" and (self.host_kv_gb or self.preemption in ("swap", "auto")):
            raise ValueError(
                f"kv_layout='hybrid' has no host KV pool yet, but host_kv_gb={self.host_kv_gb} and "
                f"preemption={self.preemption!r} ask for one: use kv_layout='uniform' for the "
                "host tier, or leave host_kv_gb and preemption unset."
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} must be one of {QUANTIZATIONS}.")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching={self.batching!r} must be one of {BATCHING_MODES}.")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} must be one of {POLICIES}.")
        aging = self.priority_aging_s
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(
                f"EngineConfig.grammar_compile_timeout_s={self.grammar_compile_timeout_s} must "
                "be > 0."
            )
        if aging is not None and not (isinstance(aging, int | float) and 0 < aging < math.inf):
            raise ValueError(
                f"priority_aging_s={aging!r} must be a finite number of seconds > 0, or None "
                f"for strict priority."
            )
        if self.host_kv_gb is not None and not (
            isinstance(self.host_kv_gb, int | float) and 0 <= self.host_kv_gb < math.inf
        ):
            raise ValueError(
                f"host_kv_gb={self.host_kv_gb!r} must be a number of GB >= 0 (0: no host pool), "
                f"or None to size it from free memory."
            )
        if self.preemption is not None and self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption={self.preemption!r} must be one of {PREEMPTION_MODES}.")
        if self.preemption in ("swap", "auto") and self.host_kv_gb == 0:
            raise ValueError(
                f"preemption={self.preemption!r} swaps pages to the host KV pool, which "
                f"host_kv_gb=0 turns off: give it memory, or use preemption='recompute'."
            )
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages={self.num_pages} must be >= 1 (or None to size it).")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb={self.kv_cache_memory_gb} must be > 0.")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(
                f"kv_cache_memory_fraction={self.kv_cache_memory_fraction} must be in (0, 1]."
            )
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel={self.tensor_parallel} must be >= 1.")
        if self.mesh_shape is not None and (len(self.mesh_shape) != 2 or min(self.mesh_shape) < 1):
            raise ValueError(f"mesh_shape={self.mesh_shape} must be (data, model), both >= 1.")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2.")
        if self.token_bucket_step is not None and self.token_bucket_step < 1:
            raise ValueError(
                f"token_bucket_step={self.token_bucket_step} must be >= 1 (or None: geometric)."
            )
        if self.slo_scheduling and (
            self.tpot_slo_s is None or (not self.cost_model and self.calibrate_cost_model is False)
        ):
            raise ValueError(
                f"slo_scheduling needs a TPOT target and a step-cost model (a file, or one "
                f"measured at warm-up): tpot_slo_s={self.tpot_slo_s!r}, "
                f"cost_model={self.cost_model!r}, calibrate_cost_model="
                f"{self.calibrate_cost_model!r}."
            )
        if self.shed_late and (not self.slo_scheduling or self.ttft_slo_s is None):
            raise ValueError(
                f"shed_late needs slo_scheduling and a TTFT target: slo_scheduling="
                f"{self.slo_scheduling}, ttft_slo_s={self.ttft_slo_s!r}."
            )
        _check_kv_events(self)
        self.speculative_config  # noqa: B018 - validates the speculative fields (ValueError)
        if self.token_bucket_factor < 2 or self.seq_bucket_factor < 2:
            raise ValueError(
                f"Bucket factors must be >= 2: {self.token_bucket_factor=}, "
                f"{self.seq_bucket_factor=}."
            )
        object.__setattr__(self, "lora", tuple(self.lora))  # a list would break hashing
        for spec in self.lora:
            name, sep, path = spec.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora={spec!r} must be NAME=PATH (a PEFT adapter folder).")
        if self.max_loras is None:
            object.__setattr__(self, "max_loras", 4 if self.lora else 0)
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras={self.max_loras} must be >= 0 and max_lora_rank="
                f"{self.max_lora_rank} >= 1."
            )

    @property
    def lora_modules(self) -> dict[str, str]:
        """The adapters of `lora`, NAME -> PATH."""
        return dict(spec.partition("=")[::2] for spec in self.lora)

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        """The scheduler's speculative decoding knobs; None when off."""
        if self.speculative is None:
            return None
        return SpeculativeConfig(
            method=self.speculative,
            num_speculative_tokens=self.num_speculative_tokens,
            prompt_lookup_min=self.prompt_lookup_min,
            prompt_lookup_max=self.prompt_lookup_max,
        )

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """The token buckets an engine of this config compiles its step for."""
        budget = self.max_num_batched_tokens
        return bucket_ladder(
            min(self.min_token_bucket, budget),
            budget,
            self.token_bucket_factor,
            self.token_bucket_step,
        )

    def scheduler_config(
        self,
        *,
        max_model_len: int,
        num_pages: int,
        prefix_cache_key: str = "",
        num_host_pages: int = 0,
        kv_windows: tuple[int | None, ...] = (None,),
    ) -> SchedulerConfig:
        """The scheduler's limits and mode for an engine of this config: the one mapping the
        engine and the simulator share (the pool sizes and context are the engine's to decide)."""
        return SchedulerConfig(
            num_host_pages=num_host_pages,
            preemption=self.preemption or ("auto" if num_host_pages else "recompute"),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_pages=num_pages,
            page_size=self.page_size,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_cache_key=prefix_cache_key,
            policy=self.policy,
            priority_aging_s=self.priority_aging_s,
            batching=self.batching,
            batch_size=self.batch_size or self.max_num_seqs,
            dynamic_timeout_s=self.dynamic_timeout_s,
            max_waiting_requests=self.max_waiting_requests,
            max_loras=self.max_loras,
            # Steps then land on the buckets the runner pads them to (less padding).
            token_buckets=self.token_buckets,
            speculative=self.speculative_config,
            kv_windows=kv_windows,
        )
