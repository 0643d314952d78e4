"""OpenTelemetry tracing (`serve --otlp-traces-endpoint`, service/tracing.py, docs/tracing.md).

In-process servers hand their spans to the SDK's InMemorySpanExporter (the server's
`tracer_provider` hook): one SERVER span per generation call over HTTP (completions, a chat
stream) and gRPC, with the GenAI attributes and the request's own latencies, a child of the
caller's `traceparent`. Real `jaxserve serve` processes check the OTLP/gRPC path end to end
against a TraceService receiver in this test (spans flushed on SIGTERM), that a bad URL is
refused at start, and that without the flag nothing is sent and no OpenTelemetry SDK loaded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading

import grpc
import httpx2
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from service.grpc.client import JaxServeClient, make_request
from service.server import JaxServeServer, ServeError, ServerOptions
from tests.service.conftest import SMALL_FLAGS, serving, wait_until
from tests.service.test_http import CHAT_TEMPLATE
from tests.service.test_sigterm import _next_log, _read_logs

PROMPT = "Once upon a time"
LATENCIES = (
    "gen_ai.latency.time_in_queue",
    "gen_ai.latency.time_to_first_token",
    "gen_ai.latency.e2e",
    "gen_ai.latency.time_in_model_prefill",
    "gen_ai.latency.time_in_model_decode",
    "gen_ai.latency.time_in_model_inference",
)
# A caller's span: W3C trace context, version 00, sampled.
TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"


@pytest.fixture(scope="module")
def traced(engine):
    """A server (gRPC and HTTP) whose spans go to an in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with serving(
        engine, http_port=0, chat_template=CHAT_TEMPLATE, tracer_provider=provider
    ) as handle:
        yield handle, exporter


@pytest.fixture
def spans(traced):
    """The module's server and a function that waits for its next `count` finished spans."""
    server, exporter = traced
    exporter.clear()

    def finished(count: int = 1) -> list:
        # A streamed call's span ends just after its last event went out: wait for it.
        wait_until(lambda: len(exporter.get_finished_spans()) >= count)
        return list(exporter.get_finished_spans())

    return server, finished


def _check_latencies(span, attrs) -> None:
    """The request's own timings: ordered, adding up, and within the span."""
    queue_s, ttft, e2e, prefill, decode, inference = (attrs[name] for name in LATENCIES)
    assert 0 <= queue_s <= ttft <= e2e
    assert prefill > 0 and decode > 0  # a step for the prompt, more for the tokens after it
    assert inference == pytest.approx(prefill + decode, abs=1e-6)
    assert e2e == pytest.approx(queue_s + inference, abs=1e-6)
    assert ttft == pytest.approx(queue_s + prefill, abs=1e-6)
    assert e2e <= (span.end_time - span.start_time) / 1e9  # the call holds the request


def _check_genai(span, operation: str, model: str) -> dict:
    attrs = dict(span.attributes)
    assert span.kind is SpanKind.SERVER
    assert span.name == f"{operation} {model}"
    assert attrs["gen_ai.operation.name"] == operation
    assert attrs["gen_ai.provider.name"] == attrs["gen_ai.system"] == "jaxserve"
    assert attrs["gen_ai.request.model"] == model
    assert attrs["gen_ai.response.model"] == model
    return attrs


def test_an_http_completion_is_one_server_span_with_genai_attributes(spans):
    server, finished = spans
    client = server.openai()
    model = client.models.list().data[0].id
    response = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=7,
        temperature=0.7,
        top_p=0.9,
        n=2,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    (span,) = finished()
    attrs = _check_genai(span, "text_completion", model)
    assert span.status.status_code is StatusCode.UNSET  # not an error
    assert span.parent is None  # no traceparent sent: a root span
    assert attrs["gen_ai.request.max_tokens"] == 7
    assert attrs["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attrs["gen_ai.request.n"] == 2
    assert attrs["gen_ai.request.seed"] == 11
    assert attrs["gen_ai.response.id"] == response.id
    assert attrs["gen_ai.response.finish_reasons"] == ("length", "length")
    # The response's usage: the prompt once for its two samples, both samples' tokens.
    assert attrs["gen_ai.usage.input_tokens"] == response.usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == response.usage.completion_tokens == 14
    assert attrs["http.response.status_code"] == 200
    _check_latencies(span, attrs)


def test_a_chat_stream_is_one_span_ended_with_the_stream(spans):
    server, finished = spans
    client = server.openai()
    chunks = list(
        client.chat.completions.create(
            model="any-name",
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=9,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    (span,) = finished()
    model = chunks[0].model
    attrs = dict(span.attributes)
    assert attrs["gen_ai.request.model"] == "any-name"  # what the call asked for
    assert span.name == "chat any-name"
    assert attrs["gen_ai.response.model"] == model
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.response.id"] == chunks[0].id
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    usage = chunks[-1].usage
    assert attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == usage.completion_tokens == 9
    _check_latencies(span, attrs)


def test_a_grpc_generation_span_carries_the_requests_own_timings(spans):
    server, finished = spans
    with server.client() as c:
        responses = list(c.generate(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True))
    (span,) = finished()
    last = responses[-1]
    attrs = _check_genai(span, "text_completion", "stories260k")
    assert attrs["gen_ai.response.id"] == last.request_id
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["gen_ai.usage.input_tokens"] == last.usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == last.usage.completion_tokens == 6
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
    # The same clock readings the call's last response reports.
    t = last.timings
    assert attrs["gen_ai.latency.time_in_queue"] == pytest.approx(t.queue_wait_s, abs=1e-9)
    assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(t.ttft_s, abs=1e-9)
    assert attrs["gen_ai.latency.e2e"] == pytest.approx(t.e2e_s, abs=1e-9)
    _check_latencies(span, attrs)


def test_failed_calls_end_their_span_with_error_and_the_message(spans):
    server, finished = spans
    response = httpx2.post(
        f"http://127.0.0.1:{server.server.http_port}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4, "temperature": -1},
    )
    assert response.status_code == 400
    with server.client() as c:
        call = c.generate(PROMPT, max_tokens=200, temperature=0.0, ignore_eos=True)
        next(call)
        call.cancel()
        (http_span, grpc_span) = sorted(finished(2), key=lambda s: s.start_time)
    assert http_span.status.status_code is StatusCode.ERROR
    assert http_span.status.description == response.json()["error"]["message"]
    assert http_span.attributes["http.response.status_code"] == 400
    assert http_span.attributes["error.type"] == "400"
    assert grpc_span.status.status_code is StatusCode.ERROR
    assert "cancelled" in grpc_span.status.description
    assert grpc_span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert grpc_span.attributes["error.type"] == "CANCELLED"


def _check_child(span) -> None:
    assert span.context.trace_id == TRACE_ID  # the caller's trace
    assert span.parent is not None and span.parent.is_remote
    assert span.parent.span_id == PARENT_ID  # the caller's span is the parent
    assert span.context.span_id != PARENT_ID
    assert span.context.trace_state.get("caller") == "t61rcWkgMzE"  # tracestate carried


def test_traceparent_makes_the_span_a_child_of_the_callers_over_http_and_grpc(spans):
    server, finished = spans
    headers = {"traceparent": TRACEPARENT, "tracestate": "caller=t61rcWkgMzE"}
    response = httpx2.post(
        f"http://127.0.0.1:{server.server.http_port}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 3},
        headers=headers,
    )
    assert response.status_code == 200
    (http_span,) = finished()
    _check_child(http_span)
    with server.client() as c:
        request = make_request(PROMPT, max_tokens=3)
        list(c.stub.Generate(request, metadata=list(headers.items())))
    grpc_span = next(s for s in finished(2) if s is not http_span)
    _check_child(grpc_span)


def _finished(reason, prompt, tokens, times, error=None):
    from jaxserve.outputs import RequestMetrics, RequestOutput

    return RequestOutput(
        request_id="r",
        new_token_ids=[],
        text_delta="",
        finished=True,
        finish_reason=reason,
        num_prompt_tokens=prompt,
        num_output_tokens=tokens,
        metrics=RequestMetrics(*times),
        error=error,
    )


def test_a_call_of_several_choices_sums_them_shows_the_last_slowest_and_an_engine_failure(
    caplog,
):
    """CallSpan with no server behind it: tokens summed (or as the front end counts them),
    the latencies of the slowest choice (of equals, the last), a reason for each choice, and a
    request the engine failed makes the span an ERROR even when the call answered."""
    from jaxserve.sampling_params import SamplingParams
    from service.tracing import RequestTracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider)
    span = tracer.start("text_completion", {})
    span.request(model="m", params=SamplingParams(max_tokens=8, top_k=0))
    span.output(_finished("length", 5, 8, (10.0, 10.5, 11.0, 12.0)))
    span.output(_finished("error", 5, 3, (10.0, 10.2, 10.4, 12.0)), output_tokens=2)
    span.output(_finished(None, 5, 1, (10.0, None, None, 11.0)), input_tokens=0)
    span.end()
    with caplog.at_level("WARNING", logger="opentelemetry"):
        span.end()  # once: the ended span is not touched again (the SDK would warn)
    assert not caplog.records
    (s,) = exporter.get_finished_spans()
    a = s.attributes
    assert s.name == "text_completion m" and s.instrumentation_scope.name == "jaxserve.service"
    assert a["gen_ai.request.n"] == 1 and a["gen_ai.request.max_tokens"] == 8
    assert "gen_ai.request.top_k" not in a  # 0: off
    assert a["gen_ai.response.finish_reasons"] == ("length", "error", "unknown")
    assert a["gen_ai.usage.input_tokens"] == 10 and a["gen_ai.usage.output_tokens"] == 11
    # The second choice's: as slow as the first, finished after it.
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(0.2)
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(0.4)
    assert a["gen_ai.latency.e2e"] == pytest.approx(2.0)
    assert s.status.status_code == StatusCode.ERROR and a["error.type"] == "finish_reason_error"
    assert s.status.description == "The engine failed the request."

    # A choice of unknown e2e (not finished in time) never stands for the call; top_k shown.
    span = tracer.start("chat", {})
    span.request(model="m", params=SamplingParams(max_tokens=4, top_k=5), n=2)
    span.output(_finished("stop", 3, 2, (10.0, 10.1, 10.2, 10.5)))
    span.output(_finished("error", 3, 0, (10.0, None, None, None), error="boom"))
    span.end()
    s = exporter.get_finished_spans()[-1]
    assert s.attributes["gen_ai.request.top_k"] == 5 and s.attributes["gen_ai.request.n"] == 2
    assert s.attributes["gen_ai.latency.e2e"] == pytest.approx(0.5)
    assert s.status.description == "boom"
    # A call that failed: its error's class, "error" unless the front end names one; a span
    # never told what was asked keeps the operation's name.
    tracer.start("chat", {}).end("cancelled")
    s = exporter.get_finished_spans()[-1]
    assert s.name == "chat" and s.attributes["error.type"] == "error"
    assert s.status.description == "cancelled"
    # A provider the caller owns is flushed, not shut down: its spans keep being exported.
    tracer.shutdown()
    tracer.start("chat", {}).end()
    assert len(exporter.get_finished_spans()) == 4
    # One built here (to_collector's) is shut down: nothing is exported after it.
    owned = RequestTracer(provider, owns_provider=True)
    owned.shutdown()
    owned.start("chat", {}).end()
    assert len(exporter.get_finished_spans()) == 4


def test_a_bad_endpoint_is_refused_with_a_sentence_showing_it():
    bad_ones = ["127.0.0.1:4317", "grpc://127.0.0.1:4317", "http://:4317", "http://host"]
    # a port that is no number or out of range, a path, a query, a fragment
    bad_ones += ["http://h:43x7", "http://h:70000", "http://h:4317/v1", "http://h:4317?a=1"]
    bad_ones += ["http://h:4317#f"]
    for bad in bad_ones:
        with pytest.raises(ValueError, match="is not an OTLP/gRPC collector's address") as e:
            ServerOptions(otlp_traces_endpoint=bad)
        assert str(e.value) == (
            f"otlp_traces_endpoint (--otlp-traces-endpoint) {bad!r} is not an OTLP/gRPC "
            "collector's address: give http://HOST:PORT (https:// for TLS), e.g. "
            "http://127.0.0.1:4317."
        )
    ServerOptions(otlp_traces_endpoint="https://collector.example:4317")  # TLS is fine
    ServerOptions(otlp_traces_endpoint="http://collector.example:4317/")  # and a bare /
    cli = [sys.executable, "-m", "jaxserve.cli", "serve", "--otlp-traces-endpoint", "localhost"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--otlp-traces-endpoint) 'localhost' is not an OTLP/gRPC collector's address" in (
        done.stderr
    )


def test_without_the_sdk_the_flag_is_refused_at_start_and_the_ports_closed(monkeypatch):
    # As if the `serve` extra were not installed: importing the exporter fails.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    options = ServerOptions(
        port=0, http_port=0, metrics_port=0, otlp_traces_endpoint="http://127.0.0.1:4317"
    )

    async def start() -> JaxServeServer:
        server = JaxServeServer(lambda: pytest.fail("warm-up must not begin"), options)
        with pytest.raises(ServeError, match=r"pip install 'jaxserve\[serve\]'"):
            await server.start()
        return server

    server = asyncio.run(start())
    for port in (server.port, server.http_port):  # closed again: a restart may take them
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


# ---- real processes, a real OTLP/gRPC receiver ----------------------------------------------


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC collector's TraceService, keeping every export it receives."""

    def __init__(self):
        self.requests: queue.Queue = queue.Queue()

    def Export(self, request, context):  # the service's method name
        self.requests.put(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) of every span received so far."""
        out = []
        while not self.requests.empty():
            for rs in self.requests.get().resource_spans:
                resource = _attributes(rs.resource.attributes)
                out += [(resource, s) for ss in rs.scope_spans for s in ss.spans]
        return out


@pytest.fixture
def receiver():
    collector = _Receiver()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, port
    finally:
        server.stop(0)


def _attributes(key_values) -> dict:
    out = {}
    for kv in key_values:
        kind = kv.value.WhichOneof("value")
        value = getattr(kv.value, kind)
        if kind == "array_value":
            value = [getattr(v, v.WhichOneof("value")) for v in value.values]
        out[kv.key] = value
    return out


def _serve(args: list[str], env: dict, module: str = "jaxserve.cli"):
    """A serve process on free ports, its log lines read into a queue; (process, lines,
    listening line) once it serves."""
    cmd = [sys.executable, "-m", module, "serve", "--port=0", "--metrics-port=0", "--http-port=0"]
    proc = subprocess.Popen(
        [*cmd, *SMALL_FLAGS, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_logs, args=(proc.stderr, lines), daemon=True).start()
    listening = _next_log(lines, "listening", timeout=120)
    _next_log(lines, "serving", timeout=300)
    return proc, lines, listening


def _one_call_each(listening: dict) -> None:
    """A gRPC generation (with a caller's traceparent) and an HTTP completion."""
    with JaxServeClient(f"127.0.0.1:{listening['port']}") as c:
        request = make_request(PROMPT, max_tokens=5, temperature=0.0, ignore_eos=True)
        list(c.stub.Generate(request, metadata=[("traceparent", TRACEPARENT)]))
    response = httpx2.post(
        f"http://127.0.0.1:{listening['http_port']}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 4},
        timeout=60,
    )
    assert response.status_code == 200


def _stop(proc) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    return out


def test_spans_reach_an_otlp_collector_and_the_last_are_flushed_on_sigterm(receiver):
    collector, port = receiver
    # No batch is sent on the SDK's timer during the test: what arrives, the shutdown sent.
    env = {"OTEL_BSP_SCHEDULE_DELAY": "600000"}
    proc, _, listening = _serve([f"--otlp-traces-endpoint=http://127.0.0.1:{port}"], env)
    try:
        _one_call_each(listening)
    finally:
        _stop(proc)
    received = collector.spans()
    assert len(received) == 2, [s.name for _, s in received]
    assert all(resource["service.name"] == "jaxserve" for resource, _ in received)
    grpc_span, http_span = sorted((s for _, s in received), key=lambda s: s.start_time_unix_nano)
    for span in (grpc_span, http_span):
        attrs = _attributes(span.attributes)
        assert span.name == "text_completion stories260k"
        assert span.kind == span.SPAN_KIND_SERVER
        assert attrs["gen_ai.provider.name"] == "jaxserve"
        assert attrs["gen_ai.response.finish_reasons"] == ["length"]
        assert attrs["gen_ai.usage.input_tokens"] > 0
        assert 0 < attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    assert _attributes(grpc_span.attributes)["gen_ai.usage.output_tokens"] == 5
    assert _attributes(http_span.attributes)["http.response.status_code"] == 200
    assert grpc_span.trace_id == TRACE_ID.to_bytes(16, "big")
    assert grpc_span.parent_span_id == PARENT_ID.to_bytes(8, "big")


def test_without_the_flag_nothing_is_sent_and_no_opentelemetry_sdk_is_loaded(receiver):
    collector, port = receiver
    # Everything that could point an SDK at the receiver, were one set up behind our back.
    url = f"http://127.0.0.1:{port}"
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": url,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": url,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_BSP_SCHEDULE_DELAY": "1",
    }
    proc, _, listening = _serve([], env, module="tests.service.modules_serve")
    try:
        _one_call_each(listening)
    finally:
        out = _stop(proc)
    loaded = json.loads(out.strip().splitlines()[-1])
    # FastAPI (the HTTP API) may import the OpenTelemetry API itself; beyond what it imports
    # alone, nothing of OpenTelemetry may be loaded, and no tracer provider set.
    baseline = subprocess.run(
        [sys.executable, "-c", _MODULES.format(imports="import fastapi")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    allowed = set(json.loads(baseline.stdout)["modules"])
    assert set(loaded["modules"]) <= allowed, set(loaded["modules"]) - allowed
    assert not any(m.startswith(("opentelemetry.sdk", "opentelemetry.exporter")) for m in allowed)
    assert loaded["tracer_provider"] in (None, "ProxyTracerProvider")
    assert collector.spans() == []
    # Without FastAPI in the way: the server, its gRPC front end, tracing's own module and the
    # command load no OpenTelemetry at all.
    ours = subprocess.run(
        [
            sys.executable,
            "-c",
            _MODULES.format(imports="import service.server, service.tracing, jaxserve.cli.serve"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(ours.stdout)["modules"] == []


# What tests/service/modules_serve.py prints too: the opentelemetry modules a process loaded.
_MODULES = (
    "import json, sys; {imports}; "
    "print(json.dumps({{'modules': sorted(m for m in sys.modules "
    "if m.startswith('opentelemetry'))}}))"
)
