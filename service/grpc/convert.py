"""Between the wire and the engine: checked GenerateRequests in, GenerateResponses out.

The checks themselves live in service/validation.py, shared with the HTTP front end, so a bad
value reads the same over both; this module reads them off the protobuf messages (fields named
as the proto spells them: `text`, `token_ids.ids`, `sampling.max_tokens`) and writes responses.

Protobuf refuses a string field holding malformed UTF-8 while parsing, before any handler runs
(gRPC would answer INTERNAL). `lenient()` deserializers turn that failure, and a message beyond
the server's size limit, into a `MalformedRequest` the handler answers with INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
)
from service import validation
from service.gen.jaxserve.v1 import jaxserve_pb2 as pb
from service.validation import (
    InvalidRequest,
    PromptLimit,
    check_prompt_fits,
    check_request_id,
    check_text,
    check_token_ids,
    short,
)

if TYPE_CHECKING:
    from jaxserve.engine.info import EngineInfo

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
_SAMPLING_OPTIONALS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "beam_width",
    "length_penalty",
    "logprobs_mode",
)


@dataclasses.dataclass(frozen=True)
class MalformedRequest:
    """What a lenient deserializer returns for bytes protobuf refuses to parse."""

    message: str


def prompt_text(request: pb.GenerateRequest, info: EngineInfo, limit: PromptLimit) -> str | None:
    """The request's text prompt, checked to be worth tokenizing; None for a token-id prompt."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("The request has no prompt: set text or token_ids.", "prompt")
    if kind != "text":
        return None
    check_text("text", request.text, info, limit)
    return request.text


def prompt_ids(
    request: pb.GenerateRequest, info: EngineInfo, text_ids: list[int] | None
) -> list[int]:
    """The prompt's token ids (`text_ids`: its text's, tokenized), checked against the
    vocabulary and the context."""
    if text_ids is not None:
        ids, what, field = text_ids, f"text={short(request.text)}", "text"
    else:
        ids, what, field = list(request.token_ids.ids), "token_ids", "token_ids.ids"
        check_token_ids(field, ids, info)
    check_prompt_fits(what, ids, info, field)
    return ids


def request_id(request: pb.GenerateRequest) -> str | None:
    """The client's request id, if it sent one."""
    return check_request_id("request_id", request.request_id)


def sampling_params(
    options: pb.SamplingOptions, num_prompt_tokens: int, info: EngineInfo
) -> SamplingParams:
    """SamplingParams of the request; unset fields take the engine's defaults."""
    fields = {
        name: getattr(options, name) for name in _SAMPLING_OPTIONALS if options.HasField(name)
    }
    if options.HasField("max_tokens"):
        fields["max_tokens"] = options.max_tokens
    if options.HasField("structured_output"):
        fields["structured_output"] = structured_output(options.structured_output)
    return validation.sampling_params(
        dict(
            fields,
            stop=tuple(options.stop),
            stop_token_ids=tuple(options.stop_token_ids),
            ignore_eos=options.ignore_eos,
            logit_bias=dict(options.logit_bias),
        ),
        num_prompt_tokens=num_prompt_tokens,
        info=info,
        prefix="sampling.",
    )


def structured_output(spec: pb.StructuredOutput):
    """The constraint of a SamplingOptions.structured_output, checked (INVALID_ARGUMENT naming
    the field and the problem)."""
    kind = spec.WhichOneof("kind")
    field = f"sampling.structured_output.{kind}"
    if kind is None:
        raise validation.InvalidRequest(
            "sampling.structured_output is set but empty: set one of json_schema, json_object, "
            "regex, choice, grammar.",
            "sampling.structured_output",
        )
    value = getattr(spec, kind)
    as_dict = {
        "json_schema": {"json": value},
        "json_object": {"json_object": value},
        "regex": {"regex": value},
        "choice": {"choice": list(value.choices) if kind == "choice" else None},
        "grammar": {"grammar": value},
    }[kind]
    return validation.structured_output(as_dict, field)


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
        msg.usage.cached_prompt_tokens = out.num_cached_tokens
        m = out.metrics
        msg.timings.queue_wait_s = m.queue_wait or 0.0
        msg.timings.ttft_s = m.ttft or 0.0
        msg.timings.e2e_s = m.e2e or 0.0
        if out.error:
            msg.error = out.error
        for beam in getattr(out, "beams", None) or []:  # a BeamSearchOutput's
            msg.beams.add(
                token_ids=beam.token_ids,
                text=beam.text,
                cumulative_logprob=beam.cumulative_logprob,
                score=beam.score,
                finish_reason=FINISH_REASONS.get(beam.finish_reason, pb.FINISH_REASON_ERROR),
            )
    return msg


def model_info(info: EngineInfo, served_model_names: Sequence[str] = ()) -> pb.ModelInfo:
    """GetModelInfo's answer: the engine's description, the names it is served under, and the
    limits a request must keep."""
    return pb.ModelInfo(
        model=info.model,
        served_model_names=list(served_model_names),
        architecture=info.architecture,
        context_length=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        dtype=info.dtype,
        limits=pb.EngineLimits(
            max_num_seqs=info.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
            max_waiting_requests=info.max_waiting_requests,
            num_kv_pages=info.num_pages,
            page_size=info.page_size,
            max_stop_strings=MAX_STOP_STRINGS,
            max_stop_string_chars=MAX_STOP_STRING_CHARS,
            max_logprobs=MAX_LOGPROBS,
            policy=info.policy,
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
