"""HTTP API server states: bearer tokens (401), warm-up (503 on every route), HTTP alone
(--no-grpc), and its ports: a restarted server takes back the HTTP port its predecessor has just
served on (SO_REUSEADDR), while a port a live server listens on is still refused, HTTP or gRPC.

Each test runs its own server over the session's engine (servers are cheap; only compiling is
not), with no other server alive (one AsyncEngine per engine at a time).
"""

from __future__ import annotations

import asyncio
import http.client
import pathlib
import threading

import openai
import pytest

from jaxserve.engine.async_engine import AsyncEngine
from service.server import JaxServeServer, ServeError, ServerOptions
from tests.service import strict_json
from tests.service.conftest import ServerThread, serving
from tests.service.test_http import PROMPT, _get, _post


def test_bearer_token_is_required_except_for_exempt_health(engine):
    with serving(engine, http_port=0, auth_token="s3cret", health_without_auth=True) as server:
        status, error = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 401 and "missing" in error["error"]["message"]
        status, error = _post(
            server, "/tokenize", {"prompt": PROMPT}, {"Authorization": "Bearer wrong"}
        )
        assert status == 401 and "wrong" in error["error"]["message"]
        assert _get(server, "/metrics")[0] == 401
        assert _get(server, "/health")[0] == 200
        good = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="s3cret"
        )
        got = good.completions.create(model="any", prompt=PROMPT, max_tokens=3, temperature=0)
        assert got.usage.completion_tokens == 3


def test_503_while_warming_up_then_serving_http_alone(engine):
    release = threading.Event()
    built = []

    def warm_up():
        release.wait(30)
        built.append(AsyncEngine(engine=engine))
        return built[0]

    server = ServerThread(warm_up, grpc=False, http_port=0)
    try:
        assert server.server.port is None  # no gRPC port was opened
        assert _get(server, "/health")[0] == 503
        status, error = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 503 and "warming up" in error["error"]["message"]
        for path in ("/v1/models", "/v1/models/stories260k"):  # no engine yet to describe
            status, text = _get(server, path)
            assert status == 503 and "warming up" in strict_json.loads(text)["error"]["message"]
        status, error = _post(server, "/tokenize", {"prompt": PROMPT})
        assert status == 503
        release.set()
        server.call(server.server.wait_ready())
        assert _get(server, "/health")[0] == 200
        status, body = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        assert strict_json.loads(_get(server, "/v1/models")[1])["data"][0]["id"] == "stories260k"
        assert 'jaxserve_http_requests_total{code="500"' not in _get(server, "/metrics")[1]
    finally:
        release.set()
        server.stop()
    assert not built[0].is_alive


def _time_wait_on(port: int) -> int:
    """How many TCP sockets in TIME_WAIT have `port` as their local port (Linux's
    /proc/net/tcp and tcp6; their fourth column is the state, 06 being TIME_WAIT)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = pathlib.Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            count += state == "06" and int(local.rsplit(":", 1)[1], 16) == port
    return count


def test_restarted_server_takes_back_the_http_port_its_predecessor_served_on(engine):
    clients = []
    with serving(engine, http_port=0) as first:
        port = first.server.http_port
        for _ in range(4):  # kept alive, idle: the server closes them as it stops
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/health")
            response = conn.getresponse()
            assert response.status == 200 and response.read()
            clients.append(conn)
    for conn in clients:
        conn.close()
    if pathlib.Path("/proc/net/tcp").exists():
        # What made a restart fail for a minute without SO_REUSEADDR: the server closed those
        # connections, so its side of each waits in TIME_WAIT on the port.
        assert _time_wait_on(port) > 0, f"no connection of port {port} is in TIME_WAIT"
    with serving(engine, http_port=port) as second:  # at once, as a supervisor restarts it
        assert second.server.http_port == port
        status, body = _post(second, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2


def _never_built() -> AsyncEngine:
    raise AssertionError("a server whose port is taken must not load a model")


@pytest.mark.parametrize("front", ["http", "grpc"])
def test_a_port_a_live_server_listens_on_is_refused(engine, front):
    with serving(engine, http_port=0) as live:
        if front == "http":
            options = ServerOptions(grpc=False, http_port=live.server.http_port, metrics_port=None)
            expected = f"Cannot serve HTTP on 127.0.0.1:{live.server.http_port}"
        else:
            options = ServerOptions(port=live.server.port, metrics_port=None)
            expected = f"Cannot listen on 127.0.0.1:{live.server.port}"
        with pytest.raises(ServeError, match=expected):
            asyncio.run(JaxServeServer(_never_built, options).start())
        # The live server keeps its port and serves on.
        assert _post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})[0] == 200
