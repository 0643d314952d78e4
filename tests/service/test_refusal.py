"""A request the SLO policy refuses under load (--shed-late) reaches clients as a refusal with
its reason: gRPC RESOURCE_EXHAUSTED, HTTP 429 (streamed or not), never a finished answer.

The session's engine gets the real SLO policy with a cost model that predicts 10 s a step, so
every request misses a 1 s TTFT target before it starts and is refused; the policy is taken
off again after each test, leaving the engine as the other modules expect it.
"""

from __future__ import annotations

import contextlib
import http.client
import json

import grpc
import pytest

from jaxserve.scheduling import slo_policy
from jaxserve.scheduling.cost_model import BucketFit, CostKey, CostModel
from tests.service import strict_json
from tests.service.conftest import serving

PROMPT = "Once upon a time"


@contextlib.contextmanager
def shedding(engine):
    """The engine's scheduler refuses every new request (predicted TTFT 10 s, target 1 s)."""
    buckets = tuple(engine.runner.config.token_buckets)
    key = CostKey(model="fake", dtype="float32", device_kind="cpu", token_buckets=buckets)
    slow = [
        BucketFit(bucket=b, coef=(10.0, 0.0, 0.0), samples=0, shared_slopes=True, rel_rms=None)
        for b in buckets
    ]
    config = engine.config.replace(
        slo_scheduling=True, tpot_slo_s=0.05, ttft_slo_s=1.0, shed_late=True, cost_model="fake"
    )
    policy = slo_policy.attach(engine.scheduler, config, CostModel(key, slow))
    assert policy is not None
    try:
        yield policy
    finally:
        engine.scheduler.budget_policy = None


@pytest.fixture(scope="module")
def server(engine):
    with serving(engine, http_port=0) as handle:
        yield handle


def _check_message(message: str) -> None:
    # The reason names the prediction and the target, with their values.
    assert "Refused under load" in message, message
    assert "predicted time to first token is 10." in message, message
    assert "TTFT target of 1.000 s" in message, message


@pytest.mark.parametrize("unary", [False, True])
def test_grpc_refusal_is_resource_exhausted_with_the_reason(server, engine, unary):
    with shedding(engine) as policy, server.client() as client:
        with pytest.raises(grpc.RpcError) as caught:
            if unary:
                client.generate_unary(PROMPT, max_tokens=8, timeout=30)
            else:
                list(client.generate(PROMPT, max_tokens=8, timeout=30))
        assert policy.num_shed == 1
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    _check_message(caught.value.details())
    assert engine.metrics.stats.finished.get("refused", 0) >= 1


def _post(server, body: dict) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=30)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


@pytest.mark.parametrize("stream", [False, True])
def test_http_refusal_is_429_with_the_reason(server, engine, stream):
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": stream}
    with shedding(engine) as policy:
        status, text = _post(server, body)
        assert policy.num_shed == 1
    # Streamed too: the refusal comes before the first token, so it is the call's status.
    assert status == 429, text
    error = strict_json.loads(text)["error"]
    assert error["type"] == "rate_limit"
    _check_message(error["message"])
    # Without the policy the same request is served.
    status, text = _post(server, {**body, "stream": False})
    finish = strict_json.loads(text)["choices"][0]["finish_reason"]
    assert status == 200 and finish in ("stop", "length")
