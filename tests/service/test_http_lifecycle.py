"""HTTP API server states: bearer tokens (401), warm-up (503 on every route), HTTP alone
(--no-grpc).

Each test runs its own server over the session's engine (servers are cheap; only compiling is
not), with no other server alive (one AsyncEngine per engine at a time).
"""

from __future__ import annotations

import json
import threading

import openai

from jaxserve.engine.async_engine import AsyncEngine
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
            assert status == 503 and "warming up" in json.loads(text)["error"]["message"]
        status, error = _post(server, "/tokenize", {"prompt": PROMPT})
        assert status == 503
        release.set()
        server.call(server.server.wait_ready())
        assert _get(server, "/health")[0] == 200
        status, body = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        assert json.loads(_get(server, "/v1/models")[1])["data"][0]["id"] == "stories260k"
        assert 'jaxserve_http_requests_total{code="500"' not in _get(server, "/metrics")[1]
    finally:
        release.set()
        server.stop()
    assert not built[0].is_alive
