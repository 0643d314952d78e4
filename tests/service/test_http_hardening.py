"""The HTTP front end under inputs a careless or hostile client sends (issue 29), through real
sockets on 127.0.0.1: the official `openai` client where it fits, raw HTTP for the rest.

Every bad input answers a 4xx with OpenAI's error object, never a 500 (a 500 is a server bug:
each test checks `jaxserve_http_requests_total{code="500"}` stays 0); a 10 MB body of any shape
does not stall another client's stream; an oversized body is refused before it is read.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import itertools
import json
import logging
import re
import socket
import threading
import time

import grpc
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.service import strict_json
from tests.service.conftest import serving, wait_until
from tests.service.test_http import PROMPT, _get, _post

STREAM = dict(max_tokens=240, temperature=0.0, ignore_eos=True)


def _calls(server, code: str, route: str | None = None) -> float:
    """jaxserve_http_requests_total for a code (all routes, or one)."""
    text = _get(server, "/metrics")[1]
    total = 0.0
    for line in text.splitlines():
        m = re.match(r'jaxserve_http_requests_total\{code="(\d+)",route="(\w+)"\} (\S+)', line)
        if m and m.group(1) == code and route in (None, m.group(2)):
            total += float(m.group(3))
    return total


def assert_no_500(server) -> None:
    assert _calls(server, "500") == 0, "a client's input made the server answer 500"


def _raw(server, method: str, path: str, body: bytes = b"", headers=None):
    """(status, headers, parsed JSON body) of one raw request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=60)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        data = response.read()
        return (
            response.status,
            dict(response.getheaders()),
            strict_json.loads(data) if data else None,
        )
    finally:
        conn.close()


# ---- 1: size limit, and large bodies parsed off the event loop --------------------------


def _ten_megabyte_bodies() -> list[tuple[str, bytes]]:
    """(path, body) of ~10 MB of each shape that stalled the loop: a huge logit_bias, ~330k
    chat messages, a long token-id prompt."""
    bias = {"prompt": PROMPT, "max_tokens": 2, "logit_bias": {str(i): 1 for i in range(870_000)}}
    chat = {"messages": [{"role": "user", "content": "a"}] * 330_000, "max_tokens": 2}
    ids = {"prompt": [1, 403, 407, 261, 378] * 400_000, "max_tokens": 2}
    return [
        ("/v1/completions", json.dumps(bias, separators=(",", ":")).encode()),
        ("/v1/chat/completions", json.dumps(chat).encode()),
        ("/v1/completions", json.dumps(ids).encode()),
    ]


def _refusal_of_declared_size(port: int, size: int) -> tuple[float, bytes]:
    """Seconds from sending only the headers of a body of `size` bytes to the response, and
    the response: the server must answer without reading the body (it is never sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        start = time.perf_counter()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % size
        )
        response = sock.recv(65536)
        took = time.perf_counter() - start
        while b"\r\n\r\n" not in response:
            response += sock.recv(65536)
        length = re.search(rb"content-length: (\d+)", response.lower())
        while len(response.partition(b"\r\n\r\n")[2]) < int(length.group(1)):
            response += sock.recv(65536)
        return took, response


def test_ten_megabyte_bodies_do_not_stall_another_stream_and_oversized_ones_get_413(server):
    """While 10 MB bodies of each shape arrive back to back, another client's stream keeps
    flowing, and a body declared beyond the limit is refused with 413 at once.

    Parsed on the event loop, a body stalls every stream for as long as it takes to parse
    (0.25-1.5 s idle), so the stream's third-largest gap is about the third-longest answer to a
    body (0.68-0.94 s against 0.94-1.2 s at load ~12). Parsed off the loop, the gaps have
    nothing to do with the bodies (0.35 s against 1.6 s with two busy loops beside the test,
    load ~15, where one gap was 0.79 s and three passed 0.3 s). Both scale with the load, so
    the bound is relative, measured in the same run: the third-largest gap (two OS stalls
    allowed) under half the third-longest answer, or under 0.3 s (issue 29's acceptance) where
    parsing is that quick. The 413s: the median under 0.1 s (an OS stall hits single ones),
    every one under 1.5 s (a server that reads the body first never answers: it is never
    sent)."""
    port = server.server.http_port
    limit = 16 << 20
    bodies = _ten_megabyte_bodies()
    assert all(9e6 < len(b) < 14e6 for _, b in bodies)
    stop = threading.Event()
    answers: list[tuple[str, int]] = []
    refusals: list[float] = []
    answered_in: list[float] = []  # seconds from sending a body to its answer

    def flood():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for path, data in itertools.cycle(bodies):
            if stop.is_set():
                break
            start = time.perf_counter()
            conn.request("POST", path, data, {"Content-Type": "application/json"})
            response = conn.getresponse()
            answered_in.append(time.perf_counter() - start)
            answers.append((path, response.status))
            response.read()
            took, reply = _refusal_of_declared_size(port, limit + 1)
            assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
            refusals.append(took)
        conn.close()

    client = server.openai()
    gaps: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        flooding = pool.submit(flood)
        try:
            deadline = time.monotonic() + 300
            # Streams back to back until the flood has sent every shape twice.
            while len(answers) < 2 * len(bodies) and time.monotonic() < deadline:
                arrivals = [time.perf_counter()]
                for _ in client.completions.create(
                    model="any",
                    prompt=PROMPT,
                    stream=True,
                    max_tokens=STREAM["max_tokens"],
                    temperature=0,
                    extra_body={"ignore_eos": True},
                ):
                    arrivals.append(time.perf_counter())
                gaps += [b - a for a, b in itertools.pairwise(arrivals[1:])]
                assert not flooding.done(), flooding.exception()
        finally:
            stop.set()
            flooding.result()
    assert len(answers) >= 2 * len(bodies), "the flood must overlap the streams"
    assert all(status == 400 for _, status in answers), answers  # too many values, refused
    largest, answer_s = sorted(gaps)[-3:], sorted(answered_in)[-3]
    assert largest[0] < max(0.3, answer_s / 2), (
        f"largest gaps {largest} s among {len(gaps)}; bodies answered in {answered_in} s"
    )
    slowest = sorted(refusals)
    assert slowest[len(slowest) // 2] < 0.1, f"413 took {slowest} s"
    assert slowest[-1] < 1.5, f"413 took {slowest} s"
    assert_no_500(server)


def test_a_body_over_the_limit_is_413_by_its_header_or_as_it_streams(engine):
    limit = 1 << 20
    with serving(engine, http_port=0, max_message_bytes=limit) as server:
        port = server.server.http_port
        took, reply = _refusal_of_declared_size(port, limit + 1)
        status_line, _, rest = reply.partition(b"\r\n")
        # The reason phrase is Python's: "Request Entity Too Large" to 3.12, "Content Too Large"
        # (RFC 9110) from 3.13.
        assert status_line.startswith(b"HTTP/1.1 413 ") and took < 1.0, status_line
        error = strict_json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "request_too_large"
        assert f"has {limit + 1} bytes (its Content-Length)" in error["message"]
        assert f"at most {limit} bytes (--max-message-bytes)" in error["message"]
        # No Content-Length (chunked): counted as it arrives, refused once past the limit.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        chunks = [b" " * (256 << 10)] * (4 * limit // (256 << 10))
        # The server may answer and close while more is on its way.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.request("POST", "/tokenize", iter(chunks), encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 413
        assert (
            f"has more than {limit} bytes" in strict_json.loads(response.read())["error"]["message"]
        )
        conn.close()
        # Just under the limit is read and judged as usual; gRPC has the same limit.
        status, body = _post(server, "/tokenize", b'{"prompt": "Once"}' + b" " * (limit - 100))
        assert status == 200 and body["count"] == 2
        with server.client() as c, pytest.raises(grpc.RpcError) as err:
            c.tokenize("x" * (limit + 10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"at most {limit}" in err.value.details()
        assert _calls(server, "413") == 2
        assert_no_500(server)


# ---- 2, 3, 4, 9, 11: bad values are 400s ---------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("opener", [b"[", b'{"a":'])
def test_100000_nested_brackets_are_a_400(server, path, opener):
    status, _, body = _raw(server, "POST", path, opener * 100_000)
    assert status == 400, body
    assert "more than 32 levels deep" in body["error"]["message"]
    assert_no_500(server)


def test_a_lone_surrogate_is_a_400_naming_the_field(server):
    for path, data, param, named in [
        ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt", "prompt='\\ud800'"),
        ("/v1/completions", b'{"prompt": ["ok", "a\\udfffb"]}', "prompt", "prompt[1]="),
        ("/tokenize", b'{"prompt": "x\\uDBFF"}', "prompt", "prompt='x\\udbff'"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages",
            "messages[0].content=",
        ),
        ("/v1/completions", b'{"prompt": "ok", "stop": ["\\ud800"]}', "stop", "stop[0]="),
    ]:
        status, _, body = _raw(server, "POST", path, data)
        assert status == 400, body
        error = body["error"]
        assert error["param"] == param and named in error["message"], error
        assert "lone surrogate" in error["message"]
    assert_no_500(server)


def test_a_seed_out_of_range_is_a_400_with_n_above_1_too(server, client):
    for seed in (-1, 2**32 + 5):
        for n in (1, 2):
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model="any", prompt=PROMPT, n=n, seed=seed)
            assert err.value.body["param"] == "seed" and f"seed={seed}" in err.value.message
    got = client.completions.create(model="any", prompt=PROMPT, n=2, seed=2**32 - 1, max_tokens=2)
    assert len(got.choices) == 2
    assert_no_500(server)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", True),
        ("max_tokens", 2.5),
        ("max_tokens", 2.0),
        ("max_tokens", "5"),
        ("n", True),
        ("seed", 1.0),
        ("top_k", False),
        ("logprobs", True),
        ("temperature", True),
        ("stream", "yes"),
        ("stream", 1),
        ("echo", 0),
    ],
)
def test_a_boolean_float_or_string_where_an_integer_belongs_is_a_400(server, field, value):
    status, _, body = _raw(
        server, "POST", "/v1/completions", json.dumps({"prompt": PROMPT, field: value}).encode()
    )
    assert status == 400, body
    assert body["error"]["param"] == field
    assert f"{field}={value!r} is not valid" in body["error"]["message"]
    assert_no_500(server)


# Values every earlier check let through that break the device step or the beam ranking: a
# temperature float32 reads as inf (1e300) or 0 (1e-300), a repetition penalty it reads as 0,
# a length penalty whose power overflows Python's float once a beam has two tokens.
_UNSOUND = [
    ("temperature", 1e300, {}),
    ("temperature", 1e-300, {}),
    ("repetition_penalty", 1e-300, {}),
    ("length_penalty", 1000.0, {"use_beam_search": True, "best_of": 2, "temperature": 0}),
    ("length_penalty", -1e300, {"use_beam_search": True, "best_of": 2, "temperature": 0}),
]


@pytest.mark.parametrize("field,value,extra", _UNSOUND)
def test_values_the_device_cannot_take_are_400_and_invalid_argument(server, field, value, extra):
    status, _, body = _raw(
        server,
        "POST",
        "/v1/completions",
        json.dumps({"prompt": PROMPT, "max_tokens": 4, field: value, **extra}).encode(),
    )
    assert status == 400, body
    assert body["error"]["param"] == field
    assert f"{field}={value!r} must be" in body["error"]["message"]
    grpc_extra = {"beam_width": 2, "temperature": 0} if extra else {}
    with server.client() as c, pytest.raises(grpc.RpcError) as err:
        c.generate_unary(PROMPT, max_tokens=4, **{field: value}, **grpc_extra)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field}={value!r} must be" in err.value.details()
    assert server.server.engine.is_alive
    assert_no_500(server)


def test_priority_is_bounded_and_clients_may_only_lower_it_by_default(server, client, engine):
    got = client.completions.create(
        model="any", prompt=PROMPT, max_tokens=2, extra_body={"priority": 2**31 - 1}
    )
    assert got.usage.completion_tokens == 2
    for value in (-1, -(2**31), 2**31, 10**30):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(
                model="any", prompt=PROMPT, max_tokens=2, extra_body={"priority": value}
            )
        assert err.value.body["param"] == "priority"
        assert f"priority={value} must be in [0, {2**31 - 1}]" in err.value.message
        assert ("--clients-may-raise-priority" in err.value.message) == (value < 0)
    with server.client() as c, pytest.raises(grpc.RpcError) as grpc_err:
        c.generate_unary(PROMPT, max_tokens=2, priority=-3)
    assert grpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority=-3 must be in [0, 2147483647]" in grpc_err.value.details()
    assert "--clients-may-raise-priority" in grpc_err.value.details()
    assert_no_500(server)


def test_the_operator_may_let_clients_raise_priority(engine):
    with serving(engine, http_port=0, clients_may_raise_priority=True) as server:
        got = server.openai().completions.create(
            model="any", prompt=PROMPT, max_tokens=2, extra_body={"priority": -(2**31)}
        )
        assert got.usage.completion_tokens == 2
        with server.client() as c:
            assert len(c.generate_unary(PROMPT, max_tokens=2, priority=-5).token_ids) == 2
        status, _, body = _raw(
            server,
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "a", "priority": -(2**31) - 1}).encode(),
        )
        assert status == 400 and f"must be in [{-(2**31)}, {2**31 - 1}]" in body["error"]["message"]
        assert_no_500(server)


# Every field a body may carry, with any JSON value: each call must answer 200 or 400, and the
# server must serve on (a top_k of 10**30 raised OverflowError on the engine thread, and the
# engine died with it).
_FIELDS = [
    "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed", "presence_penalty",
    "frequency_penalty", "logit_bias", "user", "top_k", "min_p", "repetition_penalty",
    "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens", "priority",
    "use_beam_search", "best_of", "length_penalty", "early_stopping", "echo", "logprobs",
    "suffix", "model", "stream_options", "logprobs_mode",
]  # fmt: skip
_EDGES = [0, -1, 1, 2**31 - 1, 2**31, -(2**31) - 1, 2**32, 2**63, 10**30, -(10**30)]
_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(_EDGES),
        st.integers(-5, 600),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)


def _post_any(port: int, path: str, fields: dict) -> tuple[dict, int, bytes]:
    body = {"max_tokens": 4, **fields}
    if path == "/v1/completions":
        body.setdefault("prompt", PROMPT)
    else:
        body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return body, response.status, response.read()
    finally:
        conn.close()


def test_every_field_at_its_edges_is_200_or_400_and_the_engine_lives_on(server):
    port = server.server.http_port
    odd = [None, True, 2.5, "x", [], {}, float("nan"), float("inf")]
    for field in _FIELDS:
        for value in _EDGES + odd:
            body, status, data = _post_any(port, "/v1/completions", {field: value})
            assert status in (200, 400), (body, status, data[:300])
    assert server.server.engine.is_alive
    assert_no_500(server)


def test_any_values_in_any_fields_are_200_or_400_and_the_engine_lives_on(server):
    port = server.server.http_port
    statuses = []

    @settings(
        max_examples=100,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        fields=st.dictionaries(st.sampled_from(_FIELDS), _values, min_size=1, max_size=3),
        path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    )
    def one(fields, path):
        body, status, data = _post_any(port, path, fields)
        assert status in (200, 400), (body, status, data[:300])
        statuses.append(status)

    one()
    assert statuses.count(400) >= 30, statuses  # the values reached the checks
    assert server.server.engine.is_alive
    got = server.openai().completions.create(model="any", prompt=PROMPT, max_tokens=3)
    assert got.usage.completion_tokens == 3
    assert_no_500(server)


# ---- 7: a client that hangs up mid-upload is the client's doing -----------------------------


def test_a_client_hanging_up_mid_upload_counts_as_499_without_an_error_log(server, caplog):
    before = _calls(server, "499", "completions")
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        with socket.create_connection(("127.0.0.1", server.server.http_port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100000\r\n\r\n{"prompt": "Once upon'
            )
            time.sleep(0.2)  # the handler is reading the body
        wait_until(lambda: _calls(server, "499", "completions") == before + 1)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert_no_500(server)


# ---- 9: what the official client expects of the API -----------------------------------------


def test_models_retrieve_404_405_and_the_model_named_by_its_id(server, client, engine):
    model = client.models.retrieve("stories260k")
    assert model.id == "stories260k" and model.object == "model"
    assert [m.id for m in client.models.list()] == ["stories260k"]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found"
    assert "'gpt-4o' does not exist" in err.value.message
    for method, path, status in [
        ("GET", "/v1/nothing", 404),
        ("POST", "/v2/completions", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/v1/models", 405),
    ]:
        got, _, body = _raw(server, method, path)
        assert got == status, body
        assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error"
        assert path in body["error"]["message"]
    # An error that names the model names it by its id, never by the server's path to it.
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}])
    assert "Model stories260k has no chat template" in err.value.message
    path = server.server.engine.info.model
    assert "/" in path
    for url in ("/v1/models", "/v1/models/stories260k"):
        assert path not in _get(server, url)[1]
    assert_no_500(server)


# ---- 8: a drain whose grace period ends with calls still waiting ----------------------------


def _stream_lines(port: int, body: dict):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    return conn, response


def test_calls_cut_by_the_end_of_a_drain_get_503_and_streams_an_error_event(engine, monkeypatch):
    # Each step slowed by 10 ms, so the held streams' 240 tokens (>= 2.4 s) outlast the 0.3 s
    # grace on any CPU: unslowed, a fast machine finished them first and nothing was cut.
    real_step = engine.step_updates

    def slow_step():
        time.sleep(0.01)
        return real_step()

    monkeypatch.setattr(engine, "step_updates", slow_step)
    with serving(engine, http_port=0) as server:
        port = server.server.http_port
        async_engine = server.server.engine
        # 8 streams hold the 8 slots; 3 more calls wait for one.
        streams = [
            _stream_lines(port, {"prompt": PROMPT, "stream": True, **STREAM}) for _ in range(8)
        ]
        for _, response in streams:
            assert response.readline().startswith(b"data: ")
        body = json.dumps({"prompt": PROMPT, **STREAM}).encode()
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            waiting = [pool.submit(_raw, server, "POST", "/v1/completions", body) for _ in range(3)]
            wait_until(lambda: async_engine.snapshot().num_waiting == 3, timeout=30)
            server.call(server.server.stop(0.3))
            answers = [w.result(timeout=30) for w in waiting]
        for status, headers, body in answers:
            assert status == 503, (status, body)
            assert headers["content-type"] == "application/json"
            assert body["error"]["type"] == "service_unavailable"
            assert "grace period (0.3 s) ended" in body["error"]["message"]
        for conn, response in streams:
            events = [line for line in response.read().split(b"\n") if line.startswith(b"data: ")]
            last = strict_json.loads(events[-1][len(b"data: ") :])
            assert last["error"]["type"] == "service_unavailable", events[-3:]
            assert b"data: [DONE]" not in events
            conn.close()
