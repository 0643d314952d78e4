"""The gRPC server: jaxserve.v1.JaxServe over an AsyncEngine, with health, reflection, metrics
(and jaxserve.v1.Admin, the operator's calls, with `allow_weight_updates`);
with `http_port`, the OpenAI-compatible HTTP API (service/http/) beside it on the same loop, the
same engine and the same lifecycle (its /health answers 503 unless SERVING; `grpc=False` serves
HTTP alone).

Lifecycle: WARMING (the port is open, health says NOT_SERVING, calls get UNAVAILABLE while the
model loads and the buckets compile) -> SERVING -> DRAINING (on SIGTERM/SIGINT or `stop()`:
health NOT_SERVING, new calls UNAVAILABLE, calls in flight finish within the grace period, then
the rest are cancelled) -> STOPPED. If the engine thread dies: FAILED, health NOT_SERVING, every
open stream ends with INTERNAL at once and new calls get INTERNAL; `serve()` then drains (new
calls UNAVAILABLE) and returns a non-zero status within the grace period, so that a supervisor
restarts the process, unless `stay_up_on_engine_failure` keeps it answering INTERNAL.

Concurrency:
- One asyncio event loop (grpc.aio) runs every handler, the health and reflection services and
  the lifecycle. Handlers never block it: they check a request (a text with more bytes than the
  context could hold is refused untokenized), hand its text to the servicer's two tokenizer
  threads, then await their AsyncEngine stream. A client sending megabytes costs the loop the
  parse of its message, not seconds of tokenizing.
- One engine thread (AsyncEngine) owns the Engine. Handlers reach it only through
  `AsyncEngine.generate()` and read it only through values fixed at start-up
  (`AsyncEngine.info`: the model's name, vocabulary and limits) and `snapshot()`. The tokenizer
  is the exception: the tokenizer threads encode while the engine thread decodes; the Rust
  tokenizer takes shared borrows for both.
- Warm-up (model load, bucket compilation) runs on its own daemon thread so the loop keeps
  answering health checks meanwhile, and a SIGTERM during warm-up is not held up by it.
- prometheus_client serves /metrics from its own HTTP thread; the registries it reads are
  thread-safe.
- With --otlp-traces-endpoint, the calls' spans are begun and ended on the loop and sent by the
  OpenTelemetry SDK's batch thread (service/tracing.py); `stop()` flushes it, off the loop,
  once the front ends have stopped.
- A cancelled, disconnected or expired call cancels its handler task; closing the handler's
  engine stream posts an abort, and the engine frees the slot and pages at its next iteration.
- Bounded: a request message (max_message_bytes, for both front ends: over gRPC beyond it
  INVALID_ARGUMENT, and beyond 4x it gRPC itself refuses it unread; over HTTP a 413 before the
  body is read, or as soon as a streamed body passes it), the text worth tokenizing
  (validation.PromptLimit), the engine's waiting queue (max_waiting_requests, beyond it
  RESOURCE_EXHAUSTED) and one output queue per open stream, holding at most that request's
  tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from jaxserve.engine.async_engine import AsyncEngine
from service import tracing, validation
from service.auth import BearerTokenInterceptor
from service.grpc.servicer import ADMIN_SERVICE_NAME, SERVICE_NAME, JaxServeServicer
from service.lifecycle import Lifecycle, State
from service.logs import configure_logging, log

__all__ = ["JaxServeServer", "ServeError", "ServerOptions", "State", "configure_logging", "serve"]

logger = logging.getLogger("jaxserve.server")

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
# gRPC itself refuses a message beyond this many times max_message_bytes, before any handler
# runs, with RESOURCE_EXHAUSTED; up to it the servicer reads the size and answers
# INVALID_ARGUMENT naming the limit. The factor bounds what one call may make the server buffer.
TRANSPORT_LIMIT_FACTOR = 4
_MAX_MESSAGE_BYTES = (2**31 - 1) // TRANSPORT_LIMIT_FACTOR  # gRPC's limit is an int32
EXIT_ENGINE_FAILED = 3  # serve()'s status after the engine thread died (2 is a usage error)


class ServeError(RuntimeError):
    """The server could not start (a port in use, a model that does not load)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """Where and how the server listens. Defaults: loopback only, plain text, no token."""

    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (see JaxServeServer.port)
    grpc: bool = True  # False: the HTTP API alone (needs http_port)
    http_port: int | None = None  # the OpenAI-compatible HTTP API (service/http/); 0: any free
    metrics_port: int | None = 9400  # None: no metrics endpoint; 0: any free port
    grace_s: float = 30.0  # how long calls in flight may run on after a drain begins
    tls_cert: bytes | None = None  # PEM certificate chain; TLS when given with tls_key
    tls_key: bytes | None = None
    auth_token: str | None = None
    health_without_auth: bool = False  # let grpc.health.v1.Health calls in without the token
    # A bigger request is refused, on both front ends: a gRPC message with INVALID_ARGUMENT, an
    # HTTP body with 413 (before it is read when its Content-Length says so).
    max_message_bytes: int = 16 << 20
    # Priority: lower runs first. By default clients may only lower their own (0 to 2**31 - 1);
    # True lets them send negative values too, and so preempt other clients' requests.
    clients_may_raise_priority: bool = False
    # vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter on the HTTP API.
    allow_runtime_lora: bool = False
    # The operator's calls (service/admin.py): new weights from a folder, sleep and wake-up,
    # for an RL trainer in another process; on gRPC as jaxserve.v1.Admin, on the HTTP API (with
    # http_port) as sglang's and vLLM's routes. Needs auth_token unless the server listens on
    # the loopback only.
    allow_weight_updates: bool = False
    # A Jinja chat template the HTTP API renders chat with, in place of the model's own (the
    # embedded model has none); None: the model's.
    chat_template: str | None = None
    # vLLM's --served-model-name: the names clients address the model by (in /v1/models, the
    # `model` of answers, gRPC's ModelInfo), the first its main one; a request naming another
    # is a 404. Empty: the model's folder's name, and any name a request sends.
    served_model_names: tuple[str, ...] = ()
    stay_up_on_engine_failure: bool = False  # serve(): linger answering INTERNAL, for debugging
    # vLLM's --otlp-traces-endpoint: a span per generation call, sent over OTLP/gRPC to the
    # collector at this URL (http://HOST:PORT; service/tracing.py). None: no tracing at all.
    otlp_traces_endpoint: str | None = None

    def __post_init__(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate and a key (tls_cert and tls_key).")
        if not self.grpc and self.http_port is None:
            raise ValueError("grpc=False (--no-grpc) needs an http_port: nothing would be served.")
        for name in ("port", "metrics_port", "http_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name}={port} must be in [0, 65535].")
        names = self.served_model_names
        if not isinstance(names, tuple) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"served_model_names={names!r} must be a tuple of non-empty names.")
        if len(set(names)) != len(names):
            raise ValueError(f"served_model_names={names!r} names a model twice.")
        if self.allow_weight_updates and not self.auth_token and self.host not in _LOOPBACK:
            raise ValueError(
                f"allow_weight_updates on host {self.host!r} needs an auth token: anyone who "
                "reaches the port could replace the served weights. Set one (--auth-token-file "
                "or $JAXSERVE_AUTH_TOKEN) or listen on 127.0.0.1."
            )
        if self.otlp_traces_endpoint is not None:
            tracing.check_endpoint(self.otlp_traces_endpoint)
        if self.grace_s < 0:
            raise ValueError(f"grace_s={self.grace_s} must be >= 0.")
        if not 1024 <= self.max_message_bytes <= _MAX_MESSAGE_BYTES:
            raise ValueError(
                f"max_message_bytes={self.max_message_bytes} must be in [1024, "
                f"{_MAX_MESSAGE_BYTES}] (gRPC's own limit is {TRANSPORT_LIMIT_FACTOR}x it)."
            )


class JaxServeServer:
    """One grpc.aio server over one AsyncEngine.

    Given an AsyncEngine, it serves at once and leaves the engine running when it stops (the
    caller owns it). Given a factory, it calls it during warm-up and shuts the engine down.
    `tracer_provider` (an OpenTelemetry TracerProvider, which the caller owns: tests give one
    with an in-memory exporter) takes the calls' spans in place of `otlp_traces_endpoint`'s.
    """

    def __init__(
        self,
        engine: AsyncEngine | Callable[[], AsyncEngine],
        options: ServerOptions | None = None,
        *,
        tracer_provider=None,
    ):
        self.options = options or ServerOptions()
        self._tracer_provider = tracer_provider
        self._tracer = None  # service.tracing.RequestTracer, while tracing is on
        self._engine_source = engine
        self._owns_engine = not isinstance(engine, AsyncEngine)  # built here: stopped here
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self._http = None  # service.http.HttpListener, with options.http_port
        self.http_app = None  # service.http.routes.OpenAIFrontEnd, with options.http_port
        self._ready = asyncio.Event()  # serving, or warm-up failed
        self._force = asyncio.Event()  # end the drain now
        self.failed = asyncio.Event()  # set once the engine has died while serving
        self._tasks: set[asyncio.Task] = set()
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._metrics_http = None
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(self))
        # State, engine and calls in flight, shared by the gRPC servicer and the HTTP front end.
        self.lifecycle = Lifecycle(self.registry, self.engine_failed)
        self.servicer = JaxServeServicer(
            self.lifecycle,
            self.registry,
            self.options.max_message_bytes,
            clients_may_raise_priority=self.options.clients_may_raise_priority,
            served_model_names=self.options.served_model_names,
        )
        self._serving_gauge = Gauge(
            "jaxserve_serving", "1 while health says SERVING.", registry=self.registry
        )

    # What the lifecycle holds, read and written here as the server's own.

    @property
    def state(self) -> State:
        return self.lifecycle.state

    @state.setter
    def state(self, value: State) -> None:
        self.lifecycle.state = value

    @property
    def engine(self) -> AsyncEngine | None:
        return self.lifecycle.engine

    @engine.setter
    def engine(self, value: AsyncEngine) -> None:
        self.lifecycle.engine = value

    @property
    def warmup_error(self) -> BaseException | None:
        return self.lifecycle.warmup_error

    @warmup_error.setter
    def warmup_error(self, value: BaseException) -> None:
        self.lifecycle.warmup_error = value

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Opens the port (health NOT_SERVING) and starts warm-up; returns without waiting."""
        opts = self.options
        for name in ("", SERVICE_NAME):  # the servicer starts out saying SERVING for ""
            await self._health.set(name, _NOT_SERVING)
        interceptors = []
        if opts.auth_token:
            exempt = (f"/{health.SERVICE_NAME}/",) if opts.health_without_auth else ()
            interceptors.append(BearerTokenInterceptor(opts.auth_token, exempt=exempt))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share
                (
                    "grpc.max_receive_message_length",
                    opts.max_message_bytes * TRANSPORT_LIMIT_FACTOR,
                ),
            ],
        )
        server.add_generic_rpc_handlers((self.servicer.generic_handler(),))
        services = [SERVICE_NAME]
        if opts.allow_weight_updates:  # otherwise its calls are UNIMPLEMENTED: it is not there
            server.add_generic_rpc_handlers((self.servicer.admin_handler(),))
            services.append(ADMIN_SERVICE_NAME)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        address = f"{opts.host}:{opts.port}"
        if opts.grpc:
            try:
                if opts.tls_cert is not None:
                    creds = grpc.ssl_server_credentials([(opts.tls_key, opts.tls_cert)])
                    self.port = server.add_secure_port(address, creds)
                else:
                    self.port = server.add_insecure_port(address)
            except RuntimeError as e:
                raise ServeError(f"Cannot listen on {address}: {e} (is the port in use?)") from e
        if opts.auth_token and opts.tls_cert is None and opts.host not in _LOOPBACK:
            logger.warning(
                "an auth token is set without TLS on %s: it travels in the clear", opts.host
            )
        await server.start()
        self._server = server
        if opts.http_port is not None:
            await self._start_http()
        if opts.metrics_port is not None:
            try:
                self._metrics_http, _ = start_http_server(
                    opts.metrics_port, addr=opts.host, registry=self.registry
                )
            except OSError as e:
                await server.stop(0)
                raise ServeError(
                    f"Cannot serve metrics on {opts.host}:{opts.metrics_port}: {e}"
                ) from e
            self.metrics_port = self._metrics_http.server_port
        await self._start_tracing()
        _log(
            logging.INFO,
            "listening",
            host=opts.host,
            port=self.port,
            http_port=self.http_port,
            metrics_port=self.metrics_port,
            tls=opts.tls_cert is not None,
            auth=bool(opts.auth_token),
            health_without_auth=bool(opts.auth_token) and opts.health_without_auth,
            max_message_bytes=opts.max_message_bytes,
            clients_may_raise_priority=opts.clients_may_raise_priority,
            otlp_traces_endpoint=opts.otlp_traces_endpoint,
        )
        if isinstance(self._engine_source, AsyncEngine):
            await self._start_serving(self._engine_source, 0.0)
        else:
            self._spawn(self._warm_up(self._engine_source))

    async def _start_tracing(self) -> None:
        """The tracer calls' spans go to, once the ports are open (no failure after it leaves
        an exporter thread behind); none, and no opentelemetry import, without tracing."""
        if self._tracer_provider is None and self.options.otlp_traces_endpoint is None:
            return
        if self._tracer_provider is not None:
            self._tracer = tracing.RequestTracer(self._tracer_provider)
        else:
            try:
                endpoint = self.options.otlp_traces_endpoint
                self._tracer = tracing.RequestTracer.to_collector(endpoint)
            except ImportError as e:  # the `serve` extra is not installed
                await self._server.stop(0)
                if self._http is not None:
                    await self._http.stop()
                if self._metrics_http is not None:
                    await asyncio.to_thread(self._close_metrics)
                raise ServeError(
                    f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP/gRPC "
                    f"exporter ({e}): pip install 'jaxserve[serve]'."
                ) from e
        self.lifecycle.tracer = self._tracer

    async def _start_http(self) -> None:
        """The OpenAI-compatible API on its own port, over the same engine, state and drain."""
        # Imported here, so that a server without HTTP never loads FastAPI and uvicorn.
        from service.http import HttpListener
        from service.http.routes import OpenAIFrontEnd

        opts = self.options
        self.http_app = OpenAIFrontEnd(
            self.lifecycle,
            self.registry,
            auth_token=opts.auth_token,
            health_without_auth=opts.health_without_auth,
            max_body_bytes=opts.max_message_bytes,
            clients_may_raise_priority=opts.clients_may_raise_priority,
            allow_runtime_lora=opts.allow_runtime_lora,
            allow_weight_updates=opts.allow_weight_updates,
            chat_template=opts.chat_template,
            served_model_names=opts.served_model_names,
        )
        self._http = HttpListener(
            self.http_app.app,
            opts.host,
            opts.http_port,
            tls_cert=opts.tls_cert,
            tls_key=opts.tls_key,
        )
        try:
            self.http_port = await self._http.start()
        except OSError as e:
            await self._server.stop(0)
            raise ServeError(
                f"Cannot serve HTTP on {opts.host}:{opts.http_port}: {e} (is the port in use?)"
            ) from e

    async def wait_ready(self) -> None:
        """Returns once serving; raises the warm-up's error if it failed."""
        await self._ready.wait()
        if self.warmup_error is not None:
            raise self.warmup_error

    async def stop(self, grace_s: float | None = None) -> None:
        """Drains: refuses new calls, lets those in flight finish within the grace period."""
        if self.state in (State.DRAINING, State.STOPPED):
            return
        grace = self.options.grace_s if grace_s is None else grace_s
        self.state = State.DRAINING
        self._serving_gauge.set(0)
        await self._health.enter_graceful_shutdown()  # NOT_SERVING for every service, for good
        active = self.lifecycle.active
        _log(logging.INFO, "draining", calls_in_flight=active, grace_s=grace)
        waits = [asyncio.ensure_future(e.wait()) for e in (self.lifecycle.idle, self._force)]
        await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if self.lifecycle.active:
            _log(logging.WARNING, "drain cut short", calls_in_flight=self.lifecycle.active)
            # HTTP calls answer 503 (or end their stream with an error event) now, while the
            # listener below still lets responses out, instead of being cancelled unanswered.
            self.lifecycle.end_drain(
                f"The server is shutting down and its grace period ({grace} s) ended before "
                "this call finished; send it to another replica."
            )
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(
            # Cancels the calls left; closing their engine streams aborts their requests.
            *([self._server.stop(0)] if self._server is not None else []),
            *([self._http.stop()] if self._http is not None else []),
            # Off the loop: it waits up to half a second for the HTTP thread's next poll.
            *([asyncio.to_thread(self._close_metrics)] if self._metrics_http is not None else []),
        )
        self.lifecycle.close()
        if self._tracer is not None:
            # Every call's span has ended (the front ends have stopped): send what is queued.
            await asyncio.to_thread(self._tracer.shutdown)
        if self.engine is not None and self._owns_engine:
            await asyncio.to_thread(self.engine.shutdown)
        self.state = State.STOPPED
        self._ready.set()
        _log(logging.INFO, "stopped")

    def _close_metrics(self) -> None:
        self._metrics_http.shutdown()
        self._metrics_http.server_close()

    def force_stop(self) -> None:
        """Ends a drain in progress now (a second SIGTERM/SIGINT)."""
        self._force.set()

    async def _warm_up(self, factory: Callable[[], AsyncEngine]) -> None:
        loop = asyncio.get_running_loop()
        built: asyncio.Future = loop.create_future()
        start = time.perf_counter()

        def work():  # a daemon thread, not the loop's executor: shutdown never waits on it
            try:
                result, error = factory(), None
            except BaseException as e:
                result, error = None, e
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, built, result, error)

        threading.Thread(target=work, name="jaxserve-warmup", daemon=True).start()
        try:
            engine = await built
        except Exception as e:
            self.warmup_error = e
            self.state = State.FAILED
            _log(logging.ERROR, "warm-up failed", error=str(e))
            self._ready.set()
            return
        await self._start_serving(engine, time.perf_counter() - start)

    async def _start_serving(self, engine: AsyncEngine, warmup_s: float) -> None:
        self.engine = engine
        if self.state is not State.WARMING:  # stopped while warming up
            await asyncio.to_thread(engine.shutdown)
            return
        # Read from the vocabulary once, off the loop (health checks keep being answered).
        self.lifecycle.prompt_limit = await asyncio.to_thread(
            validation.prompt_limit, engine.tokenizer, engine.info.max_model_len
        )
        if self.state is not State.WARMING:
            await asyncio.to_thread(engine.shutdown)
            return
        self.state = State.SERVING
        for name in ("", SERVICE_NAME):
            await self._health.set(name, _SERVING)
        self._serving_gauge.set(1)
        _log(
            logging.INFO,
            "serving",
            model=engine.info.model,
            served_model_names=list(self.servicer.model_names(engine.info)),
            warmup_s=round(warmup_s, 3),
            max_model_len=engine.info.max_model_len,
            max_prompt_bytes=self.lifecycle.prompt_limit.max_bytes,
            compiles=engine.num_compiles,
            # The KV pools, the host's sized by --host-kv-gb or its default (kv_transfer.py).
            kv_pages=engine.info.num_pages,
            kv_bytes=engine.info.kv_bytes,
            host_kv_pages=engine.info.num_host_pages,
            host_kv_bytes=engine.info.host_kv_bytes,
        )
        self._spawn(self._watch_engine())
        self._ready.set()

    async def _watch_engine(self) -> None:
        """Notices an engine death even when no call is open to see it."""
        while self.state is State.SERVING:
            if not self.engine.is_alive:
                await self.engine_failed()
                return
            await asyncio.sleep(0.1)

    async def engine_failed(self) -> None:
        """Health turns NOT_SERVING for good; calls get INTERNAL from now on (`failed` is set,
        for serve() to exit on)."""
        if self.state is not State.SERVING:
            return
        self.state = State.FAILED
        self._serving_gauge.set(0)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, _NOT_SERVING)
        _log(logging.ERROR, "engine failed", error=repr(self.engine.error))
        self.failed.set()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class _EngineCollector:
    """Exposes the engine's own registry through the server's, once the engine exists."""

    def __init__(self, server: JaxServeServer):
        self._server = server

    def describe(self):
        return []  # names unknown until warm-up; nothing to check for clashes

    def collect(self):
        engine = self._server.engine
        if engine is not None:
            yield from engine.metrics_registry.collect()


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _log(level: int, message: str, **fields) -> None:
    log(logger, level, message, **fields)


# ---- process entry point ------------------------------------------------------------------


async def serve(factory: Callable[[], AsyncEngine], options: ServerOptions) -> int:
    """Serves until SIGTERM/SIGINT, then drains; returns the exit status: 0 after a drain,
    EXIT_ENGINE_FAILED after a drain that the engine's death began (so that a supervisor
    restarts the process), unless `options.stay_up_on_engine_failure`.

    A signal during the drain cancels the calls still running.
    """
    server = JaxServeServer(factory, options)
    # Handlers first: start() logs "listening", and a supervisor may signal at once; one that
    # arrived before the handlers would kill the process instead of draining it.
    loop = asyncio.get_running_loop()
    signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    await server.start()
    ready = asyncio.ensure_future(server.wait_ready())
    first = asyncio.ensure_future(signals.get())
    await asyncio.wait({ready, first}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and ready.exception() is not None and not first.done():
        first.cancel()
        await server.stop(0)
        raise ServeError(str(ready.exception())) from ready.exception()
    failed = asyncio.ensure_future(server.failed.wait())
    ends = {first} if options.stay_up_on_engine_failure else {first, failed}
    await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
    if first.done():
        _log(logging.INFO, "signal received", signal=first.result().name)
        status = 0
    else:
        first.cancel()
        _log(logging.ERROR, "exiting after the engine failure", exit_status=EXIT_ENGINE_FAILED)
        status = EXIT_ENGINE_FAILED
    failed.cancel()
    stopping = asyncio.ensure_future(server.stop())
    second = asyncio.ensure_future(signals.get())
    await asyncio.wait({stopping, second}, return_when=asyncio.FIRST_COMPLETED)
    if second.done():
        _log(logging.WARNING, "signal during the drain: stopping now", signal=second.result().name)
        server.force_stop()
    second.cancel()
    ready.cancel()
    await stopping
    return status
