"""Shared by the service tests: one small-bucket engine per session, real servers on free ports.

Compiling a bucket costs seconds on the CPU, so every server in the session runs over the same
`Engine` (2 buckets), one `AsyncEngine` at a time: a server started by a test or a module is
stopped, and its AsyncEngine shut down, before the next one starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from service.grpc.client import JaxServeClient
from service.server import JaxServeServer, ServerOptions

# One token bucket (32), so one compiled step shape (32 tokens, 8 rows); a 256-token context keeps
# page tables small.
SMALL = dict(
    max_num_seqs=8,
    max_num_batched_tokens=32,
    min_token_bucket=32,
    seq_bucket_factor=8,
    max_model_len=256,
    max_waiting_requests=32,  # 32 concurrent clients may all be waiting at once
)
SMALL_FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]


@pytest.fixture(scope="session")
def engine() -> Engine:
    """The embedded stories260k behind a small-bucket engine (compiled once per session)."""
    return Engine(EngineConfig(**SMALL, show_progress=False))


class ServerThread:
    """A JaxServeServer on its own event-loop thread, talked to over real sockets."""

    def __init__(self, engine_or_factory, tracer_provider=None, **options):
        options.setdefault("port", 0)
        options.setdefault("metrics_port", 0)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server = JaxServeServer(
            engine_or_factory, ServerOptions(**options), tracer_provider=tracer_provider
        )
        self.call(self.server.start())

    def call(self, coro, timeout: float = 60.0):
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def client(self, **kwargs) -> JaxServeClient:
        return JaxServeClient(self.target, **kwargs)

    def openai(self, api_key: str = "none"):
        """The official `openai` client of the HTTP port, without retries (a test sees every
        status as the server sent it), refusing any response that is not strict JSON."""
        import httpx2
        import openai

        from tests.service.strict_json import StrictTransport

        base_url = f"http://127.0.0.1:{self.server.http_port}/v1"
        # Every response body is checked as strict JSON as it arrives (strict_json.py).
        http_client = httpx2.Client(transport=StrictTransport(), timeout=600.0)
        return openai.OpenAI(
            base_url=base_url, api_key=api_key, max_retries=0, http_client=http_client
        )

    def stop(self, grace_s: float = 5.0) -> None:
        try:
            self.call(self.server.stop(grace_s))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


@contextlib.contextmanager
def serving(engine: Engine, **options):
    """A server over a fresh AsyncEngine on `engine`; both stopped on exit."""
    async_engine = AsyncEngine(engine=engine)
    try:
        handle = ServerThread(async_engine, **options)
        try:
            yield handle
        finally:
            handle.stop()
    finally:
        async_engine.shutdown()
        assert not engine.has_unfinished(), "the engine must be idle for the next server"


@pytest.fixture(scope="module")
def server(engine):
    """A server with the HTTP API (and gRPC) over the session's engine, for one module (a
    module that needs another defines its own `server`)."""
    with serving(engine, http_port=0) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    """The official `openai` client of the module's server."""
    return server.openai()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.001):
    """Polls until predicate() is truthy; returns its value or fails after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout}s: {predicate}")
        time.sleep(interval)
