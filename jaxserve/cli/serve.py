"""`jaxserve serve` (the gRPC server) and `jaxserve client` (streams one completion from it).

On a multi-host mesh every process runs `serve` with the same flags: process 0 serves, and the
others build the same engine and run its steps (`ModelRunner.follow`) until process 0's engine
thread releases them as it stops (jaxserve/engine/async_engine.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxserve.cli.common import UserError, add_multihost_args, is_follower, join_cluster
from jaxserve.engine_args import add_engine_args, engine_config_from_args


def register(sub) -> None:
    srv = sub.add_parser(
        "serve",
        help="serve a model over gRPC (health, reflection, metrics) and/or an OpenAI-compatible "
        "HTTP API (--http-port)",
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    srv.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API on this port (0: any free port)",
    )
    srv.add_argument(
        "--no-grpc", action="store_true", help="serve the HTTP API alone (needs --http-port)"
    )
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
    srv.add_argument(
        "--health-without-auth",
        action="store_true",
        help="with a token: let grpc.health.v1.Health calls in without it (Kubernetes probes)",
    )
    srv.add_argument(
        "--max-message-bytes",
        type=int,
        default=16 << 20,
        help="largest request, on both front ends: a bigger gRPC message is INVALID_ARGUMENT, "
        "a bigger HTTP body 413 (default: 16 MiB)",
    )
    srv.add_argument(
        "--clients-may-raise-priority",
        action="store_true",
        help="let clients send a priority below 0 (lower runs first, and preempts under "
        "--policy priority); by default they may only lower their own (0 to 2**31-1)",
    )
    srv.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter on the HTTP API "
        "(vLLM's): adapters added and removed while serving, into --max-loras slots",
    )
    srv.add_argument(
        "--allow-weight-updates",
        action="store_true",
        help="serve the operator's calls, for an RL trainer (docs/rl.md): on gRPC the "
        "jaxserve.v1.Admin service; on the HTTP API POST /update_weights_from_disk {model_path} "
        "(sglang's), POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping (vLLM's); needs a "
        "bearer token unless --host is the loopback",
    )
    srv.add_argument(
        "--stay-up-on-engine-failure",
        action="store_true",
        help="after the engine fails, keep answering INTERNAL until signalled (debugging) "
        "instead of draining and exiting with status 3 for a supervisor to restart",
    )
    srv.add_argument(
        "--chat-template",
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) that the HTTP API renders "
        "chat with, in place of the model's own; the embedded model has none",
    )
    srv.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        default=[],
        help="the names clients address the model by (vLLM's): listed by /v1/models and "
        "GetModelInfo, given as the `model` of answers (the name the request sent, else the "
        "first); a request naming another model is a 404 (default: the model's folder's name, "
        "and any name is accepted)",
    )
    srv.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="send a span per generation call (OpenTelemetry, GenAI attributes and latencies, "
        "a child of the caller's traceparent) over OTLP/gRPC to the collector at this URL, "
        "e.g. http://127.0.0.1:4317 (vLLM's; needs the `serve` extra; docs/tracing.md)",
    )
    srv.add_argument("--log-format", choices=["json", "text"], default="json")
    ray = srv.add_argument_group(
        "replicas on Ray Serve",
        "several engines behind one OpenAI HTTP address (--http-port, default 8000), each "
        "request routed to the replica whose prefix cache most likely holds its prompt "
        '(docs/ray_serve.md; needs the serve extra: pip install -e ".[serve]"); no gRPC',
    )
    ray.add_argument(
        "--ray-replicas", type=int, default=None, metavar="N", help="serve N replicas on Ray"
    )
    ray.add_argument(
        "--ray-max-replicas",
        type=int,
        default=None,
        metavar="M",
        help="autoscale from --ray-replicas up to M replicas on requests in flight",
    )
    ray.add_argument(
        "--ray-address",
        default=None,
        metavar="HOST:PORT",
        help="join this Ray cluster (default: start one on 127.0.0.1 for the server's life)",
    )
    ray.add_argument(
        "--ray-router",
        choices=["prefix", "pow2"],
        default="prefix",
        help="prefix: the replica that served the longest prefix of the prompt, unless its "
        "queue is much longer (default); pow2: the power of two choices, Serve's default",
    )
    ray.add_argument("--ray-cpus-per-replica", type=float, default=1.0, metavar="C")
    ray.add_argument(
        "--ray-devices-per-replica",
        type=int,
        default=1,
        metavar="K",
        help="GPUs or TPU chips per replica where the cluster has them",
    )
    add_engine_args(srv)
    add_multihost_args(srv)
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


def _cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from service.auth import load_token
    from service.server import ServeError, ServerOptions, configure_logging, serve

    configure_logging(args.log_format, logging.DEBUG if args.verbose else logging.INFO)
    if args.ray_replicas is not None:
        return _serve_on_ray(args)
    join_cluster(args)  # before the engine is built: a cluster must be joined first
    config = engine_config_from_args(args, show_progress=False)  # serve logs JSON lines instead
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UserError("TLS needs both --tls-cert and --tls-key.")
    if args.no_grpc and args.http_port is None:
        raise UserError("--no-grpc needs --http-port: there would be nothing to serve.")
    options = ServerOptions(
        host=args.host,
        port=args.port,
        grpc=not args.no_grpc,
        http_port=args.http_port,
        metrics_port=None if args.no_metrics else args.metrics_port,
        grace_s=args.grace_period,
        tls_cert=_read_file(args.tls_cert),
        tls_key=_read_file(args.tls_key),
        auth_token=load_token(args.auth_token_file),
        health_without_auth=args.health_without_auth,
        max_message_bytes=args.max_message_bytes,
        clients_may_raise_priority=args.clients_may_raise_priority,
        allow_runtime_lora=args.allow_runtime_lora,
        allow_weight_updates=args.allow_weight_updates,
        stay_up_on_engine_failure=args.stay_up_on_engine_failure,
        chat_template=_chat_template(args.chat_template),
        served_model_names=_served_model_names(args.served_model_name),
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )
    if is_follower(args):
        return _follow(config)

    def build_engine():  # runs during warm-up, while the port already answers health checks
        from jaxserve.engine.async_engine import AsyncEngine

        return AsyncEngine(config)  # releases the followers when it shuts down

    try:
        return asyncio.run(serve(build_engine, options))
    except ServeError as e:
        raise UserError(str(e)) from e


def _serve_on_ray(args: argparse.Namespace) -> int:
    """`serve --ray-replicas N`: the OpenAI HTTP API of N engines on Ray Serve."""
    from service.auth import load_token

    if args.tls_cert is not None or args.tls_key is not None:
        raise UserError("--tls-cert/--tls-key are not served on Ray yet: Serve's proxy is plain.")
    try:
        from service.ray_serve import RayServeOptions, serve_on_ray
    except ImportError as e:
        raise UserError(str(e)) from e
    try:
        options = RayServeOptions(
            replicas=args.ray_replicas,
            max_replicas=args.ray_max_replicas,
            router=args.ray_router,
            cpus_per_replica=args.ray_cpus_per_replica,
            devices_per_replica=args.ray_devices_per_replica,
        )
    except ValueError as e:
        raise UserError(str(e)) from e
    config = engine_config_from_args(args, show_progress=False)
    server_options = dict(
        grace_s=args.grace_period,
        auth_token=load_token(args.auth_token_file),
        max_message_bytes=args.max_message_bytes,
        clients_may_raise_priority=args.clients_may_raise_priority,
        allow_runtime_lora=args.allow_runtime_lora,
        chat_template=_chat_template(args.chat_template),
        served_model_names=_served_model_names(args.served_model_name),
    )
    port = 8000 if args.http_port is None else args.http_port
    try:
        return serve_on_ray(config, server_options, options, port, args.ray_address, args.host)
    except (ImportError, ConnectionError) as e:
        raise UserError(str(e)) from e


def _follow(config) -> int:
    """Multi-host, processes other than 0: the same engine as process 0's, running its steps
    until its engine thread releases them."""
    from checkpoints import ModelLoadError
    from jaxserve.engine.build import build_engine

    # A follower never schedules, so it has no KV events to send; opening the leader's sockets
    # would only collide with them (docs/kv_events.md).
    config = config.replace(
        kv_events_endpoint=None, kv_events_replay_endpoint=None, kv_events_topic=""
    )
    try:
        engine = build_engine(config)
    except ModelLoadError as e:
        raise UserError(str(e)) from e
    engine.runner.follow()
    return 0


def _chat_template(arg: str | None) -> str | None:
    """--chat-template's template: a file's text, or the argument itself where it is one
    (as vLLM takes it); checked to compile as the tokenizer will compile it."""
    if arg is None:
        return None
    if os.path.isfile(arg):
        template = _read_file(arg).decode("utf-8", errors="replace")
    elif any(c in arg for c in "{}\n"):
        template = arg
    else:
        raise UserError(f"--chat-template {arg!r} is neither a file nor a Jinja template.")
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: the first chat call reports a bad one
        return template
    try:
        _compile_jinja_template(template)
    except Exception as e:  # jinja2's TemplateSyntaxError, or an extension transformers lacks
        raise UserError(f"--chat-template does not compile as a Jinja template: {e}.") from e
    return template


def _served_model_names(names: list[str]) -> tuple[str, ...]:
    """--served-model-name's names, checked: each non-empty, none twice."""
    for name in names:
        if not name.strip():
            raise UserError(f"--served-model-name {name!r} is empty: name the model.")
    if len(set(names)) != len(names):
        raise UserError(f"--served-model-name {' '.join(names)} names a model twice.")
    return tuple(names)


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
    from service.grpc.client import JaxServeClient

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
