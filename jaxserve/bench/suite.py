"""`jaxserve bench`: every configuration against every load, in one run, on one model.

The model, its precision, the machine and the request lengths are fixed for the whole run; only
the engine's configuration changes (batching mode, max_num_seqs, chunked prefill, policy...: the
product of the engine flags given as comma-separated lists, jaxserve/engine_args.py). All
engines are built first, sharing one set of weights (and, through JAX's persistent compilation
cache, their compiled buckets); then loads run in order and, within a load, every
configuration back to back, so slow drift in a shared machine's background load spreads over
all configurations instead of biasing one.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from jaxserve.bench import report
from jaxserve.bench.metrics import SLO, summarize
from jaxserve.bench.runner import RunResult, connect, run_offline, run_online, server_info
from jaxserve.bench.workload import (
    Burst,
    LengthMix,
    Workload,
    fixed_length_workloads,
    load_trace,
    mixed_workloads,
    repetitive_workloads,
    shared_prefix_workloads,
)
from jaxserve.engine_args import engine_config_from_args, engine_values
from jaxserve.engine_config import EngineConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchSpec:
    """What one `jaxserve bench` invocation runs (built from the command line)."""

    workloads: tuple[Workload, ...]
    configs: tuple[tuple[str, EngineConfig], ...]  # (label, config)
    slo: SLO
    out_dir: Path
    model: str | None
    dtype: str | None
    seed: int = 0
    compile_cache: str | None = None
    online: str | None = None
    backend: str = "grpc"  # how `online` is reached: "grpc" (jaxserve serve) or "openai" (a URL)
    command: str = ""


def build_workloads(args) -> list[Workload]:
    """The loads of the chosen profile, from the parsed command line."""
    if args.profile == "trace":
        if not args.trace:
            raise ValueError("--profile trace needs --trace FILE.")
        return [load_trace(args.trace)]
    if args.trace:
        raise ValueError(f"--trace is only read with --profile trace, not {args.profile}.")
    if args.profile in ("baseline", "concurrency"):
        levels = [1] if args.profile == "baseline" else parse_list(args.concurrency, int)
        return fixed_length_workloads(
            levels,
            num_requests=args.num_requests,
            prompt_len=args.prompt_len,
            max_tokens=args.output_len,
        )
    if args.profile == "repetitive":
        return repetitive_workloads(
            num_requests=args.num_requests, prompt_len=args.prompt_len, max_tokens=args.output_len
        )
    if args.profile == "shared-prefix":
        return shared_prefix_workloads(
            parse_list(args.rates, float),
            num_requests=args.num_requests,
            prefix_len=args.prefix_len,
            question_range=parse_range(args.question_range, "--question-range"),
            max_tokens=args.output_len,
            seed=args.seed,
        )
    mix = LengthMix(
        prompt_range=parse_range(args.prompt_range, "--prompt-range"),
        output_range=parse_range(args.output_range, "--output-range"),
        long_share=args.long_share,
        extended_share=args.long_share,
    )
    return mixed_workloads(
        parse_list(args.rates, float),
        num_requests=args.num_requests,
        mix=mix,
        burst=Burst.parse(args.burst) if args.burst else None,
        seed=args.seed,
    )


def build_configs(
    args, max_model_len: int, defaults: Mapping | None = None
) -> list[tuple[str, EngineConfig]]:
    """One configuration per combination of the engine flags given as lists (`jaxserve bench`
    adds them so), the other engine flags held fixed; labels name only the fields that vary.
    `max_model_len` and `defaults`: fields' values where their flags are not given."""
    lists = {f: v for f, v in engine_values(args).items() if isinstance(v, list)}
    if args.profile == "shared-prefix":  # compares the cache on and off unless told otherwise
        lists.setdefault("enable_prefix_caching", [True, False])
    varying = [f for f, v in lists.items() if len(v) > 1]
    defaults = {"max_model_len": max_model_len, **(defaults or {})}
    configs = []
    for combo in itertools.product(*lists.values()):
        chosen = dict(zip(lists, combo, strict=True))
        if chosen.get("shed_late") and not chosen.get("slo_scheduling"):
            continue  # shedding is part of SLO-aware scheduling
        config = engine_config_from_args(
            args, defaults, seed=args.seed, show_progress=False, **chosen
        )
        if (
            not config.enable_chunked_prefill
            and config.max_num_batched_tokens < config.max_model_len
        ):
            raise ValueError(
                f"Chunked prefill off needs max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) >= max_model_len ({config.max_model_len}): a "
                f"whole prompt must fit one step."
            )
        configs.append((_label(config, varying), config))
    if not configs:
        raise ValueError("--shed-late needs --slo-scheduling: no configuration is left to run.")
    return configs


_SHORT = {
    "max_num_seqs": "seqs",
    "max_num_batched_tokens": "tokens",
    "enable_chunked_prefill": "chunked",
    "enable_prefix_caching": "prefix cache",
    "slo_scheduling": "slo",
    "shed_late": "shed",
}


def _label(config: EngineConfig, varying: list[str]) -> str:
    parts = []
    for field in varying or ["batching"]:
        value = getattr(config, field)
        if field in ("batching", "policy"):
            parts.append(str(value))
        elif isinstance(value, bool):
            parts.append(f"{_SHORT.get(field, field)}={'on' if value else 'off'}")
        else:
            parts.append(f"{_SHORT.get(field, field)}={value}")
    return " ".join(parts)


def parse_list(text: str, kind) -> list:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"Empty list {text!r}.")
    try:
        return [kind(t) for t in items]
    except ValueError:
        raise ValueError(f"{text!r} must be a comma-separated list of {kind.__name__}.") from None


def parse_range(text: str, flag: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"{flag} {text!r} must look like LOW:HIGH, e.g. 32:128.") from None
    return lo, hi


def needed_model_len(workloads: Sequence[Workload], page_size: int = 16) -> int:
    """Prompt plus output of the longest request, rounded up to whole pages; text prompts get
    a margin, since their token count is known only after tokenization."""
    need = max(r.prompt_len + r.max_tokens for w in workloads for r in w.requests)
    if any(r.prompt is not None for w in workloads for r in w.requests):
        need = 2 * need
    return page_size * math.ceil(need / page_size)


# ---- running ------------------------------------------------------------------------------


def run_bench(spec: BenchSpec, log=print) -> list[dict]:
    """Runs every (load, configuration) cell; writes bench.json and the PNGs; returns the
    summaries in configuration-major order."""
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    load_before = _loadavg()
    started = time.time()
    server = None
    if spec.online:
        results, server = _run_all_online(spec, log)
    else:
        results = _run_all_offline(spec, log)
    order = {label: i for i, (label, _) in enumerate(spec.configs)}
    results.sort(key=lambda r: order.get(r.label, 0))  # stable: loads stay in order
    summaries = [report.sanitize(summarize(r, spec.slo)) for r in results]
    meta = report.sanitize(
        {
            "jaxserve_bench": 1,
            "command": spec.command,
            "started": datetime.datetime.fromtimestamp(started).isoformat(timespec="seconds"),
            "wall_s": time.time() - started,
            "mode": "online" if spec.online else "offline",
            "model": server["model"] if server else spec.model or "stories260k (embedded)",
            "dtype": server["dtype"] if server else spec.dtype or str(_default_dtype()),
            # Offline: this machine ran the engine. Online: it only ran the client.
            "machine": _machine(load_before),
            "slo": {"ttft_s": spec.slo.ttft_s, "tpot_s": spec.slo.tpot_s},
            "workloads": [w.describe() for w in spec.workloads],
            "configurations": [
                {"label": label, **_config_dict(config)} for label, config in spec.configs
            ]
            or [{"label": f"online {spec.online}", "server": server}],
        }
    )
    report.write_json(spec.out_dir / "bench.json", meta, summaries, results)
    title = _title(meta)
    report.write_plots(
        spec.out_dir,
        summaries,
        results,
        slo_ttft_s=spec.slo.ttft_s,
        slo_tpot_s=spec.slo.tpot_s,
        title=title,
    )
    return summaries


def replot(out_dir: Path) -> list[dict]:
    """Redraws the PNGs in out_dir from its bench.json, running nothing; returns the summaries."""
    path = out_dir / "bench.json"
    if not path.is_file():
        raise ValueError(f"{path} does not exist; run the bench first.")
    meta, summaries, results = report.load_json(path)
    title = _title(meta)
    report.write_plots(
        out_dir,
        summaries,
        results,
        slo_ttft_s=meta["slo"]["ttft_s"],
        slo_tpot_s=meta["slo"]["tpot_s"],
        title=title,
    )
    return summaries


def _run_all_offline(spec: BenchSpec, log) -> list[RunResult]:
    from checkpoints import load_model
    from jaxserve.engine.build import build_engine
    from jaxserve.engine.core import freeze_heap
    from jaxserve.models.sharding import make_mesh

    cache_dir = spec.compile_cache or tempfile.mkdtemp(prefix="jaxserve-bench-cc-")
    try:
        first = spec.configs[0][1]  # every configuration has the same mesh: load into it once
        mesh = make_mesh(first.tensor_parallel, first.mesh_shape)
        model = load_model(spec.model, dtype=spec.dtype, seed=spec.seed, mesh=mesh)
        engines = []
        for label, config in spec.configs:
            t = time.perf_counter()
            engine = build_engine(config.replace(compilation_cache_dir=cache_dir), model=model)
            log(
                f"built {label!r}: {len(engine.runner.config.buckets())} buckets, "
                f"{engine.runner.config.num_pages} KV pages, {time.perf_counter() - t:.1f}s"
            )
            engines.append((label, engine))
        freeze_heap()  # as `jaxserve serve` does: no full collection stalls a timed run
        results = []
        cells = len(spec.workloads) * len(engines)
        for w in spec.workloads:
            for label, engine in engines:
                t = time.perf_counter()
                result = run_offline(engine, w, label=label, seed=spec.seed)
                results.append(result)
                log(
                    f"[{len(results)}/{cells}] {label} {w.name}: {len(result.records)} requests "
                    f"in {time.perf_counter() - t:.1f}s"
                )
        return results
    finally:
        if spec.compile_cache is None:
            shutil.rmtree(cache_dir, ignore_errors=True)


def _run_all_online(spec: BenchSpec, log) -> tuple[list[RunResult], dict]:
    """Every load in turn against the server; also returns what the server reports of itself."""
    client = connect(spec.online, backend=spec.backend)
    try:
        info = server_info(client)
        label = f"online {spec.online}"
        results = []
        for w in spec.workloads:
            t = time.perf_counter()
            result = run_online(
                client, w, label=label, vocab_size=info["vocab_size"], seed=spec.seed
            )
            results.append(result)
            log(
                f"[{len(results)}/{len(spec.workloads)}] {label} {w.name}: "
                f"{len(result.records)} requests in {time.perf_counter() - t:.1f}s"
            )
        return results, info
    finally:
        client.close()


def _title(meta: dict) -> str:
    return f"{meta['model']}, {meta['dtype']}, on {meta['machine']['device']}"


def _default_dtype():
    from checkpoints import default_dtype

    return default_dtype()


def _config_dict(config: EngineConfig) -> dict:
    d = dataclasses.asdict(config)
    for k in ("compilation_cache_dir", "show_progress", "precompile"):
        d.pop(k, None)
    return d


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _machine(load_before) -> dict:
    import jax

    dev = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        # A shared machine: the 1/5/15-minute load averages before and after the run.
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
    }
