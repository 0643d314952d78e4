"""The OpenAI-compatible HTTP API beside the gRPC service, and `HttpListener`, which runs it with
uvicorn on the gRPC server's event loop (see service/server.py for the lifecycle both follow).

The modules, after vLLM's entrypoints/openai, from the top down: routes.py (the FastAPI app and
its route table), completions.py and chat.py (serving each endpoint), beams.py (vLLM's
`use_beam_search`), pumps.py (a call's engine streams), serving.py (request building both
endpoints share), streaming.py (server-sent events), protocol.py (request and response
bodies), body.py (JSON bodies parsed in bounded slices of the GIL) and token_texts.py (logprob
tokens decoded in context). None of them imports the server: it hands the app what it
needs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import tempfile

import uvicorn

__all__ = ["HttpListener"]

logger = logging.getLogger("jaxserve.http")


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: the process's own (service/server.py's
    `serve`) decide when to drain, for both front ends at once."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpListener:
    """One uvicorn server of an ASGI app on the running event loop.

    The socket is bound in `start()`, so a port in use fails there (OSError) and port 0 learns
    its number at once. It sets SO_REUSEADDR, as uvicorn, vLLM and asyncio's own servers do: a
    server restarted on the port of one that has just served binds at once, although that one's
    closed connections still sit in TIME_WAIT for a minute; a port another socket is LISTENING
    on is still refused (Linux and macOS refuse to bind it whatever the option). `stop()`
    closes the listening socket and cancels the calls still open after `cancel_after_s` (the
    drain before it has already waited for them).
    """

    def __init__(
        self,
        app,
        host: str,
        port: int,
        *,
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
        cancel_after_s: float = 0.5,
    ):
        self._config = uvicorn.Config(
            app,
            log_config=None,  # the process's logging (service/logs.py) is left alone
            access_log=False,  # one line per call comes from the app itself
            lifespan="off",
            timeout_graceful_shutdown=cancel_after_s,
        )
        self._host, self._port = host, port
        self._tls = (tls_cert, tls_key) if tls_cert is not None else None
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Binds and starts serving; returns the port."""
        if self._tls is not None:
            self._load_tls(*self._tls)
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        if os.name == "posix":  # on Windows the option lets a second server share a live port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host.strip("[]"), self._port))
        except OSError:
            sock.close()
            raise
        sock.listen(128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self._server = _Server(self._config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # failed to start: its error, now
                await self._task
                raise OSError(f"The HTTP server on port {self.port} stopped while starting.")
            await asyncio.sleep(0.01)
        return self.port

    def _load_tls(self, cert: bytes, key: bytes) -> None:
        # uvicorn reads PEM files; they exist only while its SSL context is made.
        with tempfile.TemporaryDirectory() as folder:
            paths = []
            for name, data in (("cert.pem", cert), ("key.pem", key)):
                path = os.path.join(folder, name)
                with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                    f.write(data)
                paths.append(path)
            self._config.ssl_certfile, self._config.ssl_keyfile = paths
            self._config.load()

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
