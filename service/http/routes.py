"""The OpenAI-compatible HTTP API's app (FastAPI) and its route table, over the server's engine.

Routes: POST /v1/completions (completions.py), POST /v1/chat/completions (chat.py), GET
/v1/models, GET /health, GET /metrics, POST /tokenize, POST /detokenize.

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
the bearer token when one is configured (/health is exempt with --health-without-auth), 429
when the waiting queue is full or the engine refused the request under load (--shed-late), 503
while warming up or draining, 500 once the engine failed, 499 (logged only) for a client that
left.

Concurrency: every handler runs on the server's event loop; pumps.py says how a call's engine
streams run and end.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.scheduling.types import QueueFull
from service import validation
from service.http import protocol, streaming
from service.http.chat import OpenAIServingChat
from service.http.completions import OpenAIServingCompletion
from service.http.pumps import ClientGone
from service.http.serving import HttpError, OpenAIServing
from service.lifecycle import Lifecycle, Refused, State
from service.logs import log
from service.validation import InvalidRequest

logger = logging.getLogger("jaxserve.http")


class OpenAIFrontEnd:
    """The ASGI app (`.app`) of one JaxServeServer, over its lifecycle.

    `auth_token`, when set, is the bearer token every call must send (/health too, unless
    `health_without_auth`).
    """

    def __init__(
        self,
        lifecycle: Lifecycle,
        registry: CollectorRegistry,
        *,
        auth_token: str | None = None,
        health_without_auth: bool = False,
    ):
        self.lifecycle = lifecycle
        self.registry = registry
        self._auth_token = auth_token
        self._health_without_auth = health_without_auth
        self.serving = OpenAIServing(lifecycle)  # /v1/models, /tokenize, /detokenize
        self.completions = OpenAIServingCompletion(lifecycle)
        self.chat = OpenAIServingChat(lifecycle)
        self._calls = Counter(
            "jaxserve_http_requests",
            "HTTP API calls by route and status code.",
            ["route", "code"],
            registry=registry,
        )
        app = FastAPI(title="jaxserve", summary="OpenAI-compatible API of jaxserve")
        app.middleware("http")(self._auth)
        app.post("/v1/completions")(self._route("completions", self.completions.create))
        app.post("/v1/chat/completions")(self._route("chat", self.chat.create))
        app.get("/v1/models")(self._route("models", self._models, admit=False))
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

    def _route(self, name: str, body, admit: bool = True):
        """Wraps a handler body: admission, in-flight count, errors, the call's log line."""

        async def handler(request: Request) -> Response:
            start = time.perf_counter()
            fields: dict = {}
            stack = contextlib.ExitStack()
            streamed = False
            try:
                if admit:
                    self.lifecycle.admit()
                stack.enter_context(self.lifecycle.in_flight())
                result = await body(request, fields)
                if isinstance(result, Response):
                    return result
                if isinstance(result, dict):
                    return JSONResponse(result)
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
                return JSONResponse(
                    protocol.error_body(str(error), error.type, error.param),
                    status_code=error.status,
                )
            finally:
                if not streamed:
                    stack.close()
                    self._log(name, start, fields)

        return handler

    def _log(self, name: str, start: float, fields: dict) -> None:
        code = fields.pop("code", 200)
        self._calls.labels(route=name, code=str(code)).inc()
        level = logging.INFO if code < 500 else logging.ERROR
        duration = round(time.perf_counter() - start, 4)
        log(logger, level, "http call", route=name, code=code, duration_s=duration, **fields)

    async def _error_of(self, e: Exception) -> HttpError:
        if isinstance(e, HttpError):
            return e
        if isinstance(e, Refused):
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

    async def _models(self, request: Request, fields: dict) -> dict:
        info = self.serving.info
        return {
            "object": "list",
            "data": [
                {
                    "id": self.serving.model_id(),
                    "object": "model",
                    "created": protocol.now(),
                    "owned_by": "jaxserve",
                    "root": info.model,
                    "max_model_len": info.max_model_len,
                    "vocab_size": info.vocab_size,
                }
            ],
        }

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
            raise InvalidRequest(f"Model {serving.info.model} has no tokenizer.", "tokens")
        text = await self.lifecycle.off_loop(
            lambda: tokenizer.decode(body.tokens, skip_special_tokens=True)
        )
        return {"prompt": text}
