"""The OpenAI-compatible HTTP API over the gRPC server's AsyncEngine (an ASGI app, FastAPI).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics, POST /tokenize, POST /detokenize.

It only translates: a body is parsed (pydantic, types only), checked by service/validation.py
(the checks gRPC runs, so an error names the field and value alike), tokenized on the server's
tokenizer threads, and streamed from `AsyncEngine.generate()` (with vLLM's `use_beam_search`,
service/http/beams.py runs a beam search per prompt instead). Admission and the count of calls in
flight are the server's `Lifecycle` (service/lifecycle.py), as for gRPC, so the server's state
(warming, serving, draining, failed) and its drain govern both front ends alike.

Status codes: 400 for a request that cannot run as sent (`param` names the field), 401 without
the bearer token when one is configured (/health is exempt with --health-without-auth), 429
when the waiting queue is full or the engine refused the request under load (--shed-late), 503
while warming up or draining, 500 once the engine failed.

Concurrency: every handler runs on the server's event loop. A request with several prompts or
`n` samples runs one engine stream per (prompt, sample), pumped by one task each into a shared
queue. The response (streamed or not) starts only once every stream has delivered its first
output, so that an error that ends a stream at once (a full queue, a rejected request) is the
call's status code, not an event inside a 200 stream. A client that disconnects, before or
during the response, cancels the pumps; closing their streams aborts the requests, and the
engine frees their slots and pages at its next iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import pathlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.outputs import RequestOutput, TokenLogprob
from jaxserve.sampling_params import SEED_LIMIT, SamplingParams
from jaxserve.scheduling.types import QueueFull
from service import validation
from service.http import beams, protocol
from service.lifecycle import Lifecycle, Refused, State
from service.logs import log
from service.validation import InvalidRequest

if TYPE_CHECKING:
    from service.server import ServerOptions

logger = logging.getLogger("jaxserve.http")

MAX_N = 16  # samples per prompt: each is a request of its own in the waiting queue
MAX_PROMPTS = 64  # prompts per /v1/completions call


class HttpError(Exception):
    """A call that ends with this status and OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param = status, type_, param


class ClientGone(Exception):
    """The client disconnected before the response began."""


@dataclasses.dataclass
class _Job:
    """One engine request of a call: choice `index` of the response."""

    index: int
    sample: int  # which of the prompt's n samples
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None  # for echo
    # echo with max_tokens=0: the prompt scored, nothing generated. The engine samples one token
    # anyway (in the step that ends the prompt, so it costs no extra step); it is not shown.
    scoring_only: bool = False


@dataclasses.dataclass
class _Choice:
    """What one choice has produced so far."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    last: RequestOutput | None = None


class OpenAIFrontEnd:
    """The ASGI app (`.app`) of one JaxServeServer, over its lifecycle."""

    def __init__(self, lifecycle: Lifecycle, options: ServerOptions, registry: CollectorRegistry):
        self.lifecycle = lifecycle
        self.options = options
        self.registry = registry
        self._token_texts: dict[int, str] = {}
        self._calls = Counter(
            "jaxserve_http_requests",
            "HTTP API calls by route and status code.",
            ["route", "code"],
            registry=registry,
        )
        app = FastAPI(title="jaxserve", summary="OpenAI-compatible API of jaxserve")
        app.middleware("http")(self._auth)
        app.post("/v1/completions")(self._route("completions", self._completions))
        app.post("/v1/chat/completions")(self._route("chat", self._chat))
        app.get("/v1/models")(self._route("models", self._models, admit=False))
        app.post("/tokenize")(self._route("tokenize", self._tokenize))
        app.post("/detokenize")(self._route("detokenize", self._detokenize))
        app.get("/health")(self._health)
        app.get("/metrics")(self._metrics)
        self.app = app

    # ---- plumbing -------------------------------------------------------------------------

    async def _auth(self, request: Request, call_next):
        token = self.options.auth_token
        exempt = request.url.path == "/health" and self.options.health_without_auth
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
            streaming = False
            try:
                if admit:
                    self.lifecycle.admit()
                stack.enter_context(self.lifecycle.in_flight())
                result = await body(request, fields)
                if isinstance(result, Response):
                    return result
                if isinstance(result, dict):
                    return JSONResponse(result)
                streaming = True  # an async iterator of server-sent events
                return StreamingResponse(
                    self._sse(result, stack, name, start, fields),
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
                if not streaming:
                    stack.close()
                    self._log(name, start, fields)

        return handler

    def _log(self, name: str, start: float, fields: dict) -> None:
        code = fields.pop("code", 200)
        self._calls.labels(route=name, code=str(code)).inc()
        level = logging.INFO if code < 500 else logging.ERROR
        duration = round(time.perf_counter() - start, 4)
        log(logger, level, "http call", route=name, code=code, duration_s=duration, **fields)

    async def _sse(self, events: AsyncIterator[dict], stack, name, start, fields):
        """Server-sent events, ending with `data: [DONE]`; ends the call when it ends."""
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:  # the client left mid-stream (Starlette cancels us)
            fields["code"] = 499
            raise
        except Exception as e:
            error = await self._error_of(e)
            fields.update(code=error.status, error=str(error))
            body = protocol.error_body(str(error), error.type, error.param)
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()
            stack.close()
            self._log(name, start, fields)

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

    @property
    def _engine(self):
        return self.lifecycle.engine.engine

    def model_id(self) -> str:
        """The served model's name: its folder's name ("stories260k")."""
        return pathlib.PurePath(str(self._engine.model.source)).name or "jaxserve"

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            tokenizer = self._engine.tokenizer
            text = tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)
            self._token_texts[token_id] = text
        return text

    async def _parse(self, request: Request, model: type[pydantic.BaseModel]):
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InvalidRequest(f"The request body is not valid JSON: {e}.") from None
        try:
            return model.model_validate(data)
        except pydantic.ValidationError as e:
            first = e.errors()[0]
            # A union's error names the member tried ("prompt.str"): the client wrote "prompt".
            parts = [str(p) for p in first["loc"] if not _is_type_tag(p)]
            loc = ".".join(parts)
            value = _at(data, parts)
            raise InvalidRequest(
                f"{loc}={_short(value)} is not valid: {first['msg']}." if loc else first["msg"],
                loc or None,
            ) from None

    # ---- the routes -----------------------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        state = self.lifecycle.state
        code = 200 if state is State.SERVING else 503
        return JSONResponse({"status": state.value}, status_code=code)

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def _models(self, request: Request, fields: dict) -> dict:
        engine = self._engine
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_id(),
                    "object": "model",
                    "created": protocol.now(),
                    "owned_by": "jaxserve",
                    "root": str(engine.model.source),
                    "max_model_len": engine.max_model_len,
                    "vocab_size": engine.model.config.vocab_size,
                }
            ],
        }

    async def _tokenize(self, request: Request, fields: dict) -> dict:
        body = await self._parse(request, protocol.TokenizeRequest)
        engine = self._engine
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("Send either prompt or messages (one of them).", "prompt")
        if body.messages is not None:
            ids = await self._chat_ids(body.messages, True)
        else:
            validation.check_text("prompt", body.prompt, engine, self.lifecycle.prompt_limit)
            tokenizer = engine.tokenizer
            encoded = await self.lifecycle.off_loop(
                lambda: tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)
            )
            ids = list(encoded["input_ids"])
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    async def _detokenize(self, request: Request, fields: dict) -> dict:
        body = await self._parse(request, protocol.DetokenizeRequest)
        engine = self._engine
        validation.check_vocab("tokens", body.tokens, engine.model.config.vocab_size)
        if engine.tokenizer is None:
            raise InvalidRequest(f"Model {engine.model.source} has no tokenizer.", "tokens")
        text = await self.lifecycle.off_loop(
            lambda: engine.tokenizer.decode(body.tokens, skip_special_tokens=True)
        )
        return {"prompt": text}

    async def _completions(self, request: Request, fields: dict):
        body = await self._parse(request, protocol.CompletionRequest)
        if body.suffix is not None:
            raise InvalidRequest("suffix is not supported: send the whole prompt.", "suffix")
        width = beams.beam_width(body)
        prompts = await self._completion_prompts(body.prompt)
        scoring_only = body.max_tokens == 0
        if scoring_only and not body.echo:
            raise InvalidRequest(
                "max_tokens=0 asks for no output; it is allowed only with echo=true (to score "
                "the prompt with logprobs). Send max_tokens >= 1.",
                "max_tokens",
            )
        sampling = self._sampling_fields(body, 1 if scoring_only else body.max_tokens)
        if body.logprobs is not None:
            sampling["logprobs"] = body.logprobs
            if body.echo:  # the prompt's tokens come first in the logprobs, as OpenAI sends them
                sampling["prompt_logprobs"] = body.logprobs
        if width is not None:
            if scoring_only:
                raise InvalidRequest(
                    "max_tokens=0 (scoring the prompt) cannot be combined with "
                    "use_beam_search=true: a beam search needs max_tokens >= 1.",
                    "max_tokens",
                )
            return await self._beam_call(request, body, prompts, sampling, width, fields)
        jobs = self._jobs(prompts, body, sampling, fields)
        for job in jobs:
            job.scoring_only = scoring_only
            if job.sample > 0 and job.params.prompt_logprobs is not None:
                # The n samples of a prompt share its logprobs: the first sample computes them.
                job.params = dataclasses.replace(job.params, prompt_logprobs=None)
        cid = f"cmpl-{uuid.uuid4().hex}"
        fields.update(id=cid, prompts=len(prompts), n=body.n, stream=body.stream)
        pumps = await self._start(request, jobs, body.priority)
        head = {"id": cid, "object": "text_completion", "created": protocol.now()}
        head["model"] = self.model_id()
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return self._completion_events(head, jobs, pumps, body, usage)
        choices = await self._unless_gone(request, self._collect(pumps, len(jobs)))
        return {
            **head,
            "choices": [
                self._completion_choice(
                    job, choices[job.index], body, choices[_first_sample(job)].prompt_logprobs
                )
                for job in jobs
            ],
            "usage": self._usage(jobs, choices),
        }

    async def _chat(self, request: Request, fields: dict):
        body = await self._parse(request, protocol.ChatCompletionRequest)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest(
                f"top_logprobs={body.top_logprobs} needs logprobs=true.", "top_logprobs"
            )
        ids = await self._chat_ids(body.messages, body.add_generation_prompt)
        validation.check_prompt_fits("messages", ids, self._engine, "messages")
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        sampling = self._sampling_fields(body, max_tokens)
        if body.logprobs:
            sampling["logprobs"] = body.top_logprobs or 0
        width = beams.beam_width(body)
        if width is not None:
            return await self._beam_call(request, body, [(ids, None)], sampling, width, fields)
        jobs = self._jobs([(ids, None)], body, sampling, fields)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        fields.update(id=cid, n=body.n, stream=body.stream)
        pumps = await self._start(request, jobs, body.priority)
        head = {"id": cid, "object": "chat.completion", "created": protocol.now()}
        head["model"] = self.model_id()
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return self._chat_events(head, jobs, pumps, usage)
        choices = await self._unless_gone(request, self._collect(pumps, len(jobs)))
        out = []
        for job in jobs:
            c = choices[job.index]
            lp = protocol.chat_logprobs(c.logprobs, self._token_text) if body.logprobs else None
            out.append(
                {
                    "index": job.index,
                    "message": {"role": "assistant", "content": "".join(c.text)},
                    "logprobs": lp,
                    "finish_reason": c.last.finish_reason,
                }
            )
        return {**head, "choices": out, "usage": self._usage(jobs, choices)}

    async def _beam_call(self, request: Request, body, prompts, sampling: dict, width, fields):
        """A call with use_beam_search (service/http/beams.py): one search per prompt, its best
        n beams the choices; the response (or its stream) once every search has ended."""
        chat = isinstance(body, protocol.ChatCompletionRequest)
        params = [
            beams.beam_params(sampling, width, body, len(ids), self._engine) for ids, _ in prompts
        ]
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        fields.update(id=cid, prompts=len(prompts), n=body.n, beam_width=width, stream=body.stream)
        prompt_ids = [ids for ids, _ in prompts]
        search = beams.search_all(self.lifecycle.engine, prompt_ids, params, body.priority)
        outs = await self._unless_gone(request, search)
        for out in outs:
            if out.error is not None:  # a beam's request failed or was aborted: no result
                raise HttpError(500, out.error, "internal_error")
        choices = []
        for i, (out, (ids, text)) in enumerate(zip(outs, prompts, strict=True)):
            echo = ""
            if not chat and body.echo:
                echo = self._echo_text(_Job(i, 0, ids, params[i], text))
            for beam in out.beams[: body.n]:
                if chat:
                    choices.append(beams.chat_choice(len(choices), beam))
                else:
                    choices.append(beams.completion_choice(len(choices), beam, echo))
        head = {
            "id": cid,
            "object": "chat.completion" if chat else "text_completion",
            "created": protocol.now(),
            "model": self.model_id(),
        }
        usage = beams.usage(prompt_ids, outs, body.n)
        if body.stream:
            include = body.stream_options is not None and body.stream_options.include_usage
            return beams.events(head, choices, usage if include else None)
        return {**head, "choices": choices, "usage": usage}

    # ---- requests -------------------------------------------------------------------------

    async def _completion_prompts(self, prompt) -> list[tuple[list[int], str | None]]:
        """(token ids, text or None) of each prompt, checked and tokenized."""
        engine = self._engine
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompts, single = [prompt], True
        else:
            prompts, single = list(prompt), False
        if not prompts:
            raise InvalidRequest("prompt=[] is empty: send a text or token ids.", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise InvalidRequest(
                f"prompt has {len(prompts)} prompts; at most {MAX_PROMPTS} per call.", "prompt"
            )
        out = []
        for i, p in enumerate(prompts):
            field = "prompt" if single else f"prompt[{i}]"
            if isinstance(p, str):
                validation.check_text(field, p, engine, self.lifecycle.prompt_limit)
                ids = await self.lifecycle.off_loop(engine.encode, p)
                what = f"{field}={validation.short(p)}"
            else:
                validation.check_token_ids(field, p, engine)
                ids, what = list(p), field
            validation.check_prompt_fits(what, ids, engine, field)
            out.append((ids, p if isinstance(p, str) else None))
        return out

    async def _chat_ids(self, messages: Sequence[protocol.ChatMessage], add_prompt: bool):
        engine = self._engine
        tokenizer = engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest(
                f"Model {engine.model.source} has no chat template, so chat messages cannot be "
                "rendered; use /v1/completions with a prompt instead.",
                "messages",
            )
        limit = self.lifecycle.prompt_limit
        for i, m in enumerate(messages):
            limit.check(f"messages[{i}].content", m.text())
        rendered = [{"role": m.role, "content": m.text()} for m in messages]

        def render() -> list[int]:
            text = tokenizer.apply_chat_template(
                rendered, tokenize=False, add_generation_prompt=add_prompt
            )
            # The template writes the special tokens (BOS included) itself.
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        try:
            return await self.lifecycle.off_loop(render)
        except Exception as e:  # a template that raises on these messages (e.g. roles order)
            raise InvalidRequest(f"The chat template refused the messages: {e}", "messages") from e

    def _sampling_fields(self, body: protocol._Sampling, max_tokens: int | None) -> dict:
        """The SamplingParams fields the client set (validation checks their values)."""
        if not body.skip_special_tokens:
            raise InvalidRequest(
                "skip_special_tokens=false is not supported: special tokens are never "
                "written into the text.",
                "skip_special_tokens",
            )
        fields = {
            name: getattr(body, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "seed", *_SUPPORTED_EXTRAS)
            if getattr(body, name) is not None
        }
        fields["max_tokens"] = max_tokens
        if body.stop is not None:
            fields["stop"] = body.stop
        if body.stop_token_ids:
            fields["stop_token_ids"] = tuple(body.stop_token_ids)
        fields["ignore_eos"] = body.ignore_eos
        if "logit_bias" in fields:
            fields["logit_bias"] = _logit_bias(fields["logit_bias"])
        return fields

    def _jobs(self, prompts, body: protocol._Sampling, sampling: dict, fields: dict) -> list[_Job]:
        """One engine request per (prompt, sample), in OpenAI's choice order.

        The seed rule for n > 1: sample i of a request with seed s runs with seed
        (s + i) mod 2**32, so it equals the single-sample request sent with that seed.
        """
        if not 1 <= body.n <= MAX_N:
            raise InvalidRequest(f"n={body.n} must be in [1, {MAX_N}].", "n")
        if body.user is not None:
            fields["user"] = body.user
        jobs = []
        for ids, text in prompts:
            for i in range(body.n):
                sample = dict(sampling)
                if body.n > 1 and body.seed is not None:
                    sample["seed"] = (body.seed + i) % SEED_LIMIT
                params = validation.sampling_params(
                    sample, num_prompt_tokens=len(ids), engine=self._engine
                )
                jobs.append(_Job(len(jobs), i, ids, params, text))
        return jobs

    async def _start(self, request: Request, jobs: list[_Job], priority: int):
        """Starts every job's engine stream; returns once each has delivered its first output
        (or raises the first one's error, the others aborted)."""
        pumps = _Pumps(self.lifecycle.engine, jobs, priority)
        try:
            await self._unless_gone(request, pumps.first_outputs())
        except BaseException:
            await pumps.close()
            raise
        return pumps

    async def _unless_gone(self, request: Request, awaitable):
        """awaitable's result, unless the client disconnects first: then ClientGone."""
        work = asyncio.ensure_future(awaitable)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            raise ClientGone
        return work.result()

    async def _collect(self, pumps: _Pumps, count: int) -> list[_Choice]:
        choices = [_Choice() for _ in range(count)]
        try:
            async for index, out in pumps:
                _add(choices[index], out)
        finally:
            await pumps.close()
        for c in choices:
            if c.last.finish_reason == "error":
                raise HttpError(500, c.last.error or "The request failed.", "internal_error")
        return choices

    def _usage(self, jobs: list[_Job], choices: list[_Choice]) -> dict:
        outputs = [0 if j.scoring_only else choices[j.index].last.num_output_tokens for j in jobs]
        return self._stream_usage(jobs, outputs, {j.index: choices[j.index].last for j in jobs})

    def _completion_choice(self, job: _Job, c: _Choice, body, prompt_logprobs) -> dict:
        text, entries, ids = "".join(c.text), list(c.logprobs), list(c.token_ids)
        if job.scoring_only:
            text, entries, ids = "", [], []
        prefix = self._echo_text(job) if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            # The output's offsets count from the end of the echoed text, as when streamed.
            logprobs = protocol.completion_logprobs(entries, ids, self._token_text, len(prefix))
            if body.echo:
                echoed = protocol.completion_logprobs(
                    _prompt_entries(job, prompt_logprobs), job.prompt_ids, self._token_text, 0
                )
                logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
        return {
            "index": job.index,
            "text": prefix + text,
            "logprobs": logprobs,
            "finish_reason": _finish_reason(job, c.last),
        }

    def _echo_text(self, job: _Job) -> str:
        if job.prompt_text is not None:
            return job.prompt_text
        tokenizer = self._engine.tokenizer
        return tokenizer.decode(job.prompt_ids, skip_special_tokens=True) if tokenizer else ""

    async def _completion_events(self, head, jobs, pumps: _Pumps, body, include_usage: bool):
        head = {**head}
        offsets = [0] * len(jobs)
        outputs = [0] * len(jobs)
        echoed = [not body.echo] * len(jobs)
        # Every choice's first output is in by now (_Pumps.first_outputs), so each choice's
        # echo can carry its prompt's logprobs, which came with its prompt's first sample.
        prompt_logprobs = {i: out.prompt_logprobs for i, out in pumps.firsts.items()}
        try:
            async for index, out in pumps:
                _fail_if_error(out)
                job = jobs[index]
                if not echoed[index]:  # the prompt first; its logprobs come with the first output
                    echoed[index] = True
                    text = self._echo_text(job)
                    lp = None
                    if body.logprobs is not None:
                        entries = _prompt_entries(job, prompt_logprobs[_first_sample(job)])
                        lp = protocol.completion_logprobs(
                            entries, job.prompt_ids, self._token_text, 0
                        )
                    offsets[index] = len(text)
                    yield _chunk(head, include_usage, _text_choice(index, text, lp, None))
                if job.scoring_only:
                    if out.finished:
                        choice = _text_choice(index, "", None, _finish_reason(job, out))
                        yield _chunk(head, include_usage, choice)
                    continue
                lp = None
                if body.logprobs is not None and out.logprobs:
                    lp = protocol.completion_logprobs(
                        out.logprobs, out.new_token_ids, self._token_text, offsets[index]
                    )
                offsets[index] += len(out.text_delta)
                outputs[index] = out.num_output_tokens
                if out.text_delta or lp or out.finished:
                    choice = _text_choice(index, out.text_delta, lp, out.finish_reason)
                    yield _chunk(head, include_usage, choice)
            if include_usage:
                usage = self._stream_usage(jobs, outputs, pumps.firsts)
                yield {**head, "choices": [], "usage": usage}
        finally:
            await pumps.close()

    async def _chat_events(self, head, jobs, pumps: _Pumps, include_usage: bool):
        head = {**head, "object": "chat.completion.chunk"}
        outputs = [0] * len(jobs)
        try:
            for job in jobs:  # the role first, as OpenAI's stream does
                delta = {"role": "assistant", "content": ""}
                yield _chunk(head, include_usage, _delta_choice(job.index, delta, None, None))
            async for index, out in pumps:
                _fail_if_error(out)
                lp = None
                if out.logprobs:
                    lp = protocol.chat_logprobs(out.logprobs, self._token_text)
                outputs[index] = out.num_output_tokens
                if out.text_delta or lp or out.finished:
                    delta = {"content": out.text_delta} if out.text_delta else {}
                    choice = _delta_choice(index, delta, lp, out.finish_reason)
                    yield _chunk(head, include_usage, choice)
            if include_usage:
                usage = self._stream_usage(jobs, outputs, pumps.firsts)
                yield {**head, "choices": [], "usage": usage}
        finally:
            await pumps.close()

    def _stream_usage(
        self, jobs: list[_Job], outputs: list[int], seen: dict[int, RequestOutput]
    ) -> dict:
        """Usage of a call; `seen` has an output of each choice (they all carry its number of
        cached prompt tokens)."""
        # A prompt's tokens count once, however many samples it has (as OpenAI counts them),
        # and so do its cached tokens: those of its first sample.
        firsts = [j for j in jobs if j.sample == 0]
        prompt = sum(len(j.prompt_ids) for j in firsts)
        cached = sum(seen[j.index].num_cached_tokens for j in firsts if j.index in seen)
        return protocol.usage(prompt, sum(outputs), cached)


# The optional sampling fields passed to SamplingParams when set (jaxserve/runtime/sampling.py
# applies
# them on the device).
_SUPPORTED_EXTRAS: tuple[str, ...] = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
)


class _Pumps:
    """The engine streams of one call, each pumped by a task into one queue of
    (choice index, RequestOutput) or (choice index, exception)."""

    def __init__(self, async_engine, jobs: list[_Job], priority: int):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffer: list[tuple[int, RequestOutput]] = []
        self.firsts: dict[int, RequestOutput] = {}  # each choice's first output
        self._open = len(jobs)
        rid = uuid.uuid4().hex[:16]
        self._tasks = [
            asyncio.ensure_future(
                self._pump(
                    job.index,
                    async_engine.generate(
                        job.prompt_ids,
                        job.params,
                        request_id=f"http-{rid}-{job.index}",
                        priority=priority,
                    ),
                )
            )
            for job in jobs
        ]

    async def _pump(self, index: int, stream) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    self._queue.put_nowait((index, out))
        except Exception as e:
            self._queue.put_nowait((index, e))

    async def first_outputs(self) -> None:
        """Waits for every stream's first output; raises the first error met."""
        seen: set[int] = set()
        while len(seen) < len(self._tasks):
            index, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            _fail_if_refused(item)  # refused before its first token: the call's status
            seen.add(index)
            self.firsts.setdefault(index, item)
            self._buffer.append((index, item))

    async def __aiter__(self):
        for index, out in self._buffer:
            if out.finished:
                self._open -= 1
            yield index, out
        self._buffer = []
        while self._open:
            index, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self._open -= 1
            yield index, item

    async def close(self) -> None:
        """Cancels the pumps left; closing their streams aborts their requests."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _add(choice: _Choice, out: RequestOutput) -> None:
    choice.token_ids += out.new_token_ids
    choice.text.append(out.text_delta)
    choice.logprobs += out.logprobs or []
    if out.prompt_logprobs is not None:
        choice.prompt_logprobs = out.prompt_logprobs
    choice.last = out


def _prompt_entries(job: _Job, entries: list[TokenLogprob | None] | None) -> list:
    """The prompt's logprob entries (None for the first token; all None if none came back, as
    for a request that ended before its prompt was computed)."""
    return list(entries) if entries is not None else [None] * len(job.prompt_ids)


def _first_sample(job: _Job) -> int:
    """The choice index of sample 0 of `job`'s prompt (a prompt's samples are consecutive)."""
    return job.index - job.sample


def _finish_reason(job: _Job, out: RequestOutput) -> str | None:
    # Scoring only: the token sampled past the prompt is not shown, so the output stopped at
    # its length (0), whatever ended the engine's request.
    if job.scoring_only and out.finish_reason not in (None, "abort", "error"):
        return "length"
    return out.finish_reason


def _fail_if_error(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise HttpError(500, out.error or "The request failed.", "internal_error")
    _fail_if_refused(out)


def _fail_if_refused(out: RequestOutput) -> None:
    """A request the engine refused under load (--shed-late: its predicted TTFT, shown, misses
    the target) ends the call with 429, as a full queue does (gRPC: RESOURCE_EXHAUSTED)."""
    if out.finish_reason == "refused":
        raise HttpError(429, out.error or "Refused under load.", "rate_limit")


def _chunk(head: dict, include_usage: bool, choice: dict) -> dict:
    chunk = {**head, "choices": [choice]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def _text_choice(index, text, logprobs, finish_reason) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _delta_choice(index, delta, logprobs, finish_reason) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidRequest(
                f"logit_bias key {key!r} is not a token id (an integer).", "logit_bias"
            ) from None
    return out


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _at(data, parts: list[str]):
    """The value at a pydantic location in the parsed body (None if it is not there)."""
    for part in parts:
        if isinstance(data, dict):
            data = data.get(part)
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return None
    return data


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
