"""The `jaxserve` command: generate, convert, serve, client, bench, batch (and later subcommands).

Errors a user can fix (a missing model folder, an unsupported architecture, a prompt too long)
end with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence

# Quiet JAX/absl start-up chatter before they are imported.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class UserError(Exception):
    """A problem with the command line or its inputs, reported as one line."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="model folder (Hugging Face or converted) or named random shape; "
        "default: the embedded stories260k",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="parameter dtype (default: float32 on CPU, bfloat16 on accelerators)",
    )


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Flags that split the model over a device mesh (see docs/multihost.md)."""
    g = p.add_argument_group("devices")
    g.add_argument(
        "--tensor-parallel", type=int, default=1, metavar="N", help="split over N devices"
    )
    g.add_argument(
        "--mesh", default=None, metavar="DATAxMODEL", help="explicit mesh shape, e.g. 1x8"
    )
    g.add_argument(
        "--distributed",
        action="store_true",
        help="multi-host: call jax.distributed.initialize (cluster auto-detected unless the "
        "three flags below are given); process 0 serves, the others follow its steps",
    )
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)


def _parallel(args: argparse.Namespace) -> dict:
    """EngineConfig fields of the parallel flags; joins the cluster first if asked (before any
    device is touched, as jax.distributed requires)."""
    from jaxserve import multihost
    from jaxserve.sharding import parse_mesh_shape

    explicit = (args.coordinator_address, args.num_processes, args.process_id)
    if args.distributed or any(v is not None for v in explicit):
        multihost.initialize(*explicit)
    mesh_shape = parse_mesh_shape(args.mesh) if args.mesh else None
    return dict(tensor_parallel=args.tensor_parallel, mesh_shape=mesh_shape)


def _cmd_generate(args: argparse.Namespace) -> int:
    from jaxserve.engine import Engine
    from jaxserve.engine_config import EngineConfig
    from jaxserve.sampling_params import SamplingParams

    # Checked before the model loads, so a bad flag fails at once.
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    parallel = _parallel(args)  # before the model loads: a cluster must be joined first
    from jaxserve import multihost
    from jaxserve.sharding import make_mesh

    model = _load(args, mesh=make_mesh(parallel["tensor_parallel"], parallel["mesh_shape"]))
    if model.tokenizer is None:
        raise UserError(f"Model {model.source} has random weights and no tokenizer to read text.")
    engine = Engine(
        EngineConfig(
            max_num_seqs=1,
            max_num_batched_tokens=256,
            precompile=False,
            show_progress=False,
            **parallel,
        ),
        model=model,
    )
    if engine.runner.lockstep is not None and not multihost.is_leader():
        engine.runner.follow()  # multi-host: the other processes run process 0's steps
        return 0
    try:
        return _generate(engine, args, params)
    finally:
        engine.runner.stop_followers()  # lets them return (a no-op on one host)


def _generate(engine, args: argparse.Namespace, params) -> int:
    prompt_ids = engine.encode(args.prompt)
    context = engine.max_model_len
    if len(prompt_ids) >= context:
        raise UserError(
            f"The prompt has {len(prompt_ids)} tokens but the model's context is {context} tokens."
        )
    # The reply may use what the prompt leaves of the context.
    max_tokens = min(args.max_tokens, context - len(prompt_ids))
    engine.add_request(prompt_ids, dataclasses.replace(params, max_tokens=max_tokens))
    sys.stdout.write(args.prompt)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from checkpoints import save_orbax

    model = _load(args, spec=args.hf_dir)
    try:
        out = save_orbax(model, args.out_dir)
    except FileExistsError as e:
        raise UserError(str(e)) from e
    print(f"Wrote {model.config.architecture} model from {model.source} to {out}.")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

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

    if args.replot:
        summaries = replot(Path(args.out))
        print(report.format_table(summaries))
        print(f"Redrew {', '.join(report.PLOTS)} in {args.out} from its bench.json.")
        return 0
    try:
        workloads = build_workloads(args)
        max_model_len = args.max_model_len or needed_model_len(workloads)
        configs = [] if args.online else build_configs(args, max_model_len)
        spec = BenchSpec(
            workloads=tuple(workloads),
            configs=tuple(configs),
            slo=SLO(args.ttft_slo, args.tpot_slo),
            out_dir=Path(args.out),
            model=args.model,
            dtype=args.dtype,
            seed=args.seed,
            compile_cache=args.compile_cache,
            online=args.online,
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


def _cmd_batch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from jaxserve.batch_job import BatchInputError, OutputCorrupt, run_batch
    from jaxserve.engine import Engine
    from jaxserve.engine_config import EngineConfig
    from jaxserve.sampling_params import SamplingParams

    src, dst = Path(args.input), Path(args.output)
    if not src.is_file():
        raise UserError(f"Input file {str(src)!r} does not exist.")
    if src.resolve() == dst.resolve():
        raise UserError("INPUT and OUTPUT must be different files.")
    if not dst.parent.is_dir():
        raise UserError(f"Output folder {str(dst.parent)!r} does not exist.")
    defaults = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    model = _load(args)
    engine = Engine(
        EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            min_token_bucket=args.min_token_bucket,
            seq_bucket_factor=args.seq_bucket_factor,
            compilation_cache_dir=args.compile_cache,
            show_progress=not args.no_progress,
        ),
        model=model,
    )
    try:
        s = run_batch(
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


def _cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from service.auth import load_token
    from service.server import ServeError, ServerOptions, configure_logging, serve

    configure_logging(args.log_format, logging.DEBUG if args.verbose else logging.INFO)
    engine_flags = {
        name: getattr(args, name)
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "max_waiting_requests",
            "kv_cache_memory_gb",
            "policy",
            "min_token_bucket",
            "token_bucket_factor",
            "seq_bucket_factor",
            "compilation_cache_dir",
        )
        if getattr(args, name) is not None
    }
    config = _engine_config(model=args.model, dtype=args.dtype, show_progress=False, **engine_flags)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UserError("TLS needs both --tls-cert and --tls-key.")
    options = ServerOptions(
        host=args.host,
        port=args.port,
        metrics_port=None if args.no_metrics else args.metrics_port,
        grace_s=args.grace_period,
        tls_cert=_read_file(args.tls_cert),
        tls_key=_read_file(args.tls_key),
        auth_token=load_token(args.auth_token_file),
    )

    def build_engine():  # runs during warm-up, while the port already answers health checks
        from jaxserve.async_engine import AsyncEngine

        return AsyncEngine(config)

    try:
        return asyncio.run(serve(build_engine, options))
    except ServeError as e:
        raise UserError(str(e)) from e


def _engine_config(**fields):
    from jaxserve.engine_config import EngineConfig

    return EngineConfig(**fields)


def _read_file(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise UserError(f"Cannot read {path}: {e.strerror}.") from e


def _cmd_client(args: argparse.Namespace) -> int:
    import grpc

    from service.auth import load_token
    from service.client import JaxServeClient

    client = JaxServeClient(
        args.target,
        token=load_token(args.auth_token_file),
        tls=args.tls,
        root_certificates=_read_file(args.tls_ca),
    )
    try:
        with client:
            max_tokens = args.max_tokens
            if max_tokens is None:  # as much of a story as the context leaves room for
                context = client.model_info(timeout=args.timeout).context_length
                room = context - len(client.tokenize(args.prompt, timeout=args.timeout))
                max_tokens = max(1, min(256, room))
            call = client.generate(
                args.prompt,
                timeout=args.timeout,
                max_tokens=max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                stop=args.stop,
            )
            last = None
            for response in call:
                if last is None:  # echoed once the server has accepted the request
                    sys.stdout.write(args.prompt)
                sys.stdout.write(response.text)
                sys.stdout.flush()
                last = response
            sys.stdout.write("\n")
    except grpc.RpcError as e:
        raise UserError(f"{args.target}: {e.code().name}: {e.details()}") from e
    if args.stats and last is not None:
        t = last.timings
        print(
            f"{last.usage.prompt_tokens} prompt + {last.usage.completion_tokens} output tokens; "
            f"queue {t.queue_wait_s * 1e3:.1f} ms, TTFT {t.ttft_s * 1e3:.1f} ms, "
            f"total {t.e2e_s:.2f} s",
            file=sys.stderr,
        )
    return 0


def _load(args: argparse.Namespace, spec: str | None = None, mesh=None):
    from checkpoints import ModelLoadError, load_model

    try:
        return load_model(spec if spec is not None else args.model, dtype=args.dtype, mesh=mesh)
    except ModelLoadError as e:
        raise UserError(str(e)) from e


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    _add_model_args(gen)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    _add_parallel_args(gen)
    gen.set_defaults(func=_cmd_generate)

    conv = sub.add_parser("convert", help="convert a Hugging Face folder to an orbax checkpoint")
    conv.add_argument("hf_dir")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    conv.set_defaults(func=_cmd_convert)

    srv = sub.add_parser("serve", help="serve a model over gRPC (health, reflection, metrics)")
    _add_model_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    srv.add_argument("--metrics-port", type=int, default=9400, help="Prometheus /metrics port")
    srv.add_argument("--no-metrics", action="store_true", help="serve no metrics endpoint")
    srv.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="seconds requests in flight may finish in after SIGTERM/SIGINT",
    )
    srv.add_argument("--tls-cert", help="PEM certificate chain (TLS with --tls-key)")
    srv.add_argument("--tls-key", help="PEM private key")
    srv.add_argument(
        "--auth-token-file",
        help="require this bearer token on every call (default: $JAXSERVE_AUTH_TOKEN if set)",
    )
    srv.add_argument("--log-format", choices=["json", "text"], default="json")
    eng = srv.add_argument_group("engine (default: EngineConfig's)")
    for flag, kind in (
        ("--max-num-seqs", int),
        ("--max-num-batched-tokens", int),
        ("--max-model-len", int),
        ("--max-waiting-requests", int),
        ("--kv-cache-memory-gb", float),
        ("--min-token-bucket", int),
        ("--token-bucket-factor", int),
        ("--seq-bucket-factor", int),
        ("--compilation-cache-dir", str),
    ):
        eng.add_argument(flag, type=kind, default=None)
    eng.add_argument("--policy", choices=["fcfs", "priority"], default=None)
    srv.set_defaults(func=_cmd_serve)

    cli = sub.add_parser("client", help="stream a completion from a jaxserve server")
    cli.add_argument("prompt")
    cli.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server")
    cli.add_argument(
        "--max-tokens", type=int, default=None, help="default: 256, or what the context allows"
    )
    cli.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    cli.add_argument("--top-p", type=float, default=None)
    cli.add_argument("--top-k", type=int, default=None)
    cli.add_argument("--seed", type=int, default=None)
    cli.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    cli.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    cli.add_argument("--auth-token-file", help="bearer token (default: $JAXSERVE_AUTH_TOKEN)")
    cli.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    cli.add_argument("--tls-ca", help="PEM root certificate(s) to trust (implies --tls)")
    cli.add_argument("--stats", action="store_true", help="print usage and timings to stderr")
    cli.set_defaults(func=_cmd_client)

    _add_bench_parser(sub)
    _add_batch_parser(sub)
    return parser


def _add_bench_parser(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="compare scheduling configurations on one model under the same traffic",
        description="Runs every configuration (the product of the comma-separated lists) at "
        "every load of a traffic profile, holding model, precision and lengths fixed; prints a "
        "table and writes bench.json and PNG plots to --out.",
    )
    _add_model_args(b)
    t = b.add_argument_group("traffic")
    t.add_argument(
        "--profile",
        default="mixed",
        choices=["baseline", "concurrency", "mixed", "trace"],
        help="baseline: concurrency 1; concurrency: rising concurrency, fixed "
        "lengths; mixed: short/long prompts and brief/extended outputs under Poisson "
        "arrivals; trace: a JSONL file (default: mixed)",
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
    t.add_argument("--seed", type=int, default=0, help="traffic and weight seed")
    c = b.add_argument_group("configurations compared (comma-separated lists)")
    c.add_argument("--batching", default="continuous,static,dynamic")
    c.add_argument("--max-num-seqs", default="16")
    c.add_argument("--max-num-batched-tokens", default="256")
    c.add_argument("--chunked-prefill", default="on", help="on, off or on,off")
    c.add_argument("--policy", default="fcfs", help="fcfs, priority (mixed: shorter outputs first)")
    e = b.add_argument_group("held fixed")
    e.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: the longest request, rounded up to a page",
    )
    e.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="KV pool pages (default: sized from max_num_seqs and max_model_len)",
    )
    e.add_argument(
        "--dynamic-timeout",
        type=float,
        default=0.05,
        help="dynamic batching: seconds a partial batch waits to fill",
    )
    e.add_argument("--min-token-bucket", type=int, default=None, help="default: the engine's")
    e.add_argument("--token-bucket-factor", type=int, default=None, help="default: the engine's")
    e.add_argument("--seq-bucket-factor", type=int, default=None, help="default: the engine's")
    e.add_argument(
        "--compile-cache",
        default=None,
        help="persistent compilation cache folder "
        "(default: a temporary one shared by this run's engines)",
    )
    o = b.add_argument_group("targets and output")
    o.add_argument("--ttft-slo", type=float, default=1.0, help="goodput TTFT target, seconds")
    o.add_argument("--tpot-slo", type=float, default=0.1, help="goodput TPOT target, seconds")
    o.add_argument("--out", default="bench-out", help="folder for bench.json and the PNGs")
    o.add_argument(
        "--online",
        metavar="HOST:PORT",
        default=None,
        help="send the traffic to a running `jaxserve serve` instead",
    )
    o.add_argument(
        "--replot",
        action="store_true",
        help="run nothing: redraw the table and PNGs from --out's bench.json",
    )
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
    _add_model_args(b)
    b.add_argument("--max-tokens", type=int, default=256, help="default for lines without one")
    b.add_argument(
        "--temperature", type=float, default=0.0, help="default for lines without one (0: greedy)"
    )
    b.add_argument("--max-num-seqs", type=int, default=32)
    b.add_argument("--max-num-batched-tokens", type=int, default=256)
    b.add_argument("--max-model-len", type=int, default=None)
    b.add_argument("--min-token-bucket", type=int, default=8)
    b.add_argument("--seq-bucket-factor", type=int, default=2)
    b.add_argument("--compile-cache", default=None, help="persistent compilation cache folder")
    b.add_argument(
        "--stop-on-error",
        action="store_true",
        help="stop at the first bad input line (default: report it and skip it)",
    )
    b.add_argument("--token-ids", action="store_true", help="also write the output token ids")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=_cmd_batch)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except (UserError, ValueError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
