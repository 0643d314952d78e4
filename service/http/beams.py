"""Beam search over the OpenAI-compatible API: vLLM's `use_beam_search` extra field.

OpenAI's API has no beam search; vLLM's had one (before it moved beam search out of its sampling
parameters), and clients that want beams send its fields, so the conventions are vLLM's:

- `use_beam_search: true` runs one search per prompt, of width `best_of` if given, else `n`
  (2 to MAX_BEAM_WIDTH); the response's choices are its best `n` beams, best first. So `n=3`
  alone returns all 3 beams of a width-3 search, and `n=1, best_of=4` the best of 4.
- `length_penalty` ranks finished beams (score = cumulative logprob / length ** length_penalty);
  without beam search any value but 1 is refused, since nothing would use it. `early_stopping`
  may only be true: the search ends once it holds `best_of` finished beams (Hugging Face's
  `early_stopping=True`; jaxserve/engine/beam_search.py has the whole rule).
- Everything else follows the shared rule of `SamplingParams` (service/validation.py), so the
  refusal reads as over gRPC: temperature 0 or 1 (both name the model's own distribution; 1 is
  also what an absent temperature means), no top-k/p, min-p, penalties, logit bias, min_tokens,
  stop strings or logprobs. `ignore_eos` and `stop_token_ids` (ending a beam as EOS does) work.
- Each choice carries `finish_reason` ("stop" or "length") and, beyond OpenAI's fields, the
  beam's `cumulative_logprob` and `score`. `usage` counts each prompt once and the returned
  beams' tokens (not the beams dropped, nor the per-iteration requests the search made).
- Streaming: beams are not final until the search ends, so a streamed call sends each choice
  whole, in one chunk, once it has (then the usage chunk if asked, then `[DONE]`), as gRPC sends
  one last response. Errors before that (a full queue, a bad value) are the call's status code.

A client that disconnects cancels the searches; closing their requests' streams aborts them.
`respond` runs such a call for completions.py and chat.py alike.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from fastapi import Request

from jaxserve.engine import beam_search
from jaxserve.engine.beam_search import Beam, BeamSearchOutput
from jaxserve.sampling_params import MAX_BEAM_WIDTH, SamplingParams
from service import validation
from service.http import protocol, pumps
from service.http.serving import HttpError, OpenAIServing, include_usage
from service.validation import InvalidRequest

if TYPE_CHECKING:
    from jaxserve.engine.info import EngineInfo


def beam_width(body: protocol._Sampling) -> int | None:
    """The beam width a body asks for, or None without beam search; InvalidRequest for fields
    that contradict it (or that only beam search reads)."""
    if body.early_stopping not in (None, True):
        raise InvalidRequest(
            f"early_stopping={body.early_stopping!r} is not supported: jaxserve's beam search "
            "stops once it holds best_of finished beams (early_stopping=true).",
            "early_stopping",
        )
    if not body.use_beam_search:
        if body.length_penalty is not None and body.length_penalty != 1:
            raise InvalidRequest(
                f"length_penalty={body.length_penalty} needs use_beam_search=true: it ranks "
                "the beams of a beam search, and without one nothing would use it.",
                "length_penalty",
            )
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequest(
                f"best_of={body.best_of} is not supported without use_beam_search=true: only "
                f"best_of equal to n (n={body.n}).",
                "best_of",
            )
        return None
    field = "best_of" if body.best_of is not None else "n"
    width = body.best_of if body.best_of is not None else body.n
    if not 2 <= width <= MAX_BEAM_WIDTH:
        raise InvalidRequest(
            f"use_beam_search=true with {field}={width}: the beam width (best_of if given, else "
            f"n) must be in [2, {MAX_BEAM_WIDTH}]. Send best_of for the width and n for how many "
            "of its beams to return.",
            field,
        )
    if not 1 <= body.n <= width:
        raise InvalidRequest(
            f"n={body.n} must be in [1, best_of={width}] with use_beam_search=true: the choices "
            "are the best n of best_of beams.",
            "n",
        )
    return width


def beam_params(
    sampling: dict, width: int, body: protocol._Sampling, num_prompt_tokens: int, info: EngineInfo
) -> SamplingParams:
    """The search's SamplingParams, checked by the shared validation; a conflict (temperature
    0.7, logprobs, ...) is refused naming use_beam_search and the values."""
    fields = {**sampling, "beam_width": width}
    if body.length_penalty is not None:
        fields["length_penalty"] = body.length_penalty
    try:
        return validation.sampling_params(fields, num_prompt_tokens=num_prompt_tokens, info=info)
    except InvalidRequest as e:
        if e.param != "beam_width":
            raise
        raise InvalidRequest(
            f"use_beam_search=true (a beam search of width {width}) cannot run as sent. {e}",
            "use_beam_search",
        ) from None


async def respond(
    serving: OpenAIServing,
    request: Request,
    body,
    prompts,
    sampling: dict,
    width,
    fields,
    priority: int,
):
    """A call with use_beam_search: one search per prompt, its best n beams the choices; the
    response (or its stream) once every search has ended. `prompts` are (token ids, text or
    None); `fields` is the call's log line; `priority` the checked one."""
    chat = isinstance(body, protocol.ChatCompletionRequest)
    params = [beam_params(sampling, width, body, len(ids), serving.info) for ids, _ in prompts]
    cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    fields.update(id=cid, prompts=len(prompts), n=body.n, beam_width=width, stream=body.stream)
    prompt_ids = [ids for ids, _ in prompts]
    lora = serving.adapter(body.model)
    search = search_all(serving.engine, prompt_ids, params, priority, lora)
    outs = await pumps.unless_gone(request, search)
    for out in outs:
        if out.error is not None:  # a beam's request failed or was aborted: no result
            raise HttpError(500, out.error, "internal_error")
    choices = []
    for out, (ids, text) in zip(outs, prompts, strict=True):
        echo = ""
        if not chat and body.echo:
            echo = serving.echo_text(ids, text)
        for beam in out.beams[: body.n]:
            if chat:
                choice = chat_choice(len(choices), beam)
            else:
                choice = completion_choice(len(choices), beam, echo)
                if body.return_token_ids:  # vLLM's: the prompt's ids on a completion's choice
                    choice["prompt_token_ids"] = list(ids)
            if body.return_token_ids:
                choice["token_ids"] = list(beam.token_ids)
            choices.append(choice)
    head = serving.head(cid, "chat.completion" if chat else "text_completion", body.model)
    usage_ = usage(prompt_ids, outs, body.n)
    # vLLM's: a chat's prompt ids (one prompt) beside its choices, in a stream's first chunk.
    extra = {"prompt_token_ids": list(prompt_ids[0])} if chat and body.return_token_ids else {}
    if body.stream:
        return events(head, choices, usage_ if include_usage(body) else None, extra)
    return {**head, "choices": choices, "usage": usage_, **extra}


async def search_all(
    async_engine,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    priority: int,
    lora: str | None = None,
) -> list[BeamSearchOutput]:
    """Runs one search per prompt, together; their outputs in prompt order. If one raises (a
    full queue), or this is cancelled (the client left), the others are cancelled too."""
    rid = uuid.uuid4().hex[:16]
    tasks = [
        asyncio.ensure_future(
            beam_search.search_async(async_engine, ids, p, f"http-{rid}-{i}", priority, lora)
        )
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
    ]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def returned(outs: Sequence[BeamSearchOutput], n: int) -> list[Beam]:
    """The choices' beams: each prompt's best n, best first, prompt after prompt."""
    return [beam for out in outs for beam in out.beams[:n]]


def usage(prompts: Sequence[list[int]], outs: Sequence[BeamSearchOutput], n: int) -> dict:
    """Each prompt once (and its tokens the prefix cache served), and the returned beams."""
    return protocol.usage(
        sum(len(ids) for ids in prompts),
        sum(len(b.token_ids) for b in returned(outs, n)),
        sum(out.num_cached_tokens for out in outs),
    )


def _extras(beam: Beam) -> dict:
    return {"cumulative_logprob": beam.cumulative_logprob, "score": beam.score}


def completion_choice(index: int, beam: Beam, echo: str) -> dict:
    """/v1/completions' choice of one beam (`echo`: the prompt's text to put first, or "")."""
    return {
        "index": index,
        "text": echo + beam.text,
        "logprobs": None,
        "finish_reason": beam.finish_reason,
        **_extras(beam),
    }


def chat_choice(index: int, beam: Beam) -> dict:
    """/v1/chat/completions' choice of one beam."""
    return {
        "index": index,
        "message": {"role": "assistant", "content": beam.text},
        "logprobs": None,
        "finish_reason": beam.finish_reason,
        **_extras(beam),
    }


async def events(
    head: dict, choices: list[dict], usage_: dict | None, first: dict | None = None
) -> AsyncIterator[dict]:
    """The streamed form of a finished response: one chunk per whole choice (the first with
    the fields of `first` too), then the usage chunk when asked (`usage_` not None). Chat
    choices become deltas (role and content)."""
    chat = head["object"] == "chat.completion"
    if chat:
        head = {**head, "object": "chat.completion.chunk"}
    for choice in choices:
        if chat:  # the whole message as one delta: role and content together
            choice = {k: v for k, v in choice.items() if k != "message"} | {
                "delta": choice["message"]
            }
        chunk = {**head, "choices": [choice]}
        if usage_ is not None:
            chunk["usage"] = None
        if first:
            chunk.update(first)
            first = None
        yield chunk
    if usage_ is not None:
        yield {**head, "choices": [], "usage": usage_}
