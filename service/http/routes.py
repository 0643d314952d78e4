"""The OpenAI-compatible HTTP API's app (FastAPI) and its route table, over the server's engine.

Routes: POST /v1/completions (completions.py), POST /v1/chat/completions (chat.py), GET
/v1/models and /v1/models/{id}, GET /health, GET /metrics, POST /tokenize, POST /detokenize; with
--allow-runtime-lora, vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter; with
--allow-weight-updates, the operator's routes of admin.py (new weights from a folder, sleep and
wake-up: POST /update_weights_from_disk, POST /sleep, POST /wake_up, GET /is_sleeping).

It only translates: a body is parsed (pydantic, types only), checked by service/validation.py
(the checks gRPC runs, so an error names the field and value alike), tokenized on the server's
tokenizer threads, and streamed from `AsyncEngine.generate()` (pumps.py; with vLLM's
`use_beam_search`, beams.py runs a beam search per prompt instead). Admission and the count of
calls in flight are the server's `Lifecycle` (service/lifecycle.py), as for gRPC, so the
server's state (warming, serving, draining, failed) and its drain govern both front ends alike.
Each route's body is wrapped here once: admission, the in-flight count, the status code of an
error, and the call's log line and metric; a streamed body becomes server-sent events
(streaming.py).

Status codes: 400 for a request that cannot run as sent (`param` names the field), 401 without
the bearer token when one is configured (/health is exempt with --health-without-auth), 404 for
an unknown route or model, 405 for a wrong method, 413 for a body beyond --max-message-bytes,
429 (with Retry-After) when the waiting queue is full or the engine refused the request under
load (--shed-late), 503 while warming up or draining (and for calls still waiting when the
drain's grace period ends) and while the engine sleeps (POST /sleep), 500 once the engine
failed, 499 (logged only) for a client that left, while sending its body too. Every error body
is OpenAI's error object. Nothing a client sends may answer 500: a 500 other than the engine's
failure is a server bug, logged with its traceback.

Concurrency: every handler runs on the server's event loop; pumps.py says how a call's engine
streams run and end.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import pathlib
import time
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.engine.core import EngineAsleep
from jaxserve.scheduling.types import QueueFull
from service import validation
from service.http import protocol, streaming
from service.http.admin import AdminRoutes
from service.http.chat import OpenAIServingChat
from service.http.completions import OpenAIServingCompletion
from service.http.serving import DEFAULT_MAX_BODY_BYTES, ClientGone, HttpError, OpenAIServing
from service.lifecycle import Lifecycle, Refused, State
from service.logs import log
from service.tracing import NO_SPAN
from service.validation import InvalidRequest

# Seconds a 429 asks the client to wait before retrying (a full queue drains in about that).
RETRY_AFTER_S = 1

logger = logging.getLogger("jaxserve.http")


class OpenAIFrontEnd:
    """The ASGI app (`.app`) of one JaxServeServer, over its lifecycle.

    `auth_token`, when set, is the bearer token every call must send (/health too, unless
    `health_without_auth`). `max_body_bytes` bounds a request's body (413 beyond it);
    `clients_may_raise_priority` lets clients send a priority below 0. `chat_template` (Jinja)
    renders chat in place of the model's own template, for a model without one.
    `served_model_names` are the names the model is served under (`--served-model-name`).
    """

    def __init__(
        self,
        lifecycle: Lifecycle,
        registry: CollectorRegistry,
        *,
        auth_token: str | None = None,
        health_without_auth: bool = False,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        clients_may_raise_priority: bool = False,
        allow_runtime_lora: bool = False,
        allow_weight_updates: bool = False,
        chat_template: str | None = None,
        served_model_names: Sequence[str] = (),
    ):
        self.lifecycle = lifecycle
        self.registry = registry
        self._auth_token = auth_token
        self._health_without_auth = health_without_auth
        limits = dict(
            max_body_bytes=max_body_bytes,
            clients_may_raise_priority=clients_may_raise_priority,
            chat_template=chat_template,
            served_model_names=served_model_names,
        )
        self.serving = OpenAIServing(lifecycle, **limits)  # /v1/models, /tokenize, /detokenize
        self.completions = OpenAIServingCompletion(lifecycle, **limits)
        self.chat = OpenAIServingChat(lifecycle, **limits)
        self._calls = Counter(
            "jaxserve_http_requests",
            "HTTP API calls by route and status code.",
            ["route", "code"],
            registry=registry,
        )
        app = FastAPI(title="jaxserve", summary="OpenAI-compatible API of jaxserve")
        app.middleware("http")(self._auth)
        app.exception_handler(StarletteHTTPException)(self._unrouted)
        # Each a span when tracing is on, named by its GenAI operation (service/tracing.py).
        completions = self._route("completions", self.completions.create, span="text_completion")
        app.post("/v1/completions")(completions)
        app.post("/v1/chat/completions")(self._route("chat", self.chat.create, span="chat"))
        app.get("/v1/models")(self._route("models", self._models, admit=False))
        app.get("/v1/models/{model_id:path}")(self._route("model", self._model, admit=False))
        if allow_runtime_lora:  # otherwise 404, as any unknown route (vLLM's default too)
            load, unload = self._load_lora, self._unload_lora
            app.post("/v1/load_lora_adapter")(self._route("load_lora", load, admit=False))
            app.post("/v1/unload_lora_adapter")(self._route("unload_lora", unload, admit=False))
        if allow_weight_updates:  # otherwise 404: the routes do not exist
            admin = AdminRoutes(lifecycle, self.serving)
            app.post("/update_weights_from_disk")(
                self._route("update_weights", admin.update_weights)
            )
            app.post("/sleep")(self._route("sleep", admin.sleep))
            app.post("/wake_up")(self._route("wake_up", admin.wake_up, admit=False))
            app.get("/is_sleeping")(self._route("is_sleeping", admin.is_sleeping, admit=False))
        app.post("/tokenize")(self._route("tokenize", self._tokenize))
        app.post("/detokenize")(self._route("detokenize", self._detokenize))
        app.get("/health")(self._health)
        app.get("/metrics")(self._metrics)
        self.app = app

    # ---- plumbing -------------------------------------------------------------------------

    async def _auth(self, request: Request, call_next):
        token = self._auth_token
        exempt = request.url.path == "/health" and self._health_without_auth
        if token and not exempt:
            sent = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(sent, f"Bearer {token}".encode()):
                what = "missing" if not sent else "wrong"
                self._calls.labels(route=request.url.path, code="401").inc()
                return JSONResponse(
                    protocol.error_body(
                        f"The bearer token is {what}: send the header "
                        "'Authorization: Bearer <token>'.",
                        "authentication_error",
                        code="invalid_api_key",
                    ),
                    status_code=401,
                )
        return await call_next(request)

    def _route(self, name: str, body, admit: bool = True, span: str | None = None):
        """Wraps a handler body: admission, in-flight count, errors, the call's log line; with
        `span` (a GenAI operation), the call's span too, handed to the body, begun before
        admission (a refused call is traced too) and ended with the call."""

        async def handler(request: Request) -> Response:
            start = time.perf_counter()
            fields: dict = {}
            stack = contextlib.ExitStack()
            streamed = False
            call_span = NO_SPAN
            if span is not None:
                call_span = self.lifecycle.start_span(span, request.headers)
                stack.callback(_end_span, call_span, fields)
            try:
                if admit:
                    self.lifecycle.admit()
                stack.enter_context(self.lifecycle.in_flight())
                work = body(request, fields, call_span) if span else body(request, fields)
                result = await self._unless_drain_ends(work)
                if isinstance(result, Response):
                    return result
                if isinstance(result, dict):
                    # Strict JSON; a body that is not (a server bug) is a 500, not the
                    # ValueError that Starlette's JSONResponse raises, read as a 400 below.
                    return Response(protocol.dumps(result), media_type="application/json")
                streamed = True  # an async iterator of server-sent events

                def end() -> None:
                    stack.close()
                    self._log(name, start, fields)

                return StreamingResponse(
                    streaming.sse(result, self._error_of, fields, end),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            except ClientGone:
                fields["code"] = 499  # nginx's "client closed request": nobody reads it
                return Response(status_code=499)
            except Exception as e:
                error = await self._error_of(e)
                fields.update(code=error.status, error=str(error))
                return self._error_response(error)
            finally:
                if not streamed:
                    stack.close()
                    self._log(name, start, fields)

        return handler

    async def _unless_drain_ends(self, work):
        """work's result, unless the drain's grace period ends first: then the lifecycle's
        503, answered while the listener still lets it out (uvicorn would cancel the call
        and answer a text/plain 500 of its own)."""
        ended = self.lifecycle.drain_ended
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(ended.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if task.cancelled():  # cut by the drain's end (a task cancelled otherwise raised above)
            error = self.lifecycle.drain_error
            raise Refused(error.code, str(error))
        return task.result()

    def _error_response(self, error: HttpError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 429 else None
        return JSONResponse(
            protocol.error_body(str(error), error.type, error.param, error.code),
            status_code=error.status,
            headers=headers,
        )

    async def _unrouted(self, request: Request, exc: StarletteHTTPException) -> Response:
        """404 (no such route) and 405 (a route without this method) as OpenAI's error object,
        as every other error is; counted under the route "unrouted"."""
        self._calls.labels(route="unrouted", code=str(exc.status_code)).inc()
        what = {404: "no such route", 405: "this method is not allowed there"}.get(
            exc.status_code, exc.detail
        )
        return JSONResponse(
            protocol.error_body(
                f"{request.method} {request.url.path}: {what} (HTTP {exc.status_code}).",
                "invalid_request_error",
                code="not_found" if exc.status_code == 404 else None,
            ),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    def _log(self, name: str, start: float, fields: dict) -> None:
        code = fields.pop("code", 200)
        self._calls.labels(route=name, code=str(code)).inc()
        level = logging.INFO if code < 500 else logging.ERROR
        duration = round(time.perf_counter() - start, 4)
        log(logger, level, "http call", route=name, code=code, duration_s=duration, **fields)

    async def _error_of(self, e: Exception) -> HttpError:
        if isinstance(e, HttpError):
            return e
        if isinstance(e, (Refused, EngineAsleep)):  # (asleep: POST /sleep, until /wake_up)
            return HttpError(503, str(e), "service_unavailable")
        if isinstance(e, QueueFull):
            return HttpError(429, f"The waiting queue is full: {e} Retry later.", "rate_limit")
        if isinstance(e, InvalidRequest):
            return HttpError(400, str(e), "invalid_request_error", e.param)
        if isinstance(e, ValueError):  # the engine's RequestRejected, add_request's checks
            return HttpError(400, str(e), "invalid_request_error")
        if isinstance(e, EngineDeadError):
            await self.lifecycle.engine_failed()
            return HttpError(500, str(e), "internal_error")
        logger.exception("unexpected error in an HTTP call")
        return HttpError(500, f"Internal error: {e!r}", "internal_error")

    # ---- the small routes -----------------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        state = self.lifecycle.state
        code = 200 if state is State.SERVING else 503
        return JSONResponse({"status": state.value}, status_code=code)

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    def _model_card(self, name: str) -> dict:
        """The served model under one of its names, as /v1/models lists it; 503 while warming
        up (there is no engine yet to describe). `root` is where it came from (its folder's
        name), whatever it is served as."""
        if self.lifecycle.engine is None:
            self.lifecycle.admit()  # Refused: warming up, or warm-up failed
        info = self.serving.info
        return {
            "id": name,
            "object": "model",
            "created": protocol.now(),
            "owned_by": "jaxserve",
            "root": validation.model_name(info),
            "max_model_len": info.max_model_len,
            "vocab_size": info.vocab_size,
        }

    def _cards(self) -> list[dict]:
        """The base model's card under each served name (vLLM's), then each LoRA adapter's, its
        base's first name as `parent`."""
        if self.lifecycle.engine is None:
            self.lifecycle.admit()
        bases = [self._model_card(name) for name in self.serving.model_names()]
        adapters = [
            {
                **bases[0],
                "id": name,
                "root": pathlib.PurePath(source).name,
                "parent": bases[0]["id"],
            }
            for name, source in self.serving.engine.lora_adapters()
        ]
        return [*bases, *adapters]

    async def _models(self, request: Request, fields: dict) -> dict:
        return {"object": "list", "data": self._cards()}

    async def _model(self, request: Request, fields: dict) -> dict:
        """GET /v1/models/{id}: the served model or adapter by its id (404 for any other id)."""
        cards = self._cards()
        model_id = request.path_params["model_id"]
        for card in cards:
            if card["id"] == model_id:
                return card
        raise HttpError(
            404,
            f"The model {validation.short(model_id)} does not exist; this server serves "
            f"{[c['id'] for c in cards]}.",
            "invalid_request_error",
            "model",
            "model_not_found",
        )

    async def _load_lora(self, request: Request, fields: dict) -> Response:
        """POST /v1/load_lora_adapter: registers a PEFT adapter folder (nothing recompiles)."""
        body = await self.serving.parse(request, protocol.LoadLoraRequest)
        fields.update(lora_name=body.lora_name)
        if self.lifecycle.engine is None:
            self.lifecycle.admit()  # Refused: warming up
        if body.lora_name in self.serving.model_names():
            raise InvalidRequest(
                f"lora_name={body.lora_name!r} is a name of the base model "
                f"{list(self.serving.model_names())}; choose another.",
                "lora_name",
            )
        try:
            await self.serving.engine.add_lora(body.lora_name, body.lora_path)
        except ValueError as e:  # a bad folder, a rank over the maximum, a name in use
            raise InvalidRequest(str(e), "lora_path") from None
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def _unload_lora(self, request: Request, fields: dict) -> Response:
        """POST /v1/unload_lora_adapter: forgets an adapter no unfinished request uses."""
        body = await self.serving.parse(request, protocol.UnloadLoraRequest)
        fields.update(lora_name=body.lora_name)
        if self.lifecycle.engine is None:
            self.lifecycle.admit()
        names = [name for name, _ in self.serving.engine.lora_adapters()]
        if body.lora_name not in names:
            raise HttpError(
                404,
                f"The LoRA adapter {validation.short(body.lora_name)} is not loaded; loaded: "
                f"{names}.",
                "invalid_request_error",
                "lora_name",
                "model_not_found",
            )
        try:
            await self.serving.engine.remove_lora(body.lora_name)
        except ValueError as e:  # in use by unfinished requests
            raise InvalidRequest(str(e), "lora_name") from None
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def _tokenize(self, request: Request, fields: dict) -> dict:
        serving = self.serving
        body = await serving.parse(request, protocol.TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("Send either prompt or messages (one of them).", "prompt")
        if body.messages is not None:
            ids = await serving.chat_ids(body.messages, True)
        else:
            validation.check_text("prompt", body.prompt, serving.info, self.lifecycle.prompt_limit)
            tokenizer = serving.engine.tokenizer
            encoded = await self.lifecycle.off_loop(
                lambda: tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)
            )
            ids = list(encoded["input_ids"])
        return {"count": len(ids), "max_model_len": serving.info.max_model_len, "tokens": ids}

    async def _detokenize(self, request: Request, fields: dict) -> dict:
        serving = self.serving
        body = await serving.parse(request, protocol.DetokenizeRequest)
        validation.check_vocab("tokens", body.tokens, serving.info.vocab_size)
        tokenizer = serving.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequest(f"Model {serving.model_id()} has no tokenizer.", "tokens")
        text = await self.lifecycle.off_loop(
            lambda: tokenizer.decode(body.tokens, skip_special_tokens=True)
        )
        return {"prompt": text}


def _end_span(span, fields: dict) -> None:
    """Ends a call's span with its status code, as an error from 400 up (499: the client
    left)."""
    code = fields.get("code", 200)
    error = None
    if code >= 400:
        error = fields.get("error") or (
            "The client closed the connection before the call finished (499)."
            if code == 499
            else f"HTTP {code}."
        )
    span.end(error, str(code), **{"http.response.status_code": code})
