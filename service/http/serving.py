"""Shared request building of the OpenAI-compatible API: from a request body to engine requests.

`OpenAIServing` is what /v1/completions (completions.py) and /v1/chat/completions (chat.py)
have in common, after vLLM's serving_engine.py: the body read within the size limit (413
before reading when Content-Length says it is too large, else as soon as the bytes pass the
limit), parsed (body.py: bounded nesting and values; a large body on the parser threads, so it
never holds the event loop) and typed by pydantic (strict types; a bad field is named with its
value), the SamplingParams fields the client set, checked by service/validation.py (the checks
gRPC runs, so an error reads alike over both) before `n` expands them, one `Job` per (prompt,
sample) with its seed, chat messages rendered and tokenized on the server's tokenizer threads,
and the texts responses show (the model's name, an echoed prompt, logprob tokens in context).

It reads the engine only through `AsyncEngine.info` (plain values fixed at start-up) and its
tokenizer, never the engine thread's state. Everything else runs on the server's event loop.
"""

from __future__ import annotations

import dataclasses
import json
import reprlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pydantic
from fastapi import Request
from starlette.requests import ClientDisconnect

from jaxserve.sampling_params import MAX_LOGIT_BIAS, SEED_LIMIT, SamplingParams
from jaxserve.structured_output import StructuredOutput
from service import validation
from service.http import body as json_body
from service.http import protocol
from service.http.token_texts import TokenTexts
from service.lifecycle import Lifecycle
from service.validation import InvalidRequest

if TYPE_CHECKING:
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.info import EngineInfo

MAX_N = 16  # samples per prompt: each is a request of its own in the waiting queue
MAX_PROMPTS = 64  # prompts per /v1/completions call
DEFAULT_MAX_BODY_BYTES = 16 << 20  # ServerOptions.max_message_bytes, --max-message-bytes
# A body up to this size is parsed and typed on the event loop (a few ms at most); a larger one
# on the parser threads.
ON_LOOP_BYTES = 16 << 10
# The values a body may hold beyond its prompts' token ids: the other fields (stop strings,
# logit_bias, messages and their parts) with room to spare.
OTHER_VALUES = 1 << 16
_MESSAGE_SLICE = 512  # chat messages typed by one call of pydantic (which holds the GIL)
_MESSAGES = pydantic.TypeAdapter(list[protocol.ChatMessage])

# The optional sampling fields passed to SamplingParams when set (jaxserve/runtime/sampling.py
# applies them on the device).
_SUPPORTED_EXTRAS: tuple[str, ...] = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "logprobs_mode",
)


class HttpError(Exception):
    """A call that ends with this status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code


class ClientGone(Exception):
    """The client disconnected before the response began (while sending its body, or while
    its call waited): nobody reads an answer, and it is counted as 499, not as an error."""


@dataclasses.dataclass
class Job:
    """One engine request of a call: choice `index` of the response."""

    index: int
    sample: int  # which of the prompt's n samples
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None  # for echo
    # echo with max_tokens=0: the prompt scored, nothing generated. The engine samples one token
    # anyway (in the step that ends the prompt, so it costs no extra step); it is not shown.
    scoring_only: bool = False
    lora: str | None = None  # the LoRA adapter the body's `model` named; None: the base model


def span_fields(sampling: dict) -> dict:
    """The sampling fields a call's span names, as the body set them: for a beam search, which
    runs no jobs whose SamplingParams would say."""
    return {k: sampling.get(k) for k in ("max_tokens", "temperature", "top_p", "seed")}


def include_usage(body: protocol._Sampling) -> bool:
    """Whether a streamed response ends with a usage chunk (`stream_options.include_usage`)."""
    return body.stream_options is not None and body.stream_options.include_usage


class OpenAIServing:
    """The parts of serving a request that completions and chat share, over the lifecycle."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        clients_may_raise_priority: bool = False,
        chat_template: str | None = None,
        served_model_names: Sequence[str] = (),
    ):
        self.lifecycle = lifecycle
        self.max_body_bytes = max_body_bytes
        self.clients_may_raise_priority = clients_may_raise_priority
        # Renders chat in place of the tokenizer's own template (`serve --chat-template`).
        self.chat_template = chat_template
        # `serve --served-model-name`: the names the base model answers to, the first the one
        # it is known by; none given: its folder's name, and any name a body sends.
        self.served_model_names = tuple(served_model_names)

    @property
    def engine(self) -> AsyncEngine:
        """The server's engine (set once warm: calls are admitted only after that)."""
        return self.lifecycle.engine

    @property
    def info(self) -> EngineInfo:
        """The engine's model and limits, as the checks read them."""
        return self.engine.info

    def model_names(self) -> tuple[str, ...]:
        """The names the base model is served under (`--served-model-name`), else its folder's
        name ("stories260k")."""
        return self.served_model_names or (validation.model_name(self.info),)

    def model_id(self) -> str:
        """The served model's name: the first of `model_names()`."""
        return self.model_names()[0]

    def requested_model(self, body: protocol._Sampling) -> str:
        """The model a body names (a span's gen_ai.request.model), else the served model's."""
        return body.model if body.model is not None else self.model_id()

    def head(self, call_id: str, object_: str, model: str | None = None) -> dict:
        """The fields every response (and every chunk of a stream) of a call starts with; its
        model is the name the body's `model` gave (a served name or a LoRA adapter's, checked
        by `adapter`), else the served model's."""
        named = model is not None and (model in self.model_names() or self.adapter(model))
        return {
            "id": call_id,
            "object": object_,
            "created": protocol.now(),
            "model": model if named else self.model_id(),
        }

    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a body's `model` names (None: the base model, by one of its served
        names). With `--served-model-name` given or adapters served, any other name is a 404,
        as vLLM's ("The model `x` does not exist."); without either, any name is the one
        model (as before either existed, and as clients that send a placeholder expect)."""
        if model is None or model in self.model_names():
            return None
        loaded = [name for name, _ in self.engine.lora_adapters()] if self.info.max_loras else []
        if model in loaded:
            return model
        if not self.served_model_names and not self.info.max_loras:
            return None
        adapters = f" and the LoRA adapters {loaded}" if self.info.max_loras else ""
        raise HttpError(
            404,
            f"The model {validation.short(model)} does not exist; this server serves "
            f"{list(self.model_names())}{adapters}.",
            "invalid_request_error",
            "model",
            "model_not_found",
        )

    def token_texts(self, context: Sequence[int] = ()) -> TokenTexts:
        """Logprob tokens' texts of a sequence after `context` (token_texts.py)."""
        return TokenTexts(self.engine.tokenizer, context)

    def priority(self, body: protocol._Sampling) -> int:
        """The body's priority, checked (validation.check_priority)."""
        return validation.check_priority("priority", body.priority, self.clients_may_raise_priority)

    def echo_text(self, prompt_ids: list[int], prompt_text: str | None) -> str:
        """A prompt's text as `echo` puts it first: as sent, or its token ids decoded."""
        if prompt_text is not None:
            return prompt_text
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(prompt_ids, skip_special_tokens=True) if tokenizer else ""

    async def read_body(self, request: Request) -> bytes:
        """The request's body; HttpError 413 when it is larger than the limit (at once when its
        Content-Length says so; else as soon as the bytes received pass it), ClientGone when
        the client hangs up before sending it all."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
            raise _too_large(f"has {declared} bytes (its Content-Length)", limit)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(f"has more than {limit} bytes", limit)
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone from None
        return b"".join(chunks)

    async def parse(self, request: Request, model: type[pydantic.BaseModel]):
        """The body as `model`; InvalidRequest naming the field and value at fault."""
        raw = await self.read_body(request)
        max_values = MAX_PROMPTS * self.info.max_model_len + OTHER_VALUES
        if len(raw) <= ON_LOOP_BYTES:
            return _typed(raw, model, max_values)
        return await self.lifecycle.parse_off_loop(_typed, raw, model, max_values)

    def sampling_fields(self, body: protocol._Sampling, max_tokens: int | None) -> dict:
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
        spec = structured_output(body)
        if spec is not None:
            fields["structured_output"] = spec
        return fields

    def jobs(self, prompts, body: protocol._Sampling, sampling: dict, fields: dict) -> list[Job]:
        """One engine request per (prompt, sample), in OpenAI's choice order.

        The seed rule for n > 1: sample i of a request with seed s runs with seed
        (s + i) mod 2**32, so it equals the single-sample request sent with that seed.
        """
        if not 1 <= body.n <= MAX_N:
            raise InvalidRequest(f"n={body.n} must be in [1, {MAX_N}].", "n")
        if body.user is not None:
            fields["user"] = body.user
        # Every field as sent is checked first: the seeds of the n samples below are taken
        # modulo 2**32, which would turn a seed out of range into one that runs.
        validation.sampling_params(sampling, num_prompt_tokens=len(prompts[0][0]), info=self.info)
        lora = self.adapter(body.model)
        jobs = []
        for ids, text in prompts:
            for i in range(body.n):
                sample = dict(sampling)
                if body.n > 1 and body.seed is not None:
                    sample["seed"] = (body.seed + i) % SEED_LIMIT
                params = validation.sampling_params(
                    sample, num_prompt_tokens=len(ids), info=self.info
                )
                jobs.append(Job(len(jobs), i, ids, params, text, lora=lora))
        return jobs

    async def chat_ids(
        self,
        messages: Sequence[protocol.ChatMessage],
        add_prompt: bool,
        tools: list[dict] | None = None,
    ):
        """The token ids of chat messages rendered by the server's chat template, else the
        model's (with the functions `tools` offers, where the call has them)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequest(
                f"Model {self.model_id()} has no tokenizer, so chat messages cannot be "
                "rendered; use /v1/completions with prompt token ids instead.",
                "messages",
            )
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequest(
                f"Model {self.model_id()} has no chat template, so chat messages cannot be "
                "rendered; use /v1/completions with a prompt instead, or start the server "
                "with --chat-template.",
                "messages",
            )
        limit = self.lifecycle.prompt_limit
        texts = [m.text() for m in messages]
        for i, text in enumerate(texts):
            limit.check(f"messages[{i}].content", text)
        # All of them become one prompt: together they must fit too (before rendering them).
        limit.check(f"messages (all {len(texts)} of them)", "".join(texts))
        rendered = [_rendered(m, t) for m, t in zip(messages, texts, strict=True)]

        def render() -> list[int]:
            text = tokenizer.apply_chat_template(
                rendered,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_prompt,
                chat_template=template,
            )
            # The template writes the special tokens (BOS included) itself.
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        try:
            return await self.lifecycle.off_loop(render)
        except Exception as e:  # a template that raises on these messages (e.g. roles order)
            raise InvalidRequest(f"The chat template refused the messages: {e}", "messages") from e


def _rendered(message: protocol.ChatMessage, text: str) -> dict:
    """A message as chat templates take it: role and content, and an assistant's tool calls
    (arguments as objects, as Hermes / Qwen templates write them) or a tool's call id."""
    out = {"role": message.role, "content": text}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "type": "function",
                "id": c.id,
                "function": {
                    "name": c.function.name,
                    "arguments": _arguments(c.function.arguments),
                },
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def structured_output(body: protocol._Sampling) -> StructuredOutput | None:
    """The call's constraint: vLLM's structured_outputs or OpenAI's response_format (one)."""
    fmt = body.response_format
    if body.structured_outputs is not None:
        if fmt is not None and fmt.type != "text":
            raise InvalidRequest(
                "Send response_format or structured_outputs, not both.", "structured_outputs"
            )
        return validation.structured_output(body.structured_outputs, "structured_outputs")
    if fmt is None:
        return None
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    return validation.response_format(fmt.type, schema)


def _too_large(what: str, limit: int) -> HttpError:
    return HttpError(
        413,
        f"The request body {what}; this server accepts at most {limit} bytes "
        "(--max-message-bytes).",
        "invalid_request_error",
        code="request_too_large",
    )


def _typed(raw: bytes, model: type[pydantic.BaseModel], max_values: int):
    """The body's bytes as `model`: parsed (body.py), then typed; on the event loop for a
    small body, else on a parser thread, where every step holds the GIL for a bounded time."""
    data = json_body.decode(raw, max_values)
    json_body.find_lone_surrogate(raw, data)
    if isinstance(data, dict):
        data = _typed_in_slices(data)
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise _invalid(e.errors()[0], data) from None


def _typed_in_slices(data: dict) -> dict:
    """The fields that can hold many values, checked before pydantic types the body: a
    logit_bias of 870k ids is refused by its length, and many chat messages are typed a slice
    at a time (one pydantic call holds the GIL for as long as it runs)."""
    bias = data.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"logit_bias has {len(bias)} tokens; at most {MAX_LOGIT_BIAS} allowed.", "logit_bias"
        )
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > _MESSAGE_SLICE:
        typed = []
        for start in range(0, len(messages), _MESSAGE_SLICE):
            try:
                typed += _MESSAGES.validate_python(messages[start : start + _MESSAGE_SLICE])
            except pydantic.ValidationError as e:
                first = e.errors()[0]
                where = ("messages", start + first["loc"][0], *first["loc"][1:])
                raise _invalid({**first, "loc": where}, data) from None
        data = {**data, "messages": typed}
    return data


def _invalid(error: dict, data) -> InvalidRequest:
    """InvalidRequest for pydantic's first error, naming the field and the value sent."""
    # A union's error names the member tried ("prompt.str"): the client wrote "prompt".
    parts = [str(p) for p in error["loc"] if not _is_type_tag(p)]
    loc = ".".join(parts)
    value = _at(data, parts)
    return InvalidRequest(
        f"{loc}={_short(value)} is not valid: {error['msg']}." if loc else f"{error['msg']}.",
        loc or None,
    )


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidRequest(
                f"logit_bias key {validation.short(key)} is not a token id (an integer).",
                "logit_bias",
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


# Values quoted in messages: short, and shallow (a body may nest MAX_DEPTH levels).
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 3, 6, 4
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 57


def _short(value) -> str:
    return _REPR.repr(value)
