"""Shared request building of the OpenAI-compatible API: from a request body to engine requests.

`OpenAIServing` is what /v1/completions (completions.py) and /v1/chat/completions (chat.py)
have in common, after vLLM's serving_engine.py: the body parsed (pydantic, types only; a bad
field is named with its value), the SamplingParams fields the client set, checked by
service/validation.py (the checks gRPC runs, so an error reads alike over both), one `Job` per
(prompt, sample) with its seed, chat messages rendered and tokenized on the server's tokenizer
threads, and the texts responses show (the model's name, a token's text, an echoed prompt).

It reads the engine only through `AsyncEngine.info` (plain values fixed at start-up) and its
tokenizer, never the engine thread's state. Everything runs on the server's event loop.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pydantic
from fastapi import Request

from jaxserve.sampling_params import SEED_LIMIT, SamplingParams
from service import validation
from service.http import protocol
from service.lifecycle import Lifecycle
from service.validation import InvalidRequest

if TYPE_CHECKING:
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.info import EngineInfo

MAX_N = 16  # samples per prompt: each is a request of its own in the waiting queue

# The optional sampling fields passed to SamplingParams when set (jaxserve/runtime/sampling.py
# applies them on the device).
_SUPPORTED_EXTRAS: tuple[str, ...] = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
)


class HttpError(Exception):
    """A call that ends with this status and OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param = status, type_, param


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


def include_usage(body: protocol._Sampling) -> bool:
    """Whether a streamed response ends with a usage chunk (`stream_options.include_usage`)."""
    return body.stream_options is not None and body.stream_options.include_usage


class OpenAIServing:
    """The parts of serving a request that completions and chat share, over the lifecycle."""

    def __init__(self, lifecycle: Lifecycle):
        self.lifecycle = lifecycle
        self._token_texts: dict[int, str] = {}

    @property
    def engine(self) -> AsyncEngine:
        """The server's engine (set once warm: calls are admitted only after that)."""
        return self.lifecycle.engine

    @property
    def info(self) -> EngineInfo:
        """The engine's model and limits, as the checks read them."""
        return self.engine.info

    def model_id(self) -> str:
        """The served model's name: its folder's name ("stories260k")."""
        return pathlib.PurePath(self.info.model).name or "jaxserve"

    def head(self, call_id: str, object_: str) -> dict:
        """The fields every response (and every chunk of a stream) of a call starts with."""
        return {
            "id": call_id,
            "object": object_,
            "created": protocol.now(),
            "model": self.model_id(),
        }

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs show it (cached: the same tokens come back often)."""
        text = self._token_texts.get(token_id)
        if text is None:
            tokenizer = self.engine.tokenizer
            text = tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)
            self._token_texts[token_id] = text
        return text

    def echo_text(self, prompt_ids: list[int], prompt_text: str | None) -> str:
        """A prompt's text as `echo` puts it first: as sent, or its token ids decoded."""
        if prompt_text is not None:
            return prompt_text
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(prompt_ids, skip_special_tokens=True) if tokenizer else ""

    async def parse(self, request: Request, model: type[pydantic.BaseModel]):
        """The body as `model`; InvalidRequest naming the field and value at fault."""
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
        jobs = []
        for ids, text in prompts:
            for i in range(body.n):
                sample = dict(sampling)
                if body.n > 1 and body.seed is not None:
                    sample["seed"] = (body.seed + i) % SEED_LIMIT
                params = validation.sampling_params(
                    sample, num_prompt_tokens=len(ids), info=self.info
                )
                jobs.append(Job(len(jobs), i, ids, params, text))
        return jobs

    async def chat_ids(self, messages: Sequence[protocol.ChatMessage], add_prompt: bool):
        """The token ids of chat messages rendered by the model's chat template."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest(
                f"Model {self.info.model} has no chat template, so chat messages cannot be "
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
