"""The jaxserve.v1.JaxServe calls, and jaxserve.v1.Admin's (the operator's: service/admin.py,
only with --allow-weight-updates): status codes, call logs and metrics; admission by the
server's state (service/lifecycle.py).

Runs on the server's event loop (see service/server.py for the concurrency). Each call is
checked here, its text tokenized on a small thread pool (never on the loop), then it streams
from `AsyncEngine.generate()`; the stream is closed however the call ends (finished, failed,
cancelled, deadline expired), and closing it aborts the request in the engine.

Status codes: INVALID_ARGUMENT for a request that cannot run as sent (convert.InvalidRequest,
the engine's RequestRejected, a message beyond --max-message-bytes, a text longer than the
context can hold); RESOURCE_EXHAUSTED when the waiting queue is full, or when the engine refused
the request under load (--shed-late: its predicted TTFT, shown, misses the target); UNAVAILABLE
while warming up or draining, and for a generation while the engine sleeps (Admin.Sleep, until
Admin.WakeUp); INTERNAL once the engine has failed. Every message names the
field and the value at fault; a negative priority is refused unless the server lets clients
raise theirs (--clients-may-raise-priority). A request the engine fails alone (finish reason
`error`: its output could not be processed) is not a failed call: its last response says
FINISH_REASON_ERROR and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable

import grpc
from prometheus_client import CollectorRegistry, Counter

from jaxserve.engine import beam_search
from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.engine.core import EngineAsleep
from jaxserve.scheduling.scheduler import QueueFull
from service import admin, validation
from service.gen.jaxserve.v1 import jaxserve_pb2 as pb
from service.grpc import convert
from service.lifecycle import Lifecycle, Refused
from service.logs import log
from service.tracing import NO_SPAN, NoSpan

logger = logging.getLogger("jaxserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name
# The operator's calls (service/admin.py), served only with --allow-weight-updates.
ADMIN_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Admin"].full_name


@dataclasses.dataclass
class _Call:
    """What the call's log line and metrics say."""

    method: str
    peer: str
    start: float = dataclasses.field(default_factory=time.perf_counter)
    code: grpc.StatusCode = grpc.StatusCode.OK
    fields: dict = dataclasses.field(default_factory=dict)
    span: NoSpan = NO_SPAN  # a generation's, while tracing is on (service/tracing.py)

    def finished(self, out) -> None:
        self.span.output(out)
        m = out.metrics
        self.fields.update(
            finish_reason=out.finish_reason,
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            queue_wait_s=_round(m.queue_wait),
            ttft_s=_round(m.ttft),
            e2e_s=_round(m.e2e),
        )
        if out.error:
            self.fields["error"] = out.error


class JaxServeServicer:
    """The jaxserve.v1 calls, admitted and counted by the server's `Lifecycle`."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        registry: CollectorRegistry,
        max_message_bytes: int,
        *,
        clients_may_raise_priority: bool = False,
        served_model_names: tuple[str, ...] = (),
    ):
        self.lifecycle = lifecycle
        self.max_message_bytes = max_message_bytes
        self.clients_may_raise_priority = clients_may_raise_priority
        self.served_model_names = served_model_names  # --served-model-name
        self._calls = Counter(
            "jaxserve_grpc_calls",
            "gRPC calls by method and status code.",
            ["method", "code"],
            registry=registry,
        )

    def generic_handler(self) -> grpc.GenericRpcHandler:
        # Lenient deserializers: malformed UTF-8 and oversized messages become INVALID_ARGUMENT
        # (not INTERNAL, nor gRPC's RESOURCE_EXHAUSTED, which would read as "retry later").
        max_bytes = self.max_message_bytes

        def unary(name, body, request_cls, response_cls, span=None):
            return grpc.unary_unary_rpc_method_handler(
                self._rpc(name, body, span=span),
                convert.lenient(request_cls, max_bytes),
                response_cls.SerializeToString,
            )

        # A generation is a text completion (GenAI's operation name) for its span.
        generate = grpc.unary_stream_rpc_method_handler(
            self._rpc("Generate", self._generate, span="text_completion"),
            convert.lenient(pb.GenerateRequest, max_bytes),
            pb.GenerateResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Generate": generate,
                "GenerateUnary": unary(
                    "GenerateUnary",
                    self._generate_unary,
                    pb.GenerateRequest,
                    pb.GenerateResponse,
                    span="text_completion",
                ),
                "Tokenize": unary(
                    "Tokenize", self._tokenize, pb.TokenizeRequest, pb.TokenizeResponse
                ),
                "GetModelInfo": unary(
                    "GetModelInfo", self._model_info, pb.GetModelInfoRequest, pb.ModelInfo
                ),
            },
        )

    def admin_handler(self) -> grpc.GenericRpcHandler:
        """jaxserve.v1.Admin (the server adds it only with --allow-weight-updates): each call
        one function of service/admin.py, as the HTTP API's routes (http/admin.py). WakeUp and
        IsSleeping are not admitted by the state, as over HTTP: a draining server still
        answers them."""
        max_bytes = self.max_message_bytes

        def unary(name, body, request_cls, response_cls, admit=True):
            return grpc.unary_unary_rpc_method_handler(
                self._rpc(name, body, admit=admit),
                convert.lenient(request_cls, max_bytes),
                response_cls.SerializeToString,
            )

        return grpc.method_handlers_generic_handler(
            ADMIN_SERVICE_NAME,
            {
                "UpdateWeightsFromDisk": unary(
                    "UpdateWeightsFromDisk",
                    self._update_weights,
                    pb.UpdateWeightsFromDiskRequest,
                    pb.UpdateWeightsFromDiskResponse,
                ),
                "Sleep": unary("Sleep", self._sleep, pb.SleepRequest, pb.SleepResponse),
                "WakeUp": unary(
                    "WakeUp", self._wake_up, pb.WakeUpRequest, pb.WakeUpResponse, admit=False
                ),
                "IsSleeping": unary(
                    "IsSleeping",
                    self._is_sleeping,
                    pb.IsSleepingRequest,
                    pb.IsSleepingResponse,
                    admit=False,
                ),
            },
        )

    def _rpc(self, method: str, body, admit: bool = True, span: str | None = None):
        """Wraps a call's body: admission, in-flight count, status code, log line, metrics;
        with `span` (a GenAI operation), the call's span, a child of the caller's span in its
        metadata's traceparent, begun before admission and ended with the call."""

        async def handler(request, context: grpc.aio.ServicerContext):
            call = _Call(method, context.peer())
            if span is not None:
                metadata = dict(context.invocation_metadata() or ())
                call.span = self.lifecycle.start_span(span, metadata)
            try:
                if admit:
                    self.lifecycle.admit()
                if isinstance(request, convert.MalformedRequest):
                    raise convert.InvalidRequest(request.message)
                with self.lifecycle.in_flight():
                    return await body(request, context, call)
            except asyncio.CancelledError:  # the client cancelled, left, or its deadline passed
                remaining = context.time_remaining()
                expired = remaining is not None and remaining <= 0
                call.code = (
                    grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
                )
                call.fields["error"] = (
                    "The call's deadline passed before it finished."
                    if expired
                    else "The client cancelled the call before it finished."
                )
                raise
            except Exception as e:
                call.code, message = await self._status_of(e)
                call.fields["error"] = message
                await context.abort(call.code, message)
            finally:
                failed = call.code is not grpc.StatusCode.OK
                call.span.end(
                    call.fields.get("error") if failed else None,
                    call.code.name,
                    **{"rpc.grpc.status_code": call.code.value[0]},
                )
                self._calls.labels(method=method, code=call.code.name).inc()
                level = logging.ERROR if call.code is grpc.StatusCode.INTERNAL else logging.INFO
                if call.fields.get("finish_reason") == "error":
                    level = logging.WARNING
                duration = _round(time.perf_counter() - call.start)
                log(
                    logger,
                    level,
                    "call",
                    method=method,
                    code=call.code.name,
                    peer=call.peer,
                    duration_s=duration,
                    **call.fields,
                )

        return handler

    async def _status_of(self, e: Exception) -> tuple[grpc.StatusCode, str]:
        if isinstance(e, Refused):
            return e.code, str(e)
        if isinstance(e, EngineAsleep):  # Admin.Sleep (HTTP POST /sleep), until WakeUp
            return grpc.StatusCode.UNAVAILABLE, str(e)
        if isinstance(e, QueueFull):
            return (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"The waiting queue is full: {e} Retry later.",
            )
        if isinstance(e, ValueError):  # InvalidRequest, RequestRejected, add_request's checks
            return grpc.StatusCode.INVALID_ARGUMENT, str(e)
        if isinstance(e, EngineDeadError):
            await self.lifecycle.engine_failed()
            return grpc.StatusCode.INTERNAL, str(e)
        logger.exception("unexpected error in a call")
        return grpc.StatusCode.INTERNAL, f"Internal error: {e!r}"

    # ---- the calls ------------------------------------------------------------------------

    async def _encode(self, text: str) -> list[int]:
        """Token ids of a checked text, computed off the event loop."""
        return await self.lifecycle.off_loop(self.lifecycle.engine.encode, text)

    async def _stream(self, request: pb.GenerateRequest, call: _Call):
        async_engine = self.lifecycle.engine
        info = async_engine.info
        # Refuses a text that cannot fit.
        text = convert.prompt_text(request, info, self.lifecycle.prompt_limit)
        ids = convert.prompt_ids(request, info, None if text is None else await self._encode(text))
        params = convert.sampling_params(request.sampling, len(ids), info)
        priority = validation.check_priority(
            "priority", request.priority, self.clients_may_raise_priority
        )
        request_id = convert.request_id(request) or f"grpc-{uuid.uuid4().hex[:16]}"
        call.fields.update(
            request_id=request_id, prompt_tokens=len(ids), max_tokens=params.max_tokens
        )
        lora = request.lora or None  # a name the engine has not loaded: INVALID_ARGUMENT
        if lora is not None:
            call.fields.update(lora=lora)
        model = lora or self.model_names(info)[0]
        call.span.request(model=model, params=params)
        call.span.response(request_id, model)
        if params.beam_width > 1:
            search = beam_search.search_async(async_engine, ids, params, request_id, priority, lora)
            return _one(search)
        return async_engine.generate(
            ids, params, request_id=request_id, priority=priority, lora=lora
        )

    async def _generate(self, request, context, call: _Call) -> None:
        async with contextlib.aclosing(await self._stream(request, call)) as stream:
            async for out in stream:
                _raise_if_refused(out)
                await context.write(convert.response(out))
                if out.finished:
                    call.finished(out)

    async def _generate_unary(self, request, context, call: _Call) -> pb.GenerateResponse:
        ids, text, logprobs, last = [], [], [], None
        async with contextlib.aclosing(await self._stream(request, call)) as stream:
            async for last in stream:
                _raise_if_refused(last)
                ids += last.new_token_ids
                text.append(last.text_delta)
                logprobs += last.logprobs or []
        call.finished(last)
        return convert.response(last, token_ids=ids, text="".join(text), logprobs=logprobs)

    async def _tokenize(self, request, context, call: _Call) -> pb.TokenizeResponse:
        info = self.lifecycle.engine.info
        convert.check_text("text", request.text, info, self.lifecycle.prompt_limit)
        return pb.TokenizeResponse(token_ids=await self._encode(request.text))

    def model_names(self, info) -> tuple[str, ...]:
        """The names the model is served under (--served-model-name), else its folder's name:
        those the HTTP API's /v1/models lists (info: the engine's EngineInfo)."""
        return self.served_model_names or (validation.model_name(info),)

    async def _model_info(self, request, context, call: _Call) -> pb.ModelInfo:
        info = self.lifecycle.engine.info
        return convert.model_info(info, self.model_names(info))

    # ---- the operator's calls (jaxserve.v1.Admin) -----------------------------------------

    async def _update_weights(self, request, context, call: _Call):
        done = await admin.update_weights_from_disk(
            self.lifecycle, request.model_path, request.load_format, call.fields
        )
        return pb.UpdateWeightsFromDiskResponse(
            success=True,
            message=done.message,
            weights_version=done.weights_version,
            seconds=done.seconds,
        )

    async def _sleep(self, request, context, call: _Call) -> pb.SleepResponse:
        level = admin.check_sleep_level(request.level if request.HasField("level") else 1)
        call.fields.update(sleep_level=level)
        freed = await admin.sleep(self.lifecycle, level)
        return pb.SleepResponse(is_sleeping=True, level=level, freed_bytes=freed)

    async def _wake_up(self, request, context, call: _Call) -> pb.WakeUpResponse:
        await admin.wake_up(self.lifecycle)
        return pb.WakeUpResponse(is_sleeping=False)

    async def _is_sleeping(self, request, context, call: _Call) -> pb.IsSleepingResponse:
        return pb.IsSleepingResponse(is_sleeping=admin.is_sleeping(self.lifecycle))


def _raise_if_refused(out) -> None:
    """A request the engine refused under load (--shed-late, finish reason "refused") fails its
    call with RESOURCE_EXHAUSTED and the engine's reason, as a full queue does: it never had a
    token, and the client should retry later or elsewhere, not read it as a finished answer."""
    if out.finish_reason == "refused":
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, out.error or "Refused under load.")


async def _one(result: Awaitable):
    """A stream of one item: a beam search's whole result, sent once it has ended (its beams
    are not final before, so there is nothing to stream)."""
    yield await result


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
