"""The server's life, shared by its front ends: the state, the engine once warm, who may come
in, the calls in flight, tokenizing off the loop, the spans of their calls (with
--otlp-traces-endpoint: service/tracing.py), and the engine's death.

The gRPC servicer (grpc/servicer.py) and the HTTP front end (http/routes.py) hold this object,
not the server: they read the state and the engine here, admit and count their calls here,
tokenize (and parse large HTTP bodies) on its threads, learn here when a drain's grace period
has ended, and report an engine death here. The server (server.py) drives it
through WARMING -> SERVING -> DRAINING -> STOPPED, or FAILED, and owns health, ports and signals.
Everything runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry, Gauge

from jaxserve.engine.async_engine import EngineDeadError
from service.tracing import NO_SPAN

if TYPE_CHECKING:
    from collections.abc import Mapping

    from jaxserve.engine.async_engine import AsyncEngine
    from service.tracing import CallSpan, NoSpan, RequestTracer
    from service.validation import PromptLimit


class State(enum.Enum):
    """Where the server is in its life (see service/server.py)."""

    WARMING = "warming"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class Refused(Exception):
    """A call the server's state does not let in."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class Lifecycle:
    """State and engine of one server, and the calls its front ends have in flight."""

    # Tokenizing is CPU work: two threads keep the loop free without crowding the engine thread.
    TOKENIZER_THREADS = 2
    # Large HTTP bodies are parsed apart from tokenizing, so that a flood of them never delays
    # another call's tokens; more bodies than threads wait their turn, unparsed.
    PARSER_THREADS = 2

    def __init__(
        self, registry: CollectorRegistry, on_engine_failed: Callable[[], Awaitable[None]]
    ):
        """`on_engine_failed` is the server's: it turns health NOT_SERVING, for good."""
        self.state = State.WARMING
        self.engine: AsyncEngine | None = None  # set once warm-up has built it
        self.warmup_error: BaseException | None = None
        self.prompt_limit: PromptLimit | None = None  # set by the server with the engine
        self.tracer: RequestTracer | None = None  # set by the server when tracing is on
        self._on_engine_failed = on_engine_failed
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            self.TOKENIZER_THREADS, thread_name_prefix="jaxserve-tokenize"
        )
        self.active = 0  # calls in flight, gRPC and HTTP
        self.idle = asyncio.Event()  # set while no call is in flight: what a drain waits for
        self.idle.set()
        self._parser_pool = concurrent.futures.ThreadPoolExecutor(
            self.PARSER_THREADS, thread_name_prefix="jaxserve-parse"
        )
        # Set when a drain's grace period ends with calls still in flight (`end_drain`).
        self.drain_ended = asyncio.Event()
        self.drain_error: Refused | None = None
        self._drain_watchers: set[Callable[[Refused], None]] = set()
        self._in_flight = Gauge(  # the name predates HTTP; it counts both front ends' calls
            "jaxserve_grpc_calls_in_flight", "jaxserve.v1 calls running.", registry=registry
        )

    def admit(self) -> None:
        """Raises Refused (or EngineDeadError) unless the state lets a new call in."""
        if self.state is State.SERVING:
            return
        if self.state is State.WARMING:
            raise Refused(
                grpc.StatusCode.UNAVAILABLE,
                "The server is warming up (loading the model, compiling); retry shortly.",
            )
        if self.state is State.FAILED and self.engine is not None:
            error = self.engine.error
            raise EngineDeadError(
                f"The engine has failed: {error!r}" if error else "The engine was shut down."
            )
        if self.state is State.FAILED:
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"Warm-up failed: {self.warmup_error}")
        raise Refused(
            grpc.StatusCode.UNAVAILABLE,
            "The server is shutting down (draining); send new requests to another replica.",
        )

    @contextlib.contextmanager
    def in_flight(self):
        """Counts a call as in flight while the block runs: the drain waits for it."""
        self.active += 1
        self.idle.clear()
        self._in_flight.inc()
        try:
            yield
        finally:
            self.active -= 1
            self._in_flight.dec()
            if not self.active:
                self.idle.set()

    def start_span(self, operation: str, carrier: Mapping[str, str]) -> CallSpan | NoSpan:
        """A generation call's span, begun now (a child of the caller's span in `carrier`, its
        HTTP headers or gRPC metadata); NO_SPAN, which records nothing, while tracing is off."""
        if self.tracer is None:
            return NO_SPAN
        return self.tracer.start(operation, carrier)

    async def off_loop(self, fn, *args):
        """fn(*args) on the tokenizer threads: tokenizer work never runs on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    async def parse_off_loop(self, fn, *args):
        """fn(*args) on the parser threads (large HTTP bodies: service/http/body.py)."""
        return await asyncio.get_running_loop().run_in_executor(self._parser_pool, fn, *args)

    def end_drain(self, message: str) -> None:
        """The grace period is over: calls still in flight end now with `message` (UNAVAILABLE,
        HTTP 503) rather than being cut off mid-response by their server's shutdown."""
        self.drain_error = Refused(grpc.StatusCode.UNAVAILABLE, message)
        self.drain_ended.set()
        for watcher in list(self._drain_watchers):
            watcher(self.drain_error)

    def watch_drain(self, watcher: Callable[[Refused], None]) -> Callable[[], None]:
        """Calls watcher(error) when the drain's grace period ends (at once if it has);
        returns the function that stops watching."""
        if self.drain_error is not None:
            watcher(self.drain_error)
            return lambda: None
        self._drain_watchers.add(watcher)
        return lambda: self._drain_watchers.discard(watcher)

    async def engine_failed(self) -> None:
        """A front end saw the engine die (EngineDeadError): the server stops serving."""
        await self._on_engine_failed()

    def close(self) -> None:
        """Stops the tokenizer and parser threads (work under way finishes, unread)."""
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._parser_pool.shutdown(wait=False, cancel_futures=True)
