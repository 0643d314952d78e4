"""Server states around serving: warm-up, a failed engine, bearer tokens and TLS.

Each test runs its own server over the session's engine (servers are cheap; only compiling
is not), and stops it before the next starts.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import ipaddress
import threading
import time

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from jaxserve.engine.async_engine import AsyncEngine
from service.gen.jaxserve.v1 import jaxserve_pb2 as pb
from service.grpc.client import JaxServeClient
from tests.engine.conftest import drain
from tests.service.conftest import ServerThread, serving, wait_until

GREEDY = dict(max_tokens=8, temperature=0.0)


def test_health_says_serving_only_after_warm_up(engine):
    """Until the factory returns, health is NOT_SERVING and work is refused as UNAVAILABLE."""
    release = threading.Event()
    built = []

    def warm_up():
        release.wait(30)
        built.append(AsyncEngine(engine=engine))
        return built[0]

    server = ServerThread(warm_up)
    try:
        with server.client() as c:
            assert c.health() == "NOT_SERVING"
            assert c.health("jaxserve.v1.JaxServe") == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as err:
                c.generate_unary("Once upon a time", **GREEDY)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "warming up" in err.value.details()
            release.set()
            server.call(server.server.wait_ready())
            assert c.health() == "SERVING"
            assert c.health("jaxserve.v1.JaxServe") == "SERVING"
            assert len(c.generate_unary("Once upon a time", **GREEDY).token_ids) == 8
    finally:
        release.set()
        server.stop()  # the server built the engine, so it shuts it down
    assert not built[0].is_alive


def _once_all_have_a_token(engine, n: int, then):
    """Wraps engine.step_updates (the engine thread's call each iteration): at the first
    iteration at which the engine tracks `n` requests and each has an output token, `then()`
    runs instead of the step (once); otherwise the real step runs. A stream of 200 tokens then
    cannot have ended before the test acts, however slowly a loaded machine runs the test's
    own thread (the engine waits for the event, not for a clock)."""
    real, fired = engine.step_updates, threading.Event()

    def step_updates():
        tracked = list(engine.outputs.tracked.values())
        began = len(tracked) == n and all(t.request.num_output_tokens >= 1 for t in tracked)
        if began and not fired.is_set():
            fired.set()
            then()
        return real()

    engine.step_updates = step_updates
    return fired


def test_engine_failure_ends_every_open_stream_with_internal(engine):
    """A crash of the engine thread fails all open streams at once; health turns NOT_SERVING.

    At once, not at a timeout: each stream has a 60 s deadline and must end INTERNAL with the
    failure's message (a stream the failure never reached would end DEADLINE_EXCEEDED), within
    10 s of the failure (~ms when it works; a loaded machine can stall a thread for a second).
    """
    ids = [f"doomed-{i}" for i in range(4)]
    failed_at = []

    def fail():
        failed_at.append(time.monotonic())
        raise RuntimeError("injected device failure")

    try:
        with serving(engine) as server, server.client() as c:
            _once_all_have_a_token(engine, len(ids), fail)
            calls = [
                c.generate(
                    "Once upon a time",
                    request_id=rid,
                    max_tokens=200,
                    temperature=0.0,
                    ignore_eos=True,
                    timeout=60,
                )
                for rid in ids
            ]
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                ended = list(pool.map(_error_and_time_of, calls))
            for e, _, tokens in ended:
                assert e.code() == grpc.StatusCode.INTERNAL, e
                assert "injected device failure" in e.details()
                assert 1 <= tokens < 200  # it ended mid-stream, by the failure
            assert max(t for _, t, _ in ended) - failed_at[0] < 10.0
            wait_until(lambda: c.health() == "NOT_SERVING", timeout=30)
            with pytest.raises(grpc.RpcError) as err:
                c.generate_unary("Hi", **GREEDY)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            del engine.step_updates
            # The dead thread no longer owns the engine: tidy it for the next server here.
            for rid in ids:
                engine.abort(rid)
            drain(engine)
    finally:
        engine.__dict__.pop("step_updates", None)


def test_engine_shutdown_ends_open_streams_and_leaves_the_engine_idle(engine):
    """AsyncEngine.shutdown() aborts what runs: clients see ABORT, the pages come back.

    The engine waits, with both streams begun, until shutdown has been asked for: a stream
    that finished by itself first (200 tokens) would end LENGTH, not ABORT."""
    async_engine = AsyncEngine(engine=engine)
    server = ServerThread(async_engine)
    paused, release = threading.Event(), threading.Event()

    def pause():
        paused.set()
        assert release.wait(60), "the test never released the engine"

    try:
        with server.client() as c:
            _once_all_have_a_token(engine, 2, pause)
            streams = [
                iter(
                    c.generate(
                        "Once upon a time",
                        max_tokens=200,
                        temperature=0.0,
                        ignore_eos=True,
                        timeout=60,
                    )
                )
                for _ in range(2)
            ]
            for s in streams:
                next(s)
            assert paused.wait(60)
            stopping = threading.Thread(target=async_engine.shutdown)
            stopping.start()  # it asks the engine thread to stop, then joins it
            wait_until(lambda: async_engine._stopping, timeout=30)
            release.set()
            for s in streams:
                assert list(s)[-1].finish_reason == pb.FINISH_REASON_ABORT
            stopping.join(30)
        assert not engine.has_unfinished()
        assert engine.scheduler.num_pages_used == 0
        with server.client() as c:
            wait_until(lambda: c.health() == "NOT_SERVING", timeout=30)
            with pytest.raises(grpc.RpcError) as err:
                c.generate_unary("Hi", **GREEDY)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "shut down" in err.value.details()
    finally:
        release.set()
        engine.__dict__.pop("step_updates", None)
        server.stop()


def _error_and_time_of(stream) -> tuple[grpc.RpcError, float, int]:
    """The error that ended a stream, when it came (time.monotonic()), and the tokens before."""
    tokens = 0
    try:
        for response in stream:
            tokens += len(response.token_ids)
    except grpc.RpcError as e:
        return e, time.monotonic(), tokens
    raise AssertionError("the stream ended without an error")


def test_token_is_required_on_every_call(engine):
    with serving(engine, auth_token="s3cret") as server:
        with server.client() as anonymous, server.client(token="wrong") as wrong:
            for c in (anonymous, wrong):
                for name, call in _every_kind_of_call(c):
                    with pytest.raises(grpc.RpcError) as err:
                        call()
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
                    assert "bearer token" in err.value.details()
        with server.client(token="s3cret") as c:
            assert c.health() == "SERVING"
            assert len(c.generate_unary("Once upon a time", **GREEDY).token_ids) == 8
            assert "jaxserve.v1.JaxServe" in _list_services(c.channel, token="s3cret")


def _every_kind_of_call(c: JaxServeClient):
    """Unary, server-streaming and bidirectional calls over all three services."""
    return [
        ("GenerateUnary", lambda: c.generate_unary("Once upon a time", **GREEDY)),
        ("Generate", lambda: list(c.generate("Once upon a time", **GREEDY))),
        ("GetModelInfo", c.model_info),
        ("Health.Check", c.health),
        ("ServerReflectionInfo", lambda: _list_services(c.channel)),
    ]


def _list_services(channel, token=None) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    md = [("authorization", f"Bearer {token}")] if token else None
    [reply] = stub.ServerReflectionInfo(iter([request]), metadata=md, timeout=10)
    return [s.name for s in reply.list_services_response.service]


def test_tls_with_token(engine, tmp_path):
    cert, key = _self_signed_cert()
    with serving(engine, tls_cert=cert, tls_key=key, auth_token="s3cret") as server:
        with JaxServeClient(server.target, root_certificates=cert, token="s3cret") as c:
            assert len(c.generate_unary("Once upon a time", **GREEDY).token_ids) == 8
        with server.client(token="s3cret") as plain, pytest.raises(grpc.RpcError) as err:
            plain.health(timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def _self_signed_cert() -> tuple[bytes, bytes]:
    """A certificate for 127.0.0.1, valid for a day, and its key (PEM)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return (
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
