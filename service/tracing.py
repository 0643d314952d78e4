"""OpenTelemetry spans of generation calls (`serve --otlp-traces-endpoint`, docs/tracing.md).

Each generation call (HTTP /v1/completions and /v1/chat/completions, streamed or not; gRPC
Generate and GenerateUnary) is one SERVER span, a child of the caller's span when the call
carries W3C `traceparent` / `tracestate` (HTTP headers, gRPC metadata). Its attributes follow
OpenTelemetry's GenAI semantic conventions (`gen_ai.request.*`, `gen_ai.response.*`,
`gen_ai.usage.*`) and vLLM's latency attributes (`gen_ai.latency.*`), read from the requests'
own `RequestMetrics`, so a trace shows where a slow call spent its time: waiting for a slot,
in prefill, in decode.

Off by default, and then free: the front ends record into `NO_SPAN`, which does nothing, and
this module imports nothing from opentelemetry until a `RequestTracer` is built (the SDK and
the OTLP exporter are the `serve` extra).

Concurrency: spans are started, filled and ended on the server's event loop. The OTLP
exporter's BatchSpanProcessor sends them in batches from its own thread, so no call waits on
the collector; the server flushes and shuts it down once its front ends have stopped
(`JaxServeServer.stop`, the SIGTERM path), so the last calls' spans are not lost. Its queue is
bounded (2048 spans by default); beyond it the SDK drops spans rather than hold memory.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.outputs import RequestOutput
    from jaxserve.sampling_params import SamplingParams

PROVIDER = "jaxserve"  # gen_ai.provider.name (and gen_ai.system, its older name)
TRACE_HEADERS = ("traceparent", "tracestate")  # what the W3C propagator reads
# The latencies of vLLM's spans (vllm/tracing.py), in seconds, from RequestMetrics: each is
# (arrival, first scheduled, first token, finished) -> seconds, or None while unknown.
_LATENCIES = {
    "gen_ai.latency.time_in_queue": lambda a, s, f, e: _between(a, s),
    "gen_ai.latency.time_to_first_token": lambda a, s, f, e: _between(a, f),
    "gen_ai.latency.e2e": lambda a, s, f, e: _between(a, e),
    "gen_ai.latency.time_in_model_prefill": lambda a, s, f, e: _between(s, f),
    "gen_ai.latency.time_in_model_decode": lambda a, s, f, e: _between(f, e),
    "gen_ai.latency.time_in_model_inference": lambda a, s, f, e: _between(s, e),
}


def check_endpoint(url: str) -> str:
    """The collector's URL as the OTLP/gRPC exporter takes it (http://HOST:PORT, or https://
    for TLS); ValueError naming the value otherwise, so a typo fails at start, not silently
    at the first export."""
    parsed = urllib.parse.urlsplit(url)
    try:
        port = parsed.port
    except ValueError:  # not a number, or out of range
        port = None
    if (
        parsed.scheme not in ("http", "https")
        or not parsed.hostname
        or port is None
        or parsed.path not in ("", "/")
        or parsed.query
        or parsed.fragment
    ):
        raise ValueError(
            f"otlp_traces_endpoint (--otlp-traces-endpoint) {url!r} is not an OTLP/gRPC "
            "collector's address: give http://HOST:PORT (https:// for TLS), e.g. "
            "http://127.0.0.1:4317."
        )
    return url


class NoSpan:
    """What a call records into while tracing is off: nothing, at the cost of a method call."""

    def request(self, **_) -> None:
        pass

    def response(self, response_id: str, model: str) -> None:
        pass

    def output(self, out: RequestOutput, **_) -> None:
        pass

    def end(self, error: str | None = None, error_type: str = "error", **attributes) -> None:
        pass


NO_SPAN = NoSpan()


class CallSpan(NoSpan):
    """The span of one generation call. The front end names what was asked (`request`) and
    answered (`response`), hands over each request's finished output (`output`: the
    usage and the latencies), and ends it once, with the error if the call failed.

    A call of several choices (`n`, several prompts) sums their tokens and shows the
    latencies of its slowest choice (the last to finish): the call waited for all of them.
    """

    def __init__(self, span, operation: str, status_error):
        self._span = span
        self._operation = operation
        self._status_error = status_error  # StatusCode.ERROR, so this class imports nothing
        self._reasons: list[str] = []
        self._input_tokens = 0
        self._output_tokens = 0
        self._latencies: dict[str, float] = {}
        self._failure: str | None = None  # a request the engine failed alone
        self._ended = False

    def request(
        self, *, model: str, params: SamplingParams | None = None, n: int = 1, **fields
    ) -> None:
        """What the call asked for: the model it named and its sampling parameters (as they
        run: the engine's defaults filled in), or `fields` by name where there are none yet."""
        self._span.update_name(f"{self._operation} {model}")
        values = dict(fields)
        if params is not None:
            values.update(
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k or None,  # 0: off
                seed=params.seed,
            )
        attributes = {"gen_ai.request.model": model, "gen_ai.request.n": n}
        for name, value in values.items():
            if value is not None:
                attributes[f"gen_ai.request.{name}"] = value
        self._span.set_attributes(attributes)

    def response(self, response_id: str, model: str) -> None:
        """The response's id and the model it names."""
        self._span.set_attributes(
            {"gen_ai.response.id": response_id, "gen_ai.response.model": model}
        )

    def output(
        self,
        out: RequestOutput,
        *,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
    ) -> None:
        """A request's finished output. `input_tokens` / `output_tokens` override what it
        counts where the call's usage counts otherwise (a prompt's n samples count its tokens
        once; a scored prompt shows no output)."""
        self._reasons.append(out.finish_reason or "unknown")
        self._input_tokens += out.num_prompt_tokens if input_tokens is None else input_tokens
        self._output_tokens += out.num_output_tokens if output_tokens is None else output_tokens
        m = out.metrics
        times = (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time)
        latencies = {name: latency(*times) for name, latency in _LATENCIES.items()}
        e2e = latencies["gen_ai.latency.e2e"] or 0.0
        if e2e >= self._latencies.get("gen_ai.latency.e2e", -1.0):  # the slowest choice's
            self._latencies = {k: v for k, v in latencies.items() if v is not None}
        if out.finish_reason == "error" and self._failure is None:
            self._failure = out.error or "The engine failed the request."

    def end(self, error: str | None = None, error_type: str = "error", **attributes) -> None:
        """Ends the span (once): ERROR with `error`'s message when the call failed (or was
        cancelled; `error_type` its class: the HTTP status code, the gRPC status's name), else
        OK unless the engine failed one of its requests. `attributes` are the front end's own
        (the HTTP status code, the gRPC status)."""
        if self._ended:
            return
        self._ended = True
        span = self._span
        if self._reasons:
            span.set_attributes(
                {
                    "gen_ai.response.finish_reasons": self._reasons,
                    "gen_ai.usage.input_tokens": self._input_tokens,
                    "gen_ai.usage.output_tokens": self._output_tokens,
                    **self._latencies,
                }
            )
        span.set_attributes(attributes)
        message = error or self._failure
        if message is not None:
            span.set_attribute("error.type", error_type if error else "finish_reason_error")
            span.set_status(self._status_error, message)
        span.end()


class RequestTracer:
    """Starts the spans of generation calls, on a TracerProvider: the OTLP one of
    `to_collector`, or one a caller (a test) owns."""

    def __init__(self, provider, *, owns_provider: bool = False):
        # Imported here: a server without tracing never imports opentelemetry.
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self._owns_provider = owns_provider
        self._tracer = provider.get_tracer("jaxserve.service")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = trace.SpanKind.SERVER
        self._error = trace.StatusCode.ERROR

    @classmethod
    def to_collector(cls, endpoint: str) -> RequestTracer:
        """Spans sent in batches to the OTLP/gRPC collector at `endpoint` (checked first).
        ImportError when the SDK is not installed (the `serve` extra)."""
        check_endpoint(endpoint)
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # http:// is plain text and https:// TLS, whatever OTEL_EXPORTER_OTLP_INSECURE says.
        insecure = urllib.parse.urlsplit(endpoint).scheme == "http"
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
        # The server shuts it down in stop(), after its front ends; an atexit hook per provider
        # would keep every server's provider (tests start many) alive until the process ends.
        provider = TracerProvider(
            resource=Resource.create({"service.name": "jaxserve"}), shutdown_on_exit=False
        )
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider, owns_provider=True)

    def start(self, operation: str, carrier: Mapping[str, str]) -> CallSpan:
        """A call's span, named by its GenAI operation ("chat", "text_completion"), begun now;
        its parent is the caller's span in `carrier`'s traceparent, if any."""
        context = self._propagator.extract({k: carrier[k] for k in TRACE_HEADERS if k in carrier})
        span = self._tracer.start_span(
            operation,
            context=context,
            kind=self._kind,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": PROVIDER,
                "gen_ai.system": PROVIDER,
            },
        )
        return CallSpan(span, operation, self._error)

    def shutdown(self) -> None:
        """Sends the spans still queued (blocking: call it off the event loop); shuts the
        provider down if it was built here."""
        if self._owns_provider:
            self.provider.shutdown()  # flushes the batch first
        else:
            self.provider.force_flush()


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start
