"""The prepared accelerator check: one call that runs, measures and reports jaxserve on a GPU.

    python -m jaxserve.bench.accelerator_check --out DIR [--dry-run] [--budget-s 480]

A GPU is lent in short, metered sessions, so everything the check needs is prepared here and
dry-run on the CPU (`--dry-run`: a tiny model, the interpret kernel, a few short requests) so
that no GPU minute is spent on a typo. Stages run in order of importance, each in its own
subprocess under its own time limit (capped by what is left of `--budget-s`):

1. environment: device kind, compute capability, JAX/jaxlib/CUDA versions, memory_stats.
2. gpu_check: `python -m pallas_kernels.gpu_check` (kernel tests natively, kernel timings).
3. engine_correctness: llama3.2-1b (random weights, bfloat16) with attention backends `pallas`
   and `xla`: greedy tokens of 16 mixed-length prompts compared, compiles after warm-up, the KV
   pool sized from the device's free memory.
4. tiny_f32_vs_cpu: a float32 llama-tiny's greedy tokens on the device against the CPU engine's
   (the CPU half in a subprocess with JAX_PLATFORMS=cpu).
5. speed: per backend, single-stream TPOT and its memory-bandwidth utilisation, bursts of 64 and
   256 requests, the mixed profile at a saturating rate (jaxserve/bench workloads and metrics).
6. features: speculative decoding and structured output on the device, on tiny shapes: greedy
   tokens with every n-gram proposal verified against without speculation, and constrained
   samples checked (needs llguidance and jsonschema, which the GPU machine must be given).
7. peer: the same bursts through Hugging Face transformers' continuous batching (torch).

Why subprocesses: a stage that hangs or runs out of device memory is killed alone, the next one
starts on a clean device (JAX keeps what it allocated until its process exits, and torch must
not share the GPU with it), and the parent never initialises a device itself. After every stage
the parent rewrites DIR/report.json and DIR/summary.md, so a run cut short by the device's time
limit still leaves everything done so far (with the last lines of each stage's log in
DIR/stages.log: three files, since the device tool brings back eight at most). Each stage's
own JSON and full log go to `--work-dir`, kept; without it, to a temporary folder removed when
the check ends, success or not (report.json holds every stage's JSON). Compiled buckets
go to a persistent compilation cache shared by the stages, so the speed stage reloads what the
correctness stage compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# (stage, time limit in seconds on the device, in the dry run). Most important first. The dry
# run's limits are loose: it spends about 90 CPU-seconds in all, but CI machines are shared and
# a dry run must not fail for a neighbour's load.
STAGES = (
    ("environment", 60, 120),
    ("gpu_check", 150, 120),
    ("engine_correctness", 150, 240),
    ("tiny_f32_vs_cpu", 90, 240),
    ("speed", 180, 240),
    ("features", 90, 240),
    ("peer", 120, 240),
)
MIN_STAGE_S = 15  # a stage with less time than this left is skipped, not started
LOG_LINES = 300  # of each stage's log, kept in OUT/stages.log

# The acceptance targets, checked in the summary.
MAX_KERNEL_ERROR = 2e-2
MIN_MBU = 0.5
MIN_PEER_RATIO = 1.5
MIN_KERNEL_SPEEDUP = 2.0


# ---- what each stage runs on ----------------------------------------------------------------


def plan(dry_run: bool) -> dict:
    """The model, engine knobs and workload sizes of a run: the GPU's, or the dry run's tiny
    ones. Token and sequence buckets grow by 4, not 2, so each backend compiles 6 shapes on the
    GPU (about 10-30 s each for llama3.2-1b) instead of 11."""
    if dry_run:
        return dict(
            model="llama-tiny",
            dtype="float32",
            backends=("pallas_gpu_interpret", "xla"),
            # One bucket per backend: compiles are most of the dry run's time.
            engine=dict(
                max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=16, max_model_len=128
            ),
            prompt_lens=tuple(range(3, 51, 3))[:16],  # 16 mixed lengths
            correctness_tokens=4,
            single=dict(num_requests=1, prompt_len=8, max_tokens=8),
            bursts={"burst4": 4, "burst8": 8},
            burst_lengths=dict(prompt_range=(8, 24), output_range=(6, 6)),
            mixed=dict(num_requests=8, prompt_range=(4, 16), output_range=(2, 8)),
            tiny_prompt_lens=(3, 9, 17, 30),
            tiny_tokens=6,
            feature_tokens=32,  # enough for llama-tiny's output to repeat itself: proposals
            # The correctness stage's xla engine, so both halves load it from the cache.
            tiny_engine={},
        )
    return dict(
        model="llama3.2-1b",
        dtype="bfloat16",
        backends=("pallas", "xla"),
        # A 16k context makes the pool's cap (256 rows x 1024 pages) larger than the device's
        # free memory, so the pool is really sized from memory_stats().
        engine=dict(max_num_seqs=256, max_num_batched_tokens=1024, max_model_len=16384),
        prompt_lens=(3, 7, 16, 17, 31, 64, 100, 129, 200, 255, 256, 300, 384, 450, 500, 511),
        correctness_tokens=32,
        single=dict(num_requests=3, prompt_len=128, max_tokens=128),
        bursts={"burst64": 64, "burst256": 256},
        burst_lengths=dict(prompt_range=(128, 512), output_range=(128, 128)),
        mixed=dict(num_requests=None, prompt_range=(32, 128), output_range=(16, 64)),
        tiny_prompt_lens=(3, 9, 17, 30, 64, 100, 129, 200),
        tiny_tokens=32,
        feature_tokens=32,
        # One bucket: each half compiles once (the CPU half concurrently with the device's).
        tiny_engine=dict(
            max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64, max_model_len=512
        ),
    )


# JAX's persistent compilation cache the stages share, unless --compilation-cache-dir is given.
CACHE_DIR = os.path.join(tempfile.gettempdir(), "jaxserve-accelerator-check-xla")


def plan_engine(p: dict) -> dict:
    """The plan's engine fields: what the engine flags not given are here."""
    return dict(
        model=p["model"],
        dtype=p["dtype"],
        token_bucket_factor=4,
        seq_bucket_factor=4,
        compilation_cache_dir=CACHE_DIR,
        **p["engine"],
    )


def engine_config(args, p: dict, backend: str, **overrides):
    """The EngineConfig every stage builds its engines from (one set of buckets per backend):
    the plan's, but for the engine flags given. The attention backend is what the stages
    compare, so it is the stage's to set, whatever --attention-backend says."""
    from jaxserve.engine_args import engine_config_from_args

    return engine_config_from_args(
        args, plan_engine(p), attention_backend=backend, show_progress=False, **overrides
    )


def prompt_ids(lengths, vocab_size: int, tag: str) -> list[list[int]]:
    """Random prompts of the given lengths, fixed by `tag`: every process draws the same."""
    from jaxserve.bench.workload import RequestSpec, random_prompt_ids

    return [
        random_prompt_ids(
            RequestSpec(request_id=f"{tag}-{i}", arrival_s=0.0, prompt_len=n, max_tokens=1),
            vocab_size,
        )
        for i, n in enumerate(lengths)
    ]


def greedy_tokens(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of `prompts` on `engine`, EOS ignored so every output has its length."""
    from jaxserve.engine.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in LLM(engine=engine).generate(prompts, params)]


def compare_tokens(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many outputs are equal, and where the first unequal one first differs."""
    equal = [x == y for x, y in zip(a, b, strict=True)]
    out: dict = {"num_prompts": len(a), "num_equal": sum(equal), "first_divergence": None}
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            pos = next(
                (j for j, (s, t) in enumerate(zip(x, y, strict=False)) if s != t),
                min(len(x), len(y)),
            )
            out["first_divergence"] = {
                "prompt": i,
                "position": pos,
                "a": x[pos:][:4],
                "b": y[pos:][:4],
            }
            break
    return out


def device_memory() -> dict | None:
    """memory_stats() of the first device (None on the CPU, which does not report it)."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except (RuntimeError, NotImplementedError):
        return None
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "bytes_reservable_limit")
    return {k: int(stats[k]) for k in keys if stats and k in stats} or None


# ---- stages (each runs in its own process; `result` is written out on every change) ----------


class Stage:
    """The result dict of one running stage, saved to its file whenever it changes."""

    def __init__(self, path: Path, args):
        self.path, self.args = path, args
        self.plan = plan(args.dry_run)
        self.result: dict = {}

    def put(self, key: str, value) -> None:
        self.result[key] = value
        self.path.write_text(json.dumps(self.result, indent=2, default=str))


# What the stages import beyond the standard library. The GPU machine has JAX, flax, orbax,
# transformers and torch; anything else missing there must be carried (docs/accelerators).
NEEDED_MODULES = (
    "jax",
    "flax",
    "orbax.checkpoint",
    "numpy",
    "tqdm",
    "safetensors",
    "prometheus_client",
    "transformers",
    "torch",
    "pytest",  # gpu_check runs the kernel tests with it
    "llguidance",  # features: structured output's grammar engine
    "jsonschema",  # features: validates the constrained JSON (parsed only without it)
)


def stage_environment(s: Stage) -> None:
    import importlib.metadata as md
    import importlib.util

    import jax

    device = jax.devices()[0]
    versions = {
        d.metadata["Name"]: d.version
        for d in md.distributions()
        if d.metadata["Name"]
        and d.metadata["Name"].lower().startswith(("jax", "nvidia-cu", "torch", "transformers"))
    }
    missing = []
    for name in NEEDED_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # its parent package is missing
            found = False
        if not found:
            missing.append(name)
    s.put("missing_modules", missing)
    s.put("backend", jax.default_backend())
    s.put("device_kind", device.device_kind)
    s.put("num_devices", jax.device_count())
    s.put("compute_capability", getattr(device, "compute_capability", None))
    s.put("jax_version", jax.__version__)
    s.put("jaxlib_version", versions.get("jaxlib"))
    s.put("packages", dict(sorted(versions.items())))
    s.put("memory_stats", device_memory())
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        s.put("nvidia_smi", smi.stdout.strip() or smi.stderr.strip())
    except (OSError, subprocess.TimeoutExpired) as e:
        s.put("nvidia_smi", f"not available: {e}")
    info = jax.print_environment_info(return_string=True)
    s.put("cuda", [line for line in info.splitlines() if "cuda" in line.lower()][:10])


def stage_engine_correctness(s: Stage) -> None:
    """Both backends on the big model: equal greedy tokens, no compiles, pool from memory.

    A backend that fails (a kernel that does not compile, say) is recorded and the other still
    runs; the stage then ends in error, naming it.
    """
    import gc

    p = s.plan
    outputs, failed = {}, []
    for backend in p["backends"]:
        try:
            outputs[backend] = _correctness_of(s, backend)
        except Exception as e:
            failed.append(backend)
            s.put(backend, {"error": f"{type(e).__name__}: {e}"})
        gc.collect()  # the engine's pool goes before the next backend sizes its own
    a, b = p["backends"]
    if a in outputs and b in outputs:
        s.put("tokens_equal", compare_tokens(outputs[a], outputs[b]))
    if failed:
        s.put("error", f"Backends {failed} failed; see their entries.")


def _correctness_of(s: Stage, backend: str) -> list[list[int]]:
    """One backend's engine: built, asked for greedy tokens, its pool and compiles recorded."""
    from jaxserve.engine.build import build_engine
    from jaxserve.models.kv_pool import kv_bytes_per_page, pages_that_fit

    p = s.plan
    before = device_memory()
    start, cpu = time.perf_counter(), time.process_time()
    engine = build_engine(engine_config(s.args, p, backend))
    build = {
        "build_s": round(time.perf_counter() - start, 2),
        "build_cpu_s": round(time.process_time() - cpu, 2),
        "buckets": engine.runner.config.buckets(),
    }
    warm = engine.runner.num_compiles
    prompts = prompt_ids(p["prompt_lens"], engine.model.config.vocab_size, "correctness")
    start = time.perf_counter()
    tokens = greedy_tokens(engine, prompts, p["correctness_tokens"])
    rc, cfg = engine.runner.config, engine.config
    kv_dtype = engine.runner.kv_dtype  # the pool's: the model's, or 8 bits (--kv-cache-dtype)
    page_bytes = kv_bytes_per_page(
        engine.model.config, rc.page_size, kv_dtype, engine.runner.sharding.pool_lanes(kv_dtype)
    )
    cap = cfg.max_num_seqs * rc.pages_per_seq  # what the engine would take with memory to spare
    s.put(
        backend,
        build
        | {
            "compiles_at_warmup": warm,
            "compiles_after_warmup": engine.runner.num_compiles - warm,
            "generate_s": round(time.perf_counter() - start, 3),
            "num_pages": rc.num_pages,
            "page_bytes": page_bytes,
            "kv_pool_bytes": rc.num_pages * page_bytes,
            "pages_cap": cap,
            "sized_from_memory": rc.num_pages < cap,
            # The engine's sizing rule again, with its pool in place: what is still free.
            "pages_that_fit_now": pages_that_fit(
                page_bytes,
                [engine.sharding.mesh.devices.flat[0]],
                fraction=1.0,
                fallback_gb=cfg.kv_cache_memory_gb,
            ),
            "memory_before": before,
            "memory_after": device_memory(),
            "tokens": tokens,
        },
    )
    return tokens


def stage_tiny_f32_vs_cpu(s: Stage) -> None:
    """A float32 llama-tiny's greedy tokens here against the CPU engine's (a subprocess)."""
    p = s.plan
    cpu_out = s.path.with_name("tiny_cpu_tokens.json")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [
        sys.executable,
        "-m",
        "jaxserve.bench.accelerator_check",
        "--tiny-cpu-tokens",
        str(cpu_out),
    ]
    cmd += _engine_flags(s.args) + (["--dry-run"] if s.args.dry_run else [])
    log_path = s.path.with_name("tiny_cpu.log")
    with open(log_path, "w") as log:  # a file, not a pipe nobody reads while the device runs
        cpu = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    import jax

    # Full-precision f32 matmuls: TF32 on the GPU would differ from the CPU by design. (Not
    # set on the CPU, where it is the default anyway and would only change the cache key.)
    on_cpu = jax.default_backend() == "cpu"
    with contextlib.nullcontext() if on_cpu else jax.default_matmul_precision("highest"):
        here = tiny_tokens(s.args, p, backend="auto")
    s.put("device_backend", jax.default_backend())
    s.put("device_tokens", here)
    if cpu.wait() != 0:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"The CPU half exited with {cpu.returncode}: {tail}")
    theirs = json.loads(cpu_out.read_text())
    s.put("cpu_tokens", theirs)
    s.put("tokens_equal", compare_tokens(here, theirs))


def tiny_tokens(args, p: dict, backend: str) -> list[list[int]]:
    from jaxserve.engine.build import build_engine

    # The stage's own small engine, whatever the engine flags say: the same on both halves.
    tiny = dict(p["tiny_engine"], model="llama-tiny", dtype="float32")
    engine = build_engine(engine_config(args, p, backend, **tiny))
    prompts = prompt_ids(p["tiny_prompt_lens"], engine.model.config.vocab_size, "tiny")
    return greedy_tokens(engine, prompts, p["tiny_tokens"])


def stage_speed(s: Stage) -> None:
    """Per backend: single stream (TPOT, MBU), bursts, the mixed profile at saturation."""
    import gc

    from jaxserve.engine.build import build_engine

    failed = []
    for backend in s.plan["backends"]:
        result: dict = {}
        try:
            engine = build_engine(engine_config(s.args, s.plan, backend))
            speed_of(engine, s.plan, result, lambda b=backend, r=result: s.put(b, r))
        except Exception as e:  # keep the other backend's numbers
            failed.append(backend)
            s.put(backend, result | {"error": f"{type(e).__name__}: {e}"})
        engine = None  # the pool goes before the next backend sizes its own
        gc.collect()
    if failed:
        s.put("error", f"Backends {failed} failed; see their entries.")


def burst_seed(index: int) -> int:
    """The prompt seed of the index-th burst, the same for jaxserve and the peer. Bursts share
    request ids (the larger's first requests are the smaller's), so without their own seeds
    they would share prompts, and the prefix cache would serve the second from the first."""
    return 1 + index


def speed_of(engine, p: dict, result: dict, save) -> None:
    """Fills `result` with one backend's runs, calling `save` after each."""
    from jaxserve.bench.metrics import SLO, summarize
    from jaxserve.bench.runner import run_offline
    from jaxserve.bench.workload import LengthMix, fixed_length_workloads, mixed_workloads
    from jaxserve.models.kv_pool import kv_bytes_per_page

    slo = SLO(ttft_s=1.0, tpot_s=0.1)  # `jaxserve bench`'s defaults
    warm = fixed_length_workloads([1], num_requests=1, prompt_len=8, max_tokens=4)[0]
    run_offline(engine, warm, label="warm-up")  # first-run costs outside the timed runs

    def run(workload, seed: int) -> dict:
        r = run_offline(engine, workload, label=workload.name, seed=seed)
        summary = summarize(r, slo)
        e = r.engine or {}
        summary["device_busy_per_step_s"] = (
            e["busy_wall_s"] / e["steps"] if e.get("steps") else None
        )
        return _trim(summary)

    def put(name: str, value: dict) -> None:
        result[name] = value
        save()

    single = fixed_length_workloads([1], **p["single"])[0]
    one = run(single, seed=0)
    mc = engine.model.config
    kv_per_token = kv_bytes_per_page(mc, 1, engine.model.dtype)
    context = p["single"]["prompt_len"] + p["single"]["max_tokens"] / 2  # the mean decode step's
    bytes_per_step = one["memory"]["param_bytes"] + kv_per_token * context
    peak, peak_error = _peak_bandwidth()
    tpot, step = one["tpot"]["p50"], one["device_busy_per_step_s"]
    one["bytes_per_step"] = bytes_per_step
    one["peak_bandwidth_gb_per_s"] = peak / 1e9 if peak else peak_error
    one["mbu"] = bytes_per_step / tpot / peak if peak and tpot else None
    one["mbu_device_busy"] = bytes_per_step / step / peak if peak and step else None
    put("single", one)

    lengths = LengthMix(**p["burst_lengths"], long_share=0.5)
    for i, (name, count) in enumerate(p["bursts"].items()):
        burst = mixed_workloads([math.inf], num_requests=count, mix=lengths, seed=0)[0]
        put(name, run(burst, seed=burst_seed(i)))

    # Saturating: the mixed requests per second the largest burst's output rate would carry.
    last = list(p["bursts"])[-1]
    mix = LengthMix(
        prompt_range=p["mixed"]["prompt_range"], output_range=p["mixed"]["output_range"]
    )
    mean_out = sum(p["mixed"]["output_range"]) / 2
    rate = max(1.0, 1.2 * result[last]["output_token_throughput"] / mean_out)
    n = p["mixed"]["num_requests"] or int(min(1024, max(64, rate * 8)))
    mixed = mixed_workloads([rate], num_requests=n, mix=mix, seed=0)[0]
    put(
        "mixed",
        run(mixed, seed=len(p["bursts"]) + 1)
        | {"rate_per_s": rate, "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}},
    )


def _peak_bandwidth() -> tuple[float | None, str | None]:
    """The device's peak HBM bandwidth from gpu_check's table (one table for both reports)."""
    import jax

    try:
        from pallas_kernels.gpu_check import peak_bandwidth
    except Exception as e:  # the kernel module failing to import must not cost the speed stage
        return None, f"pallas_kernels.gpu_check not importable: {type(e).__name__}: {e}"
    kind = jax.devices()[0].device_kind
    peak = peak_bandwidth(kind)
    return peak, None if peak else f"no peak bandwidth known for {kind!r}"


def _trim(summary: dict) -> dict:
    """The bench summary without what the report does not need (per-run labels, nulls)."""
    drop = ("label", "load_kind", "prefix_cache", "requests_preempted")
    return {k: v for k, v in summary.items() if k not in drop}


def stage_peer(s: Stage) -> None:
    """The bursts through transformers' continuous batching, torch bfloat16, same shapes."""
    import importlib.metadata as md

    from checkpoints import NAMED_SHAPES
    from jaxserve.bench.workload import LengthMix, mixed_workloads, random_prompt_ids

    s.put("transformers_version", md.version("transformers"))
    s.put("torch_version", md.version("torch"))
    import torch
    from transformers import GenerationConfig

    dry = s.args.dry_run
    device = "cpu" if dry or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    mc = NAMED_SHAPES[engine_config(s.args, s.plan, "xla").model]  # the engines' model
    model = _hf_model(mc, device, dtype)
    s.put("device", torch.cuda.get_device_name() if device == "cuda" else "cpu")
    s.put("dtype", str(dtype))
    if not hasattr(model, "init_continuous_batching"):
        raise RuntimeError(
            f"transformers {md.version('transformers')} has no continuous batching "
            "(PreTrainedModel.init_continuous_batching); the peer cannot run."
        )
    out_len = s.plan["burst_lengths"]["output_range"][1]
    gen = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    options = _cb_config(dry)
    if "workload_hints" in inspect.signature(model.init_continuous_batching).parameters:
        # What generate_batch tells the manager about its inputs, so it sizes itself the same.
        from transformers.generation.continuous_batching.utils import WorkloadHints

        options["workload_hints"] = WorkloadHints(
            max_prompt_length=s.plan["burst_lengths"]["prompt_range"][1],
            max_generated_length=out_len,
            num_requests=max(s.plan["bursts"].values()),
        )
    s.put("options", {k: repr(v) for k, v in options.items()})
    manager = model.init_continuous_batching(generation_config=gen, **options)
    if hasattr(manager, "warmup") and not dry:
        start = time.perf_counter()
        manager.warmup()  # CUDA graphs captured before the timed runs, as jaxserve precompiles
        s.put("warmup_s", round(time.perf_counter() - start, 2))
    s.put("attn_implementation", getattr(model.config, "_attn_implementation", None))
    manager.start()
    try:
        _peer_burst(manager, [[5, 6, 7, 8]] * 4, 4)  # first-run costs outside the timed runs
        lengths = LengthMix(**s.plan["burst_lengths"], long_share=0.5)
        for i, (name, count) in enumerate(s.plan["bursts"].items()):
            workload = mixed_workloads([math.inf], num_requests=count, mix=lengths, seed=0)[0]
            prompts = [
                random_prompt_ids(r, mc.vocab_size, burst_seed(i)) for r in workload.requests
            ]
            s.put(name, _peer_burst(manager, prompts, out_len))
    finally:
        manager.stop(block=True, timeout=10)


def _hf_model(mc, device: str, dtype):
    """A randomly initialised transformers Llama of the named shape (weights not shared: a
    speed peer needs the same shapes, not the same values)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = mc.rope
    scaling = None
    if rope.rope_type == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": rope.factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    config = LlamaConfig(
        vocab_size=mc.vocab_size,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_heads,
        num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        max_position_embeddings=mc.max_position_embeddings,
        rms_norm_eps=mc.rms_norm_eps,
        rope_theta=rope.theta,
        rope_scaling=scaling,
        tie_word_embeddings=mc.tie_word_embeddings,
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the target dtype on the device: no f32 copy
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def _cb_config(dry: bool) -> dict:
    """A small continuous-batching cache for the CPU (sized from GPU memory otherwise)."""
    if not dry:
        return {}
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:  # older 5.x: the manager's defaults
        return {}
    small = ContinuousBatchingConfig(
        page_size=16, num_blocks=64, max_batch_tokens=64, max_requests_per_batch=8
    )
    return {"continuous_batching_config": small}


def _peer_burst(manager, prompts: list[list[int]], max_tokens: int) -> dict:
    """Sends every prompt at once and waits for all; output tokens/s over the burst's span."""
    import numpy as np

    # Older 5.x managers may not record token timestamps: then only throughput is reported.
    accepts = inspect.signature(manager.add_requests).parameters
    stamps = {"record_timestamps": True} if "record_timestamps" in accepts else {}
    start = time.perf_counter()
    ids = manager.add_requests(inputs=prompts, max_new_tokens=max_tokens, **stamps)
    done: dict = {}
    while len(done) < len(ids):
        r = manager.get_result(timeout=1)
        if r is not None and r.is_finished():
            done[r.request_id] = r
        elif r is None and not manager.is_running():
            raise RuntimeError(
                f"The transformers manager stopped with {len(done)}/{len(ids)} done."
            )
    span = time.perf_counter() - start
    errors = [r.error for r in done.values() if r.error]
    out_tokens = sum(len(r.generated_tokens) for r in done.values())
    # Timestamps are time.perf_counter() values, like `start`.
    times = [t for r in done.values() if (t := getattr(r, "timestamps", None))]
    ttft = [t[0] - start for t in times]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    return {
        "num_requests": len(ids),
        "num_errors": len(errors),
        "first_error": errors[0] if errors else None,
        "duration_s": span,
        "output_tokens": out_tokens,
        "output_token_throughput": out_tokens / span,
        "ttft": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "tpot": {"p50": pct(tpot, 50), "p99": pct(tpot, 99)},
    }


def stage_features(s: Stage) -> None:
    """Speculative decoding and structured output on the device: their device paths (the
    verification rows and `sampling.verify`; the grammar mask's branch) run nowhere else.
    Tiny shapes, one bucket per engine: llama-tiny's greedy tokens with every n-gram proposal
    verified (each step priced flat) against without speculation, over prompts that repeat a
    passage; then qwen3-tiny with a byte-level BPE, a few samples per constraint at
    temperature 1.0, each finished one checked."""
    import importlib.util

    from jaxserve.engine.build import build_engine

    p = s.plan
    tiny = dict(p["tiny_engine"], model="llama-tiny", dtype="float32")
    base = build_engine(engine_config(s.args, p, "auto", **tiny))
    spec = build_engine(engine_config(s.args, p, "auto", speculative="ngram", **tiny))
    spec.scheduler.set_step_cost(lambda spans: 1.0)  # every proposal verified, at any price
    warm = spec.runner.num_compiles
    vocab = base.model.config.vocab_size
    # Two requests (of the tiny engine's 4 rows, the rest for proposals), each a passage said
    # three times, as the bench's repetitive profile.
    prompts = [q * 3 for q in prompt_ids([16, 16], vocab, "features")]
    want = greedy_tokens(base, prompts, p["feature_tokens"])
    got = greedy_tokens(spec, prompts, p["feature_tokens"])
    stats = spec.metrics.stats
    s.put(
        "speculative",
        {
            "tokens_equal": compare_tokens(got, want),
            "verifications": stats.spec_verifications,
            "proposed": stats.spec_proposed_tokens,
            "accepted": stats.spec_accepted_tokens,
            "compiles_after_warmup": spec.runner.num_compiles - warm,
        },
    )
    del base, spec
    if importlib.util.find_spec("llguidance") is None:
        s.put("structured", "not run: llguidance is missing (carry it: docs/accelerators)")
        return
    s.put("structured", _constrained_samples(s.args, p, tiny))


def _constrained_samples(args, p: dict, tiny: dict) -> dict:
    """qwen3-tiny (random weights, a byte-level BPE of its vocabulary) under each of the
    structured-output bench's constraints: finished samples, each checked (raises if not).
    Without jsonschema (a compiled dependency that may not travel to the device) the JSON is
    parsed, not validated, and the report says so."""
    import importlib.util

    from checkpoints import load_model
    from checkpoints.byte_bpe import byte_bpe_tokenizer
    from jaxserve.bench import structured
    from jaxserve.engine.build import build_engine
    from jaxserve.engine.llm import LLM

    config = engine_config(args, p, "auto", **dict(tiny, model="qwen3-tiny"))
    model = load_model("qwen3-tiny")
    model.tokenizer = byte_bpe_tokenizer(model.config.vocab_size)
    llm = LLM(engine=build_engine(config, model))
    warm = llm.engine.runner.num_compiles
    room = config.max_model_len - 8  # the prompt is a few tokens
    validate = None
    if importlib.util.find_spec("jsonschema") is not None:
        from jsonschema import validate
    report = {"json_checked_by": "jsonschema" if validate else "json.loads (jsonschema missing)"}
    n = 8
    for kind in structured.CONSTRAINTS:
        done = structured.finished_samples(llm, kind, n, room, validate)
        report[kind] = {"finished": done, "samples": n, "all_valid": True}
    report["compiles_after_warmup"] = llm.engine.runner.num_compiles - warm
    return report


STAGE_FNS = {
    "environment": stage_environment,
    "engine_correctness": stage_engine_correctness,
    "tiny_f32_vs_cpu": stage_tiny_f32_vs_cpu,
    "speed": stage_speed,
    "features": stage_features,
    "peer": stage_peer,
}


# ---- the parent: stages in order, each in a subprocess; the report after each ---------------


def run_stage_process(name: str, args, limit_s: float) -> dict:
    """Runs one stage in a subprocess under `limit_s`; its result, whatever happened."""
    out = args.work_dir / f"{name}.json"
    out.unlink(missing_ok=True)
    if name == "gpu_check":
        cmd = [sys.executable, "-m", "pallas_kernels.gpu_check", "--out", str(out)]
        cmd += ["--batches", "1,16,64,256", "--contexts", "512,2048,8192"]
        # gpu_check runs its kernel tests in a second process while holding the device: without
        # preallocation neither takes 75% of the memory for itself.
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    else:
        cmd = [sys.executable, "-m", "jaxserve.bench.accelerator_check", "--stage", name]
        cmd += ["--work-dir", str(args.work_dir), *_engine_flags(args)]
        cmd += ["--dry-run"] if args.dry_run else []
        env = dict(os.environ, JAX_PLATFORMS="cpu") if args.dry_run else dict(os.environ)
    log_path = args.work_dir / f"{name}.log"
    start, cpu_before = time.perf_counter(), _children_cpu_s()
    with open(log_path, "w") as log:
        # Its own process group: a timeout ends the stage's children too (gpu_check's pytest).
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    seconds = round(time.perf_counter() - start, 1)
    cpu_s = round(_children_cpu_s() - cpu_before, 1)  # on a shared machine: the stage's own cost
    result = json.loads(out.read_text()) if out.exists() else {}
    lines = log_path.read_text(errors="replace").strip().splitlines()
    with open(args.out / "stages.log", "a") as all_logs:  # one file: $OUT brings back 8 at most
        all_logs.write(f"==== {name} ({len(lines)} lines, the last {LOG_LINES}) ====\n")
        all_logs.write("\n".join(lines[-LOG_LINES:]) + "\n")
    tail = lines[-30:]
    record = {"seconds": seconds, "cpu_s": cpu_s, "limit_s": round(limit_s, 1), "result": result}
    if rc is None:
        return record | {
            "status": "timeout",
            "error": f"Killed after {limit_s:.0f} s.",
            "log_tail": tail,
        }
    if name == "gpu_check" and rc == 2 and any("needs a GPU" in line for line in tail):
        return record | {"status": "skipped", "reason": " ".join(tail)[:500]}
    if rc != 0:
        error = result.pop("error", None) or f"Exited with status {rc}."
        return record | {"status": "error", "error": error, "log_tail": tail}
    status = "error" if "error" in result else "ok"
    return record | {"status": status, **({"error": result["error"]} if "error" in result else {})}


def _engine_flags(args) -> list[str]:
    """The engine flags of this command line, for a stage's process to build the same engines."""
    from jaxserve.engine_args import engine_argv, engine_values

    return engine_argv(engine_values(args))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_all(args) -> dict:
    """Every stage in order under the budget; report.json and summary.md after each."""
    args.out.mkdir(parents=True, exist_ok=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    (args.out / "stages.log").unlink(missing_ok=True)
    deadline = time.monotonic() + args.budget_s
    report = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "budget_s": args.budget_s,
        "plan": plan(args.dry_run),
        "stages": {},
    }
    for name, limit, dry_limit in STAGES:
        if args.stages and name not in args.stages:
            continue
        left = deadline - time.monotonic()
        if left < MIN_STAGE_S:
            report["stages"][name] = {
                "status": "skipped",
                "reason": f"Budget spent ({left:.0f} s left).",
            }
        else:
            limit_s = min(left, dry_limit if args.dry_run else limit)
            print(f"[accelerator_check] {name} (limit {limit_s:.0f} s)", flush=True)
            done = report["stages"][name] = run_stage_process(name, args, limit_s)
            print(
                f"[accelerator_check] {name}: {done['status']} in {done['seconds']} s", flush=True
            )
        write_report(args.out, report)
    return report


def write_report(out: Path, report: dict) -> None:
    report["targets"] = targets(report)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "summary.md").write_text(summary_markdown(report))


def _find(tree, match, path: str = ""):
    """(path, node) of every dict in a JSON tree for which `match(node)` holds."""
    if isinstance(tree, dict):
        if match(tree):
            yield path, tree
        for k, v in tree.items():
            yield from _find(v, match, f"{path}.{k}" if path else str(k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _find(v, match, f"{path}[{i}]")


def _result(report: dict, stage: str) -> dict:
    return report["stages"].get(stage, {}).get("result") or {}


def targets(report: dict) -> list[dict]:
    """The issue's acceptance targets with what this report measured (None: not measured)."""
    backends = report["plan"]["backends"]
    kernel = _result(report, "gpu_check")
    errors = [
        (f"{path}.{k}", v)
        for path, node in _find(kernel, lambda d: True)
        for k, v in node.items()
        if "max_abs_error" in k and isinstance(v, int | float)
    ]
    speedups = [
        (f"{path}.{k}", v)
        for path, node in _find(kernel, lambda d: d.get("batch") == 64 and d.get("context") == 2048)
        for k, v in node.items()
        if k.startswith("speedup") and isinstance(v, int | float)
    ]
    speed = _result(report, "speed").get(backends[0], {})
    last_burst = list(report["plan"]["bursts"])[-1]
    ours = speed.get(last_burst, {}).get("output_token_throughput")
    theirs = _result(report, "peer").get(last_burst, {}).get("output_token_throughput")
    worst_error = max(errors, key=lambda e: e[1]) if errors else (None, None)
    worst_speedup = min(speedups, key=lambda e: e[1]) if speedups else (None, None)
    rows = [
        (
            "kernel max abs error vs reference (bf16)",
            "<=",
            MAX_KERNEL_ERROR,
            worst_error[1],
            worst_error[0],
        ),
        (
            f"single-stream decode MBU ({backends[0]})",
            ">=",
            MIN_MBU,
            speed.get("single", {}).get("mbu"),
            "speed",
        ),
        (
            f"{last_burst} output tok/s vs transformers",
            ">=",
            MIN_PEER_RATIO,
            ours / theirs if ours and theirs else None,
            f"{ours and round(ours)} / {theirs and round(theirs)} tok/s",
        ),
        (
            "kernel speedup at batch 64, context 2048",
            ">=",
            MIN_KERNEL_SPEEDUP,
            worst_speedup[1],
            worst_speedup[0],
        ),
    ]
    out = []
    for name, op, target, value, source in rows:
        met = None if value is None else (value <= target if op == "<=" else value >= target)
        out.append(
            {"target": name, "op": op, "goal": target, "value": value, "met": met, "source": source}
        )
    return out


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _cuda_of(env: dict) -> str:
    """', CUDA ...' from the CUDA packages JAX runs on (their wheels carry the versions)."""
    cuda = {
        k: v
        for k, v in (env.get("packages") or {}).items()
        if k.lower().startswith(("jax-cuda", "jax_cuda", "nvidia-cuda-runtime", "nvidia-cudnn"))
    }
    return f", CUDA {cuda}" if cuda else ""


def summary_markdown(report: dict) -> str:
    """A few tables: stages, targets, correctness, speed per backend beside the peer."""
    env = _result(report, "environment")
    lines = [
        f"# Accelerator check{' (dry run on the CPU)' if report['dry_run'] else ''}",
        "",
        f"Started {report['started']}; device {env.get('device_kind', '?')} "
        f"(compute capability {env.get('compute_capability', '-')}), "
        f"JAX {env.get('jax_version', '?')}, "
        f"jaxlib {env.get('jaxlib_version', '?')}{_cuda_of(env)}; model {report['plan']['model']} "
        f"{report['plan']['dtype']}."
        + (f" Missing modules: {env['missing_modules']}." if env.get("missing_modules") else ""),
        "",
        "| stage | status | seconds | note |",
        "|---|---|---|---|",
    ]
    for name, st in report["stages"].items():
        note = st.get("error") or st.get("reason") or ""
        lines.append(f"| {name} | {st['status']} | {_fmt(st.get('seconds'))} | {str(note)[:120]} |")
    lines += ["", "| target | goal | measured | met | measured / goal |", "|---|---|---|---|---|"]
    for t in report["targets"]:
        met = {True: "met", False: "missed", None: "not measured"}[t["met"]]
        ratio = t["value"] / t["goal"] if t["value"] is not None else None
        lines.append(
            f"| {t['target']} | {t['op']} {t['goal']} | {_fmt(t['value'])} | {met} | "
            f"{_fmt(ratio)} |"
        )
    corr = _result(report, "engine_correctness")
    if corr:
        lines += [
            "",
            "| backend | compiles after warm-up | KV pages | sized from memory |",
            "|---|---|---|---|",
        ]
        for b in report["plan"]["backends"]:
            r = corr.get(b, {})
            lines.append(
                f"| {b} | {_fmt(r.get('compiles_after_warmup'))} | {_fmt(r.get('num_pages'))} | "
                f"{_fmt(r.get('sized_from_memory'))} |"
            )
        eq = corr.get("tokens_equal", {})
        lines += [
            "",
            f"Greedy tokens equal between backends: {eq.get('num_equal')}/{eq.get('num_prompts')}"
            f"; first divergence: {eq.get('first_divergence')}.",
        ]
    features = _result(report, "features")
    if features.get("speculative"):
        sp = features["speculative"]
        eq = sp["tokens_equal"]
        lines += [
            "",
            f"Speculative decoding (llama-tiny, every proposal verified): greedy tokens equal "
            f"to without: {eq['num_equal']}/{eq['num_prompts']}; {sp['verifications']} "
            f"verifications, {sp['accepted']} of {sp['proposed']} proposals accepted; "
            f"{sp['compiles_after_warmup']} compiles after warm-up.",
        ]
    if "structured" in features:
        st = features["structured"]
        text = (
            st
            if isinstance(st, str)
            else "; ".join(
                f"{k} {v['finished']}/{v['samples']} finished, all valid"
                for k, v in st.items()
                if isinstance(v, dict)
            )
            + f"; JSON checked by {st.get('json_checked_by')}"
        )
        lines += ["", f"Structured output (qwen3-tiny, temperature 1.0): {text}."]
    tiny = _result(report, "tiny_f32_vs_cpu").get("tokens_equal")
    if tiny:
        lines += [
            "",
            f"float32 llama-tiny, device against CPU: "
            f"{tiny['num_equal']}/{tiny['num_prompts']} equal.",
        ]
    speed, peer = _result(report, "speed"), _result(report, "peer")
    bursts = list(report["plan"]["bursts"])
    header = ["engine", "TPOT ms", "MBU"] + [f"{b} tok/s" for b in bursts]
    header += ["mixed TTFT p50/p99 ms", "mixed TPOT p50/p99 ms", "goodput req/s"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ms = lambda d, k: _fmt(d.get(k) and d[k] * 1e3)  # noqa: E731
    for b in report["plan"]["backends"]:
        r = speed.get(b, {})
        single, mixed = r.get("single", {}), r.get("mixed", {})
        row = [f"jaxserve {b}", ms(single.get("tpot", {}), "p50"), _fmt(single.get("mbu"))]
        row += [_fmt(r.get(x, {}).get("output_token_throughput"), 4) for x in bursts]
        row += [
            f"{ms(mixed.get('ttft', {}), 'p50')} / {ms(mixed.get('ttft', {}), 'p99')}",
            f"{ms(mixed.get('tpot', {}), 'p50')} / {ms(mixed.get('tpot', {}), 'p99')}",
            _fmt(mixed.get("goodput")),
        ]
        lines.append("| " + " | ".join(row) + " |")
    if peer:
        row = [f"transformers {peer.get('transformers_version', '')}", "-", "-"]
        row += [_fmt(peer.get(x, {}).get("output_token_throughput"), 4) for x in bursts]
        lines.append("| " + " | ".join([*row, "-", "-", "-"]) + " |")
    return "\n".join(lines) + "\n"


def _stage_main(args) -> int:
    """One stage in this process: its function, its error (if any) written into its result."""
    stage = Stage(args.work_dir / f"{args.stage}.json", args)
    try:
        STAGE_FNS[args.stage](stage)
    except Exception as e:
        stage.put("error", f"{type(e).__name__}: {e}")
        stage.put("traceback", traceback.format_exc().splitlines()[-12:])
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    from jaxserve.engine_args import HelpFormatter, add_engine_args, engine_argv

    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--out", type=Path, help="folder for report.json, summary.md, stages.log")
    parser.add_argument(
        "--dry-run", action="store_true", help="on the CPU: tiny model, interpret kernel"
    )
    parser.add_argument(
        "--budget-s", type=float, default=480.0, help="all stages together, seconds"
    )
    parser.add_argument(
        "--stages", type=lambda s: s.split(","), help="only these (comma-separated)"
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="each stage's own JSON and full log, kept there (default: a temporary folder, "
        "removed when the check ends); --out gets only report.json (every stage's JSON), "
        "summary.md and stages.log (each log's last lines), since the device tool returns 8 files",
    )
    parser.add_argument("--stage", choices=sorted(STAGE_FNS), help=argparse.SUPPRESS)
    parser.add_argument("--tiny-cpu-tokens", type=Path, help=argparse.SUPPRESS)
    device, dry = (" ".join(engine_argv(plan_engine(plan(d)))) for d in (False, True))
    add_engine_args(
        parser,
        note=f"Here, unless given, the plan's: {device} (with --dry-run: {dry}). The stages "
        "set --attention-backend themselves: the backends are what they compare.",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tiny_cpu_tokens:  # the CPU half of tiny_f32_vs_cpu
        tokens = tiny_tokens(args, plan(args.dry_run), backend="xla")
        args.tiny_cpu_tokens.write_text(json.dumps(tokens))
        return 0
    if args.stage:
        return _stage_main(args)
    if args.out is None:
        parser.error("--out DIR is required.")
    unknown = set(args.stages or ()) - {name for name, *_ in STAGES}
    if unknown:
        parser.error(
            f"--stages names unknown stages {sorted(unknown)}; known: {[n for n, *_ in STAGES]}."
        )
    if args.work_dir is not None:  # the user's folder: kept, with every stage's full log
        return _run_and_print(args)
    # A folder of its own, removed when the check ends (however it ends): every stage's JSON is
    # in --out's report.json and the last LOG_LINES of its log in stages.log; --work-dir keeps
    # the full logs.
    with tempfile.TemporaryDirectory(
        prefix="jaxserve-accelerator-check-", ignore_cleanup_errors=True
    ) as work_dir:
        args.work_dir = Path(work_dir)
        return _run_and_print(args)


def _run_and_print(args) -> int:
    report = run_all(args)
    print((args.out / "summary.md").read_text())
    return 0 if all(s["status"] in ("ok", "skipped") for s in report["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
