"""The checks every front end runs on a request before it reaches the engine thread.

gRPC (service/grpc/convert.py) and the OpenAI-compatible HTTP API (service/http/) both call these,
so a bad value is refused with the same sentence whichever way it came: each check raises
`InvalidRequest` naming the field (as the caller's protocol spells it) and the value. A bad
request costs the engine nothing and the client learns exactly what to fix. `SamplingParams`
keeps the final word on sampling values (its own messages name them too); the checks here are
the ones that need the model: the vocabulary, the context length, the tokenizer. They read the
model only through the engine's `EngineInfo` (jaxserve/engine/info.py), plain values fixed at
start-up, so they run on any thread and a test can hand them a made-up one.

Text is refused before it is tokenized when it has more bytes than any prompt that fits the
context could have (`PromptLimit`): tokenizing megabytes only to learn they do not fit would
cost seconds of CPU that other requests need.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jaxserve.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_K,
    SamplingParams,
)
from jaxserve.structured_output import StructuredOutput

if TYPE_CHECKING:
    from jaxserve.engine.info import EngineInfo

DEFAULT_MAX_TOKENS = next(
    f.default for f in dataclasses.fields(SamplingParams) if f.name == "max_tokens"
)
MAX_REQUEST_ID_CHARS = 128
# Request priority: lower runs first (vLLM's convention), 0 by default. The range is gRPC's int32
# field's, on both front ends. Unless the operator lets clients raise it
# (--clients-may-raise-priority), a client may only lower its own: values below 0 are refused,
# since any client could otherwise preempt everyone else's requests.
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1
_LEADING_FIELD = re.compile(r"^(\w+)[=[ ]")


class InvalidRequest(ValueError):
    """The client's request cannot run as sent (gRPC INVALID_ARGUMENT, HTTP 400).

    `param` names the field at fault when one is (OpenAI's error body carries it).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def short(text: str, limit: int = 40) -> str:
    """repr() of a text, cut to `limit` characters: messages quote values, not megabytes."""
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
                "bytes each for this tokenizer).",
                field,
            )


def prompt_limit(tokenizer, max_model_len: int) -> PromptLimit:
    """The PromptLimit of a tokenizer's vocabulary (a few ms for 150k tokens) and a context."""
    if tokenizer is None:  # text is refused anyway; only token ids can be sent
        return PromptLimit(max_model_len, 1)
    ids = list(range(len(tokenizer)))
    # Both forms, since each can be the longer: the vocabulary's own strings ('▁the', 'Ġthe',
    # '<0xE3>') and what a token decodes to alone (special tokens such as '<|endoftext|>').
    pieces = [*tokenizer.convert_ids_to_tokens(ids), *tokenizer.batch_decode([[i] for i in ids])]
    longest = max((len(p.encode("utf-8", "surrogatepass")) for p in pieces if p), default=1)
    return PromptLimit(max_model_len, max(longest, 4))  # 4: any one character fits


def model_name(info: EngineInfo) -> str:
    """The served model's name, as clients see it: its folder's ("stories260k"). Messages to
    clients name the model by it, never by the server's path to its files."""
    return pathlib.PurePath(info.model).name or "jaxserve"


def check_text(field: str, text: str, info: EngineInfo, limit: PromptLimit) -> None:
    """Raises InvalidRequest for a text that is empty, cannot be tokenized, or cannot fit."""
    if not text:
        raise InvalidRequest(f"{field}='' is empty: send some text.", field)
    if not info.has_tokenizer:
        raise InvalidRequest(
            f"{field}={short(text)} cannot be tokenized: model {model_name(info)} "
            "has no tokenizer; send token ids instead.",
            field,
        )
    limit.check(field, text)


def check_priority(field: str, priority: int, clients_may_raise: bool) -> int:
    """The request's priority, checked: an integer in [MIN_PRIORITY, MAX_PRIORITY], and not
    below 0 unless the server lets clients raise theirs."""
    low = MIN_PRIORITY if clients_may_raise else 0
    if type(priority) is int and low <= priority <= MAX_PRIORITY:
        return priority
    why = ""
    if type(priority) is int and MIN_PRIORITY <= priority < 0:
        why = (
            ": lower values run first, and this server lets clients only lower their own "
            "priority (0, the default, is the most a client may ask for; the operator allows "
            "negative values with --clients-may-raise-priority)"
        )
    raise InvalidRequest(f"{field}={priority!r} must be in [{low}, {MAX_PRIORITY}]{why}.", field)


def check_vocab(field: str, ids: Sequence[int], vocab_size: int) -> None:
    """Raises InvalidRequest naming the first id outside [0, vocab_size)."""
    bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size]
    if bad:
        i, t = bad[0]
        raise InvalidRequest(
            f"{field}[{i}]={t} is outside the vocabulary [0, {vocab_size})"
            + (f" ({len(bad)} ids are)." if len(bad) > 1 else "."),
            field,
        )


def check_token_ids(field: str, ids: Sequence[int], info: EngineInfo) -> None:
    """Raises InvalidRequest for a token-id prompt that is empty or leaves the vocabulary."""
    if not ids:
        raise InvalidRequest(f"{field}=[] is empty: send at least one token id.", field)
    check_vocab(field, ids, info.vocab_size)


def check_prompt_fits(
    what: str, ids: Sequence[int], info: EngineInfo, field: str | None = None
) -> None:
    """Raises InvalidRequest when the prompt leaves no room for an output token.

    `what` says which prompt it was in the message (e.g. "text='Once upon'", "token_ids").
    """
    context = info.max_model_len
    if len(ids) >= context:
        raise InvalidRequest(
            f"The prompt ({what}) has {len(ids)} tokens, beyond the context: max_model_len="
            f"{context} tokens must hold the prompt and at least one output token.",
            field,
        )


def check_request_id(field: str, rid: str) -> str | None:
    """The client's request id if it sent one, checked for length."""
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"{field}={short(rid)} has {len(rid)} characters; at most "
            f"{MAX_REQUEST_ID_CHARS} allowed.",
            field,
        )
    return rid or None


def sampling_params(
    fields: Mapping[str, Any],
    *,
    num_prompt_tokens: int,
    info: EngineInfo,
    prefix: str = "",
) -> SamplingParams:
    """SamplingParams from the fields a client set (absent ones take the defaults).

    `fields` maps SamplingParams names to values; `prefix` is how the caller's protocol reaches
    them ("sampling." over gRPC, "" over HTTP), so messages name the field as the client wrote
    it. max_tokens defaults to what the context leaves room for, at most the usual default.
    """
    kwargs = dict(fields)
    context = info.max_model_len
    room = context - num_prompt_tokens
    max_tokens = kwargs.get("max_tokens")
    if max_tokens is None:
        kwargs["max_tokens"] = min(DEFAULT_MAX_TOKENS, room)
    elif isinstance(max_tokens, int) and max_tokens > room:
        raise InvalidRequest(
            f"{prefix}max_tokens={max_tokens} is beyond the context: the prompt's "
            f"{num_prompt_tokens} tokens leave room for {room} (max_model_len={context}).",
            f"{prefix}max_tokens",
        )
    stop = kwargs.get("stop", ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > MAX_STOP_STRINGS:  # checked before the strings are looked at
        raise InvalidRequest(
            f"{prefix}stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} allowed.",
            f"{prefix}stop",
        )
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS:
            value, size = (short(s), len(s)) if isinstance(s, str) else (repr(s), "no")
            raise InvalidRequest(
                f"{prefix}stop[{i}]={value} has {size} characters; it must have 1 to "
                f"{MAX_STOP_STRING_CHARS}.",
                f"{prefix}stop",
            )
    kwargs["stop"] = stop
    top_k = kwargs.get("top_k")
    if type(top_k) is int and top_k > MAX_TOP_K:
        raise InvalidRequest(
            f"{prefix}top_k={top_k} must be in [0, {MAX_TOP_K}] (0 turns top-k off, as does "
            f"any value from the vocabulary's size, {info.vocab_size}, up).",
            f"{prefix}top_k",
        )
    vocab = info.vocab_size
    check_vocab(f"{prefix}stop_token_ids", list(kwargs.get("stop_token_ids", ())), vocab)
    check_vocab(f"{prefix}logit_bias", [int(t) for t in kwargs.get("logit_bias", {})], vocab)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        named = _LEADING_FIELD.match(str(e))
        param = prefix + named.group(1) if named else None
        raise InvalidRequest(f"Invalid sampling: {e}", param) from e


def structured_output(spec: Mapping[str, Any] | None, field: str) -> StructuredOutput | None:
    """The constraint of vLLM's `structured_outputs` object ({"json": schema}, {"regex": ...},
    {"choice": [...]}, {"grammar": ...}, {"json_object": true}) as sent in `field`; None when
    absent. A bad schema, regex or grammar is refused naming `field` and the problem."""
    if spec is None:
        return None
    try:
        return StructuredOutput.from_dict(dict(spec))
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"{field} cannot be used: {e}", field) from None


def response_format(
    kind: str, schema: Any = None, field: str = "response_format"
) -> StructuredOutput | None:
    """OpenAI's `response_format`: "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" with its schema. OpenAI's `strict` changes nothing here: a schema is always
    enforced, every keyword or none (an unsupported one is refused, never ignored)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise InvalidRequest(
            f"{field}.type={kind!r} must be one of 'text', 'json_object', 'json_schema'.",
            f"{field}.type",
        )
    if schema is None:
        raise InvalidRequest(
            f"{field}.type='json_schema' needs {field}.json_schema.schema, the JSON schema.",
            f"{field}.json_schema",
        )
    return structured_output({"json": schema}, f"{field}.json_schema.schema")
