"""The OpenAI API's request bodies as pydantic models, and its response bodies as dicts.

The models check types only, strictly (a string, a boolean or 2.5 where an integer belongs is
refused, not read as a number; an integer is a number), and an unknown role; value checks
(temperature >= 0, max_tokens within the context, token ids in the vocabulary) are left to
service/validation.py, so that they read the same over gRPC and HTTP. Unknown fields are
ignored, as OpenAI's and vLLM's servers do: clients such as LangChain send fields that change
nothing here.

Field names and meanings follow OpenAI's API reference for /v1/completions and
/v1/chat/completions, plus the extra sampling fields vLLM accepts (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, return_token_ids,
and beam search's use_beam_search, length_penalty, early_stopping and best_of on both endpoints).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.outputs import TokenLogprob

if TYPE_CHECKING:
    from service.http.token_texts import TokenTexts


class _Body(BaseModel):
    # strict: `max_tokens: true` is not 1, nor `"n": "2"` 2 (pydantic's lax mode read them so)
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """response_format.json_schema: a named schema (`strict` is accepted; every schema is
    enforced strictly)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: text, json_object (any JSON object) or json_schema."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    """Fields both endpoints share: how to sample and when to stop."""

    # One of the base model's served names or a LoRA adapter's (see /v1/models); with neither
    # --served-model-name nor adapters, any name is served by the one model.
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and logged, as OpenAI does
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    # Beam search, as vLLM's API had it: the width is best_of if given, else n; the best n beams
    # are the choices (beams.py's beam_width has the rules).
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None  # only true (or absent): the search stops early
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs ({"json": ...},
    # {"regex": ...}, {"choice": [...]}, {"grammar": ...}); service/validation.py reads both.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: the prompt's token ids and the generated ones beside the text (`prompt_token_ids`
    # and `token_ids`; streamed, the prompt's in a choice's first chunk, each chunk's own).
    return_token_ids: bool = False
    # jaxserve's: which distribution `logprobs` are of, "raw" (the default, OpenAI's meaning) or
    # "processed" (after the temperature and top-k/top-p/min-p: vLLM's processed_logprobs).
    logprobs_mode: str | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    # A text, token ids, or a list of either (mixed lists too: each is one prompt).
    prompt: str | list[int] | list[str | list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    """A call the assistant made, in a message sent back in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    """tool_choice naming one function: the output is a call of it."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    tools: list[Tool] | None = None
    # "none", "auto" (the default with tools), "required", or a named function (tools.py).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Body):
    """POST /tokenize: a text, or chat messages rendered with the chat template."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    tokens: list[int]


class LoadLoraRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's): a PEFT adapter folder, served as `lora_name`."""

    lora_name: str
    lora_path: str


class UnloadLoraRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: str


# ---- responses ----------------------------------------------------------------------------


class ResponseNotJson(RuntimeError):
    """A response the server built holds a value that JSON cannot carry (NaN, Infinity): a bug
    in the server, answered 500 and logged, never the client's 400."""


def dumps(body: Any) -> str:
    """`body` as strict JSON text (RFC 8259: no NaN, Infinity or -Infinity), as every response
    and every server-sent event is written; `ResponseNotJson` naming the first such value."""
    try:
        return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError as e:
        where = _non_finite(body, "")
        raise ResponseNotJson(
            f"The response is not JSON (RFC 8259): {where or 'a value'} is not a finite number; "
            "this is a bug in the server."
        ) from e


def _non_finite(value: Any, path: str) -> str | None:
    """Where in `value` the first non-finite float is ("choices[0].logprobs...=-inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path or 'the body'}={value}"
    if isinstance(value, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for sub_path, sub in items:
        if (found := _non_finite(sub, sub_path)) is not None:
            return found
    return None


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens the prefix cache served."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(
    entries: Sequence[TokenLogprob | None],
    token_ids: Sequence[int],
    texts: TokenTexts,
    text_offset: int,
) -> dict:
    """/v1/completions' logprobs object for `token_ids` (entries[i] None: not known, e.g. the
    prompt's first token), each token's text in context (`texts`, which moves on past them):
    joined, `tokens` are the text, and offsets start at `text_offset` characters into it."""
    tokens, offsets, tops, offset = [], [], [], text_offset
    for entry, token_id in zip(entries, token_ids, strict=True):
        alternatives = entry.top if entry is not None else ()
        text, alt_texts = texts.step(token_id, [t for t, _ in alternatives])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            tops.append(None)
        else:
            top = texts.top(token_id, text, alternatives, alt_texts)
            tops.append({key: logprob for key, logprob, _ in top})
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict:
    """/v1/chat/completions' logprobs object: one entry per generated token, its text in
    context (`texts` moves on past them); `bytes` is the UTF-8 of what it adds to the text."""
    content = []
    for entry in entries:
        text, alt_texts = texts.step(entry.token_id, [t for t, _ in entry.top])
        top = texts.top(entry.token_id, text, entry.top, alt_texts)
        content.append(
            {
                "token": text,
                "logprob": entry.logprob,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": key, "logprob": logprob, "bytes": list(raw)}
                    for key, logprob, raw in top
                ],
            }
        )
    return {"content": content}


class UpdateWeightsFromDiskRequest(_Body):
    """POST /update_weights_from_disk (sglang's route and body, which RL trainers already send):
    a checkpoint folder to serve from the next step on (--allow-weight-updates)."""

    model_path: str
    # sglang's; the format is read from the folder (safetensors or orbax), so only "auto".
    load_format: str | None = None
