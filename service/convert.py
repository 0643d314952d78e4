"""Between the wire and the engine: checked GenerateRequests in, GenerateResponses out.

Every check raises `InvalidRequest` with a message naming the field and its value, before the
request reaches the engine thread, so a bad request costs the engine nothing and the client
learns exactly what to fix. `SamplingParams` keeps the final word on sampling values (its own
messages name them too); the checks here are the ones that need the model: the vocabulary, the
context length, the tokenizer.

Protobuf refuses a string field holding malformed UTF-8 while parsing, before any handler runs
(gRPC would answer INTERNAL). `lenient()` deserializers turn that failure, and a message beyond
the server's size limit, into a `MalformedRequest` the handler answers with INVALID_ARGUMENT.

Text is refused before it is tokenized when it has more bytes than any prompt that fits the
context could have (`PromptLimit`): tokenizing megabytes only to learn they do not fit would
cost seconds of CPU that other requests need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
)
from service.gen.jaxserve.v1 import jaxserve_pb2 as pb

DEFAULT_MAX_TOKENS = next(
    f.default for f in dataclasses.fields(SamplingParams) if f.name == "max_tokens"
)
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
MAX_REQUEST_ID_CHARS = 128
_SAMPLING_OPTIONALS = ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs")


class InvalidRequest(ValueError):
    """The client's request cannot run as sent (gRPC INVALID_ARGUMENT)."""


@dataclasses.dataclass(frozen=True)
class MalformedRequest:
    """What a lenient deserializer returns for bytes protobuf refuses to parse."""

    message: str


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


@dataclasses.dataclass(frozen=True)
class PromptLimit:
    """The most UTF-8 bytes a text that fits the context can have, worked out once at start-up.

    A prompt of n tokens covers at most n * (the longest token's bytes) bytes of text, so a text
    with more bytes than max_model_len * that has too many tokens, whatever they are. The bound
    is loose (about 10 KB per 1k tokens of context for common vocabularies) but costs nothing.
    A tokenizer whose normalizer deletes characters could, in principle, fit a longer text; such
    text is refused too.
    """

    max_model_len: int
    bytes_per_token: int  # the most bytes of text one token of the vocabulary stands for

    @property
    def max_bytes(self) -> int:
        return self.max_model_len * self.bytes_per_token

    def check(self, field: str, text: str) -> None:
        """Raises InvalidRequest if `text` has more bytes than any prompt that fits."""
        limit = self.max_bytes
        # len() counts characters, never more than the bytes: the common small text is
        # passed without encoding it, and a huge one is refused without encoding it either.
        if len(text) <= limit // 4:
            return
        size = len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise InvalidRequest(
                f"{field} has {size} bytes or more; at most {limit} bytes can fit the context "
                f"(max_model_len={self.max_model_len} tokens of at most {self.bytes_per_token} "
                "bytes each for this tokenizer)."
            )


def prompt_limit(engine) -> PromptLimit:
    """The engine's PromptLimit, from its tokenizer's vocabulary (a few ms for 150k tokens)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:  # text is refused anyway; only token ids can be sent
        return PromptLimit(engine.max_model_len, 1)
    ids = list(range(len(tokenizer)))
    # Both forms, since each can be the longer: the vocabulary's own strings ('▁the', 'Ġthe',
    # '<0xE3>') and what a token decodes to alone (special tokens such as '<|endoftext|>').
    pieces = [*tokenizer.convert_ids_to_tokens(ids), *tokenizer.batch_decode([[i] for i in ids])]
    longest = max((len(p.encode("utf-8", "surrogatepass")) for p in pieces if p), default=1)
    return PromptLimit(engine.max_model_len, max(longest, 4))  # 4: any one character fits


def prompt_text(request: pb.GenerateRequest, engine, limit: PromptLimit) -> str | None:
    """The request's text prompt, checked to be worth tokenizing; None for a token-id prompt."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("The request has no prompt: set text or token_ids.")
    if kind != "text":
        return None
    check_text("text", request.text, engine, limit)
    return request.text


def check_text(field: str, text: str, engine, limit: PromptLimit) -> None:
    """Raises InvalidRequest for a text that is empty, cannot be tokenized, or cannot fit."""
    if not text:
        raise InvalidRequest(f"{field}='' is empty: send some text.")
    if engine.tokenizer is None:
        raise InvalidRequest(
            f"{field}={_short(text)} cannot be tokenized: model {engine.model.source} "
            "has no tokenizer; send token ids instead."
        )
    limit.check(field, text)


def prompt_ids(request: pb.GenerateRequest, engine, text_ids: list[int] | None) -> list[int]:
    """The prompt's token ids (`text_ids`: its text's, tokenized), checked against the
    vocabulary and the context."""
    if text_ids is not None:
        ids = text_ids
        what = f"text={_short(request.text)}"
    else:
        ids = list(request.token_ids.ids)
        if not ids:
            raise InvalidRequest("token_ids.ids=[] is empty: send at least one token id.")
        check_vocab("token_ids.ids", ids, engine.model.config.vocab_size)
        what = "token_ids"
    context = engine.max_model_len
    if len(ids) >= context:
        raise InvalidRequest(
            f"The prompt ({what}) has {len(ids)} tokens, beyond the context: max_model_len="
            f"{context} tokens must hold the prompt and at least one output token."
        )
    return ids


def request_id(request: pb.GenerateRequest) -> str | None:
    """The client's request id, if it sent one."""
    rid = request.request_id
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"request_id={_short(rid)} has {len(rid)} characters; at most "
            f"{MAX_REQUEST_ID_CHARS} allowed."
        )
    return rid or None


def check_vocab(field: str, ids: list[int], vocab_size: int) -> None:
    bad = [(i, t) for i, t in enumerate(ids) if t >= vocab_size]
    if bad:
        i, t = bad[0]
        raise InvalidRequest(
            f"{field}[{i}]={t} is outside the vocabulary [0, {vocab_size})"
            + (f" ({len(bad)} ids are)." if len(bad) > 1 else ".")
        )


def sampling_params(options: pb.SamplingOptions, num_prompt_tokens: int, engine) -> SamplingParams:
    """SamplingParams of the request; unset fields take the engine's defaults."""
    context = engine.max_model_len
    room = context - num_prompt_tokens
    kwargs = {
        name: getattr(options, name) for name in _SAMPLING_OPTIONALS if options.HasField(name)
    }
    if options.HasField("max_tokens"):
        if options.max_tokens > room:
            raise InvalidRequest(
                f"sampling.max_tokens={options.max_tokens} is beyond the context: the prompt's "
                f"{num_prompt_tokens} tokens leave room for {room} (max_model_len={context})."
            )
        kwargs["max_tokens"] = options.max_tokens
    else:
        kwargs["max_tokens"] = min(DEFAULT_MAX_TOKENS, room)
    if len(options.stop) > MAX_STOP_STRINGS:  # checked before the strings are copied
        raise InvalidRequest(
            f"sampling.stop has {len(options.stop)} strings; at most {MAX_STOP_STRINGS} allowed."
        )
    for i, s in enumerate(options.stop):
        if not 0 < len(s) <= MAX_STOP_STRING_CHARS:
            raise InvalidRequest(
                f"sampling.stop[{i}]={_short(s)} has {len(s)} characters; it must have 1 to "
                f"{MAX_STOP_STRING_CHARS}."
            )
    check_vocab(
        "sampling.stop_token_ids", list(options.stop_token_ids), engine.model.config.vocab_size
    )
    try:
        return SamplingParams(
            **kwargs,
            stop=tuple(options.stop),
            stop_token_ids=tuple(options.stop_token_ids),
            ignore_eos=options.ignore_eos,
        )
    except ValueError as e:
        raise InvalidRequest(f"Invalid sampling: {e}") from e


def response(
    out: RequestOutput, *, token_ids=None, text=None, logprobs=None
) -> pb.GenerateResponse:
    """The wire form of one output (or, for GenerateUnary, of the accumulated ones)."""
    msg = pb.GenerateResponse(
        request_id=out.request_id,
        token_ids=out.new_token_ids if token_ids is None else token_ids,
        text=out.text_delta if text is None else text,
    )
    for lp in (out.logprobs or []) if logprobs is None else logprobs:
        msg.logprobs.add(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
        )
    if out.finished:
        msg.finish_reason = FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_ERROR)
        msg.usage.prompt_tokens = out.num_prompt_tokens
        msg.usage.completion_tokens = out.num_output_tokens
        m = out.metrics
        msg.timings.queue_wait_s = m.queue_wait or 0.0
        msg.timings.ttft_s = m.ttft or 0.0
        msg.timings.e2e_s = m.e2e or 0.0
        if out.error:
            msg.error = out.error
    return msg


def model_info(engine) -> pb.ModelInfo:
    cfg, mc = engine.config, engine.model.config
    return pb.ModelInfo(
        model=str(engine.model.source),
        architecture=mc.architecture,
        context_length=engine.max_model_len,
        vocab_size=mc.vocab_size,
        eos_token_ids=list(mc.eos_token_ids),
        dtype=str(np.dtype(engine.model.dtype)),
        limits=pb.EngineLimits(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_waiting_requests=cfg.max_waiting_requests,
            num_kv_pages=engine.runner.config.num_pages,
            page_size=cfg.page_size,
            max_stop_strings=MAX_STOP_STRINGS,
            max_stop_string_chars=MAX_STOP_STRING_CHARS,
            max_logprobs=MAX_LOGPROBS,
            policy=cfg.policy,
        ),
    )


# ---- malformed requests -------------------------------------------------------------------


def lenient(
    message_cls: type[Message], max_bytes: int | None = None
) -> Callable[[bytes], Message | MalformedRequest]:
    """A request deserializer that reports unparsable or oversized bytes instead of failing
    the call (oversized: more than `max_bytes`, refused unparsed)."""

    def deserialize(data: bytes) -> Message | MalformedRequest:
        if max_bytes is not None and len(data) > max_bytes:
            return MalformedRequest(
                f"The {message_cls.__name__} message has {len(data)} bytes; the server accepts "
                f"at most {max_bytes} (--max-message-bytes)."
            )
        try:
            return message_cls.FromString(data)
        except DecodeError as e:
            found = _bad_utf8(message_cls.DESCRIPTOR, data, "")
            return MalformedRequest(
                found or f"The request is not a valid {message_cls.__name__}: {e}"
            )

    return deserialize


def _bad_utf8(descriptor: Descriptor, data: bytes, prefix: str) -> str | None:
    """Walks the protobuf wire format for a string field that is not UTF-8; names it."""
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                value, pos = data[pos : pos + size], pos + size
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                path = prefix + field.name
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError as e:
                        return f"{path}={value[:40]!r} is not valid UTF-8 (byte {e.start})."
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = _bad_utf8(field.message_type, value, path + ".")
                    if found:
                        return found
            else:
                return None
    except IndexError:
        return None
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
