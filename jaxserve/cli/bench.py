"""`jaxserve bench` (scheduling configurations compared under the same traffic) and
`jaxserve batch` (offline inference over a JSONL file, resumable)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxserve.cli.common import (
    GOODPUT_TARGETS,
    UserError,
    add_multihost_args,
    join_cluster,
    joins_cluster,
    load_for,
)
from jaxserve.engine_args import (
    ENGINE_FLAGS,
    add_engine_args,
    engine_argv,
    engine_config_from_args,
    engine_values,
)

# Held fixed across the configurations a bench compares: one model loaded once into one mesh,
# one pair of goodput targets for the whole table, one compilation cache for all its engines.
# Every other engine flag takes a comma-separated list here.
FIXED = (
    "model",
    "dtype",
    "tensor_parallel",
    "mesh_shape",
    "ttft_slo_s",
    "tpot_slo_s",
    "compilation_cache_dir",
    "lora",  # repeated, one adapter per flag: the adapters every configuration serves
)
COMPARED = tuple(f.field for f in ENGINE_FLAGS if f.field not in FIXED)
BENCH_NOTE = (
    f"Here every engine flag but {', '.join(f.name for f in ENGINE_FLAGS if f.field in FIXED)} "
    "takes a comma-separated list (booleans: on,off), and bench compares every combination. "
    "Unless given here: --max-model-len is the longest request, rounded up to a page; "
    f"{' '.join(engine_argv(GOODPUT_TARGETS))} are the goodput targets; --profile shared-prefix "
    "compares --enable-prefix-caching on,off; with the compilation cache off, the run's "
    "engines share a temporary one."
)


def register(sub) -> None:
    _add_bench_parser(sub)
    _add_batch_parser(sub)


def _cmd_bench(args: argparse.Namespace) -> int:

    from jaxserve.bench import report
    from jaxserve.bench.metrics import SLO
    from jaxserve.bench.runner import OnlineUnavailable
    from jaxserve.bench.suite import (
        BenchSpec,
        build_configs,
        build_workloads,
        needed_model_len,
        replot,
        run_bench,
    )
    from jaxserve.bench.workload import TraceError

    if args.soak is not None:
        return _cmd_soak(args)
    if args.profile == "steps":
        return _cmd_steps(args)
    if args.profile == "host":
        return _cmd_host(args)
    if args.replot:
        summaries = replot(Path(args.out))
        print(report.format_table(summaries))
        print(f"Redrew {', '.join(report.PLOTS)} in {args.out} from its bench.json.")
        return 0
    # Every engine a bench builds would need its own followers: there is no multi-host bench.
    if joins_cluster(args):
        raise UserError(
            "jaxserve bench runs in one process; to bench a multi-host mesh, serve it with "
            "`jaxserve serve` and bench that with --online."
        )
    if args.backend == "openai":
        args.online = args.url or args.online
        if not args.online:
            raise UserError("--backend openai needs --url http://HOST:PORT of the server.")
    try:
        workloads = build_workloads(args)
        needed = needed_model_len(workloads)
        configs = [] if args.online else build_configs(args, needed, GOODPUT_TARGETS)
        targets = {**GOODPUT_TARGETS, **engine_values(args)}  # never lists: held fixed
        fixed = configs[0][1] if configs else None  # the same in every configuration
        spec = BenchSpec(
            workloads=tuple(workloads),
            configs=tuple(configs),
            slo=SLO(targets["ttft_slo_s"], targets["tpot_slo_s"]),
            out_dir=Path(args.out),
            model=fixed and fixed.model,
            dtype=fixed and fixed.dtype,
            seed=args.seed,
            compile_cache=fixed and fixed.compilation_cache_dir,
            online=args.online,
            backend=args.backend,
            command=" ".join(["jaxserve", *sys.argv[1:]]),
        )
        summaries = run_bench(spec, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (TraceError, OnlineUnavailable) as e:
        raise UserError(str(e)) from e
    except ImportError as e:  # a missing dependency of the chosen mode, e.g. matplotlib
        raise UserError(f"{e}; install it to run the bench.") from e
    print(report.format_table(summaries))
    print(f"Wrote {spec.out_dir / 'bench.json'} and {', '.join(report.PLOTS)} in {spec.out_dir}.")
    return 0


def _cmd_steps(args: argparse.Namespace) -> int:
    """`bench --profile steps`: prefill and decode step speed at llama-batched-bench's points."""

    from jaxserve.bench.steps import StepsSpec, format_steps, run_steps
    from jaxserve.bench.suite import parse_list

    config = _one_config(args, "--profile steps")
    if args.online or joins_cluster(args) or config.tensor_parallel != 1 or config.mesh_shape:
        raise UserError("--profile steps times the in-process engine on one device.")
    # A shorter list of points measures less (a quick look, or CI); the defaults are the spec's.
    points = {}
    if args.steps_prompt_lens is not None:
        points["prompt_lens"] = tuple(parse_list(args.steps_prompt_lens, int))
    if args.steps_batches is not None:
        points["batches"] = tuple(parse_list(args.steps_batches, int))
    if min((*points.get("prompt_lens", [1]), *points.get("batches", [1]))) < 1:
        raise UserError(f"--steps-prompt-lens and --steps-batches must be >= 1: {points}.")
    spec = StepsSpec(
        **points,
        model=config.model,
        dtype=config.dtype,
        seed=args.seed,
        quantization=config.quantization,
        decode_context=args.prompt_len,
        decode_steps=args.output_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        compile_cache=config.compilation_cache_dir,
        command=" ".join(["jaxserve", *sys.argv[1:]]),
        cost_seqs=config.max_num_seqs,  # the cost model's engine rows
        cost_model=not args.no_cost_model,
    )
    report = run_steps(spec, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_steps(report))
    print(f"Wrote {_save(report, Path(args.out), 'steps.json')}.")
    if "cost_model" in report:  # also alone, for `jaxserve simulate --cost-model`
        print(f"Wrote {_save(report['cost_model'], Path(args.out), 'cost_model.json')}.")
    return 0


def _cmd_host(args: argparse.Namespace) -> int:
    """`bench --profile host`: the engine's host microseconds per step over a free device."""

    from jaxserve.bench.host import HostSpec, format_host, run_host
    from jaxserve.bench.suite import parse_list

    config = _one_config(args, "--profile host")
    if args.online or joins_cluster(args) or config.tensor_parallel != 1 or config.mesh_shape:
        raise UserError("--profile host times the in-process engine on one device.")
    try:
        running = parse_list(args.running, int)
    except ValueError as e:
        raise UserError(f"--running: {e}") from e
    if min(running) < 1 or args.step_time < 0:
        raise UserError(
            f"--running {args.running!r} must list counts >= 1 and --step-time "
            f"{args.step_time} must be >= 0."
        )
    spec = HostSpec(
        model=config.model,
        running=tuple(running),
        context=args.prompt_len,
        steps=args.output_len,
        step_time_s=args.step_time,
        async_scheduling=config.async_scheduling,
        detokenize=args.detokenize,
        seed=args.seed,
        command=" ".join(["jaxserve", *sys.argv[1:]]),
    )
    report = run_host(spec, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_host(report))
    print(f"Wrote {_save(report, Path(args.out), 'host.json')}.")
    return 0


def _cmd_soak(args: argparse.Namespace) -> int:
    """`bench --soak SECONDS`: one `jaxserve serve` configuration under long mixed traffic;
    exit status 1 if it leaked, compiled, or answered anything unexpected."""

    from jaxserve.bench.soak import SoakError, SoakSpec, format_report, run_soak
    from jaxserve.bench.suite import parse_range
    from jaxserve.bench.workload import LengthMix

    if args.online or joins_cluster(args):
        raise UserError("--soak starts its own `jaxserve serve` on loopback; drop --online.")
    _one_config(args, "--soak")  # a bad flag fails here, not in the server it starts
    given = {f: v[0] if isinstance(v, list) else v for f, v in engine_values(args).items()}
    spec = SoakSpec(
        duration_s=args.soak,
        rate=args.soak_rate,
        probe_s=args.soak_probe,
        serve_flags=tuple(engine_argv(given)),
        mix=LengthMix(
            prompt_range=parse_range(args.prompt_range, "--prompt-range"),
            output_range=parse_range(args.output_range, "--output-range"),
            long_share=args.long_share,
            extended_share=args.long_share,
        ),
        seed=args.seed,
        out_dir=Path(args.out),
        command=" ".join(["jaxserve", *sys.argv[1:]]),
    )
    try:
        report = run_soak(spec, log=lambda m: print(m, file=sys.stderr, flush=True))
    except SoakError as e:
        raise UserError(str(e)) from e
    print(format_report(report))
    print(f"Wrote {_save(report, spec.out_dir, 'soak.json')} and server.log.")
    return 0 if report["ok"] else 1


def _cmd_batch(args: argparse.Namespace) -> int:

    src, dst = Path(args.input), Path(args.output)
    if not src.is_file():
        raise UserError(f"Input file {str(src)!r} does not exist.")
    if src.resolve() == dst.resolve():
        raise UserError("INPUT and OUTPUT must be different files.")
    if not dst.parent.is_dir():
        raise UserError(f"Output folder {str(dst.parent)!r} does not exist.")
    s = _batch_on_ray(args, src, dst) if args.ray is not None else _batch_here(args, src, dst)
    if s is None:  # a follower process of a multi-host engine
        return 0
    rate = s.output_tokens / s.elapsed_s if s.elapsed_s else 0.0
    print(
        f"jaxserve batch: {s.completed} completed ({s.output_tokens} tokens, {rate:.1f} tok/s), "
        f"{s.already_done} already done, {len(s.bad_lines)} bad lines skipped.",
        file=sys.stderr,
    )
    if s.bad_lines:
        lines = ", ".join(str(n) for n, _ in s.bad_lines[:20])
        more = f" and {len(s.bad_lines) - 20} more" if len(s.bad_lines) > 20 else ""
        print(f"jaxserve batch: bad input lines: {lines}{more}", file=sys.stderr)
        return 1
    return 0


def _batch_config(args: argparse.Namespace):
    return engine_config_from_args(args, show_progress=not args.no_progress)


def _one_config(args: argparse.Namespace, what: str):
    """The one engine configuration of a bench mode that runs one, or a UserError."""
    several = {f: v for f, v in engine_values(args).items() if isinstance(v, list) and len(v) > 1}
    if several:
        raise UserError(f"{what} runs one configuration: {' '.join(engine_argv(several))}.")
    return engine_config_from_args(args, show_progress=False)


def _batch_defaults(args: argparse.Namespace):
    from jaxserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)


def _batch_here(args: argparse.Namespace, src, dst):
    """One engine in this process (one mesh, maybe over several hosts)."""
    from jaxserve.engine.build import build_engine
    from jaxserve.jobs.batch_job import BatchInputError, OutputCorrupt, run_batch
    from jaxserve.runtime import multihost

    defaults, config = _batch_defaults(args), _batch_config(args)
    join_cluster(args)  # before the model loads: a cluster must be joined first
    engine = build_engine(config, model=load_for(config))
    if engine.runner.lockstep is not None and not multihost.is_leader():
        engine.runner.follow()  # multi-host: the other processes run process 0's steps
        return None
    try:
        return run_batch(
            engine,
            src,
            dst,
            defaults=defaults,
            stop_on_error=args.stop_on_error,
            include_token_ids=args.token_ids,
            progress=not args.no_progress,
        )
    except (BatchInputError, OutputCorrupt) as e:
        raise UserError(str(e)) from e
    finally:
        engine.runner.stop_followers()  # lets them return (a no-op on one host)


def _batch_on_ray(args: argparse.Namespace, src, dst):
    """`--ray`: replicas on a Ray cluster, this process reading and writing (batch_ray.py)."""
    from jaxserve.jobs.ray_replicas import RayMissing, import_ray

    try:
        import_ray()  # before any work: without Ray, one line saying how to get it
    except RayMissing as e:
        raise UserError(str(e)) from e
    config = _batch_config(args)
    if config.tensor_parallel != 1 or config.mesh_shape or joins_cluster(args):
        raise UserError(
            "With --ray, each replica's devices are --devices-per-replica; --tensor-parallel, "
            "--mesh-shape and the --distributed flags are for one engine without Ray."
        )
    if args.replicas < 1 or args.devices_per_replica < 1:
        raise UserError(
            f"--replicas {args.replicas} and --devices-per-replica {args.devices_per_replica} "
            "must both be at least 1."
        )
    from jaxserve.jobs.batch_job import BatchInputError, OutputCorrupt
    from jaxserve.jobs.ray_replicas import run_ray

    try:
        return run_ray(
            src,
            dst,
            config=config,
            replicas=args.replicas,
            devices_per_replica=args.devices_per_replica,
            address=args.ray or None,
            defaults=_batch_defaults(args),
            stop_on_error=args.stop_on_error,
            include_token_ids=args.token_ids,
            progress=not args.no_progress,
        )
    except (BatchInputError, OutputCorrupt, ConnectionError, RuntimeError) as e:
        raise UserError(str(e)) from e


def _add_bench_parser(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="compare scheduling configurations on one model under the same traffic",
        description="Runs every configuration (the product of the engine flags given as "
        "comma-separated lists) at every load of a traffic profile, holding model, precision "
        "and lengths fixed; prints a table and writes bench.json and PNG plots to --out.",
    )
    t = b.add_argument_group("traffic")
    t.add_argument(
        "--profile",
        default="mixed",
        choices=[
            "baseline",
            "concurrency",
            "mixed",
            "shared-prefix",
            "repetitive",
            "trace",
            "steps",
            "host",
        ],
        help="baseline: concurrency 1; concurrency: rising concurrency, fixed "
        "lengths; mixed: short/long prompts and brief/extended outputs under Poisson "
        "arrivals; shared-prefix: a --prefix-len system prompt before a short question of "
        "each request's own, Poisson arrivals, prefix cache on and off; repetitive: one "
        "request at a time, --prompt-len prompts that say a random passage three times, "
        "--output-len tokens each (where --speculative ngram pays); trace: a JSONL file; "
        "steps: the model step alone, prefill tok/s at "
        "128/512/2048-token prompts and decode ms/step at batches 1/16/64/256 beside the "
        "machine's matmul and bandwidth ceilings (steps.json in --out); host: the engine's host "
        "microseconds per step by phase over a device call that costs nothing, at --running "
        "decode requests of --prompt-len context, --output-len steps timed (host.json in --out; "
        "--no-async-scheduling for comparison) (default: mixed)",
    )
    t.add_argument(
        "--steps-prompt-lens",
        default=None,
        metavar="N,N,...",
        help="steps: the prefill points' prompt tokens (default: 128,512,2048)",
    )
    t.add_argument(
        "--steps-batches",
        default=None,
        metavar="B,B,...",
        help="steps: the decode points' batch sizes (default: 1,16,64,256)",
    )
    t.add_argument(
        "--no-cost-model",
        action="store_true",
        help="steps: the step table alone, without measuring the step-cost model after it "
        "(minutes on a 135M model on a CPU)",
    )
    t.add_argument(
        "--trace",
        help="JSONL trace: arrival_time, prompt | prompt_token_ids | "
        "prompt_len, max_tokens (and optional id, priority)",
    )
    t.add_argument("--num-requests", type=int, default=64, help="requests per load")
    t.add_argument(
        "--rates", default="1,2,4", help="mixed: requests/s, one run each (inf: all at once)"
    )
    t.add_argument("--concurrency", default="1,2,4,8,16", help="concurrency profile: levels")
    t.add_argument("--prompt-len", type=int, default=64, help="fixed-length profiles")
    t.add_argument("--output-len", type=int, default=32, help="fixed-length profiles")
    t.add_argument("--prompt-range", default="32:128", help="mixed: prompt tokens LOW:HIGH")
    t.add_argument("--output-range", default="16:64", help="mixed: output tokens LOW:HIGH")
    t.add_argument(
        "--long-share",
        type=float,
        default=0.3,
        help="mixed: share of long prompts and of extended outputs",
    )
    t.add_argument("--burst", help="mixed: N@T adds N requests all arriving at T seconds")
    t.add_argument(
        "--prefix-len", type=int, default=512, help="shared-prefix: tokens every prompt shares"
    )
    t.add_argument(
        "--question-range",
        default="8:32",
        help="shared-prefix: tokens of each request's own question LOW:HIGH (outputs: "
        "--output-len)",
    )
    t.add_argument(
        "--running", default="1,16,64,256,1024", help="host: running decode requests per point"
    )
    t.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        metavar="S",
        help="host: seconds the fake device takes per step (default 0: results at once)",
    )
    t.add_argument(
        "--detokenize",
        action="store_true",
        help="host: outputs carry text through the model's tokenizer (default: token ids only)",
    )
    t.add_argument("--seed", type=int, default=0, help="traffic and weight seed")
    o = b.add_argument_group("output")
    o.add_argument("--out", default="bench-out", help="folder for bench.json and the PNGs")
    o.add_argument(
        "--online",
        metavar="HOST:PORT",
        default=None,
        help="send the traffic to a running `jaxserve serve` instead",
    )
    o.add_argument(
        "--backend",
        choices=["grpc", "openai"],
        default="grpc",
        help="how --online/--url is reached: jaxserve's gRPC, or the OpenAI API of any server "
        "(llama-server, vLLM, `jaxserve serve --http-port`)",
    )
    o.add_argument(
        "--url",
        default=None,
        help="with --backend openai: the server, http://HOST:PORT (the same as --online)",
    )
    o.add_argument(
        "--replot",
        action="store_true",
        help="run nothing: redraw the table and PNGs from --out's bench.json",
    )
    k = b.add_argument_group(
        "soak (one configuration under long traffic; exit status 1 on leaks, compiles or errors)"
    )
    k.add_argument(
        "--soak",
        type=float,
        metavar="SECONDS",
        default=None,
        help="start `jaxserve serve` and send it mixed traffic near its capacity for SECONDS, "
        "20%% cancelled, 5%% with short deadlines; report status codes, leaks, compiles, RSS",
    )
    k.add_argument(
        "--soak-rate", type=float, metavar="R", help="requests/s (default: 0.9 x the capacity)"
    )
    k.add_argument(
        "--soak-probe", type=float, metavar="SECONDS", help="capacity probe (default: 5-30 s)"
    )
    add_engine_args(b, lists=COMPARED, note=BENCH_NOTE)
    add_multihost_args(b)
    b.set_defaults(func=_cmd_bench)


def _add_batch_parser(sub) -> None:
    b = sub.add_parser(
        "batch",
        help="offline inference over a JSONL file, resumable",
        description="Reads INPUT.jsonl ({id, prompt | prompt_token_ids, max_tokens, ...} per "
        "line) and appends one result line per request to OUTPUT.jsonl as it finishes. Rerun "
        "the same command after a crash or kill to resume: finished ids are skipped. Exit "
        "status 1 if bad input lines were skipped.",
    )
    b.add_argument("input", metavar="INPUT.jsonl")
    b.add_argument("output", metavar="OUTPUT.jsonl")
    b.add_argument("--max-tokens", type=int, default=256, help="default for lines without one")
    b.add_argument(
        "--temperature", type=float, default=0.0, help="default for lines without one (0: greedy)"
    )
    b.add_argument(
        "--stop-on-error",
        action="store_true",
        help="stop at the first bad input line (default: report it and skip it)",
    )
    b.add_argument("--token-ids", action="store_true", help="also write the output token ids")
    b.add_argument(
        "--no-progress", action="store_true", help="no progress bars (the job's, the compiles')"
    )
    r = b.add_argument_group(
        "Ray: data parallel over engine replicas (pip install 'jaxserve[ray]')"
    )
    r.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run the replicas on Ray: join the cluster at ADDRESS ('auto': the one started "
        "on this machine by `ray start`), or without ADDRESS start a local one for this job",
    )
    r.add_argument("--replicas", type=int, default=1, metavar="N", help="engines (Ray actors)")
    r.add_argument(
        "--devices-per-replica",
        type=int,
        default=1,
        metavar="K",
        help="GPUs or TPU chips per replica, its model split over them (tensor parallel)",
    )
    add_engine_args(b)
    add_multihost_args(b)
    b.set_defaults(func=_cmd_batch)


def _save(report: dict, out_dir: Path, name: str) -> Path:
    """Writes a profile's report as `name` (JSON) in `out_dir`; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
