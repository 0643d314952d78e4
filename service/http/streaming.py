"""Server-sent events of the OpenAI-compatible API: how a streamed response is framed.

A streamed call answers 200 at once, then sends one `data: {json}` event per chunk and
`data: [DONE]` at the end, as OpenAI's API does. An error after the 200 can only be an event: it
is sent as OpenAI's error body, and no [DONE] follows. The chunks are built here too: a choice
of /v1/completions carries `text`, one of /v1/chat/completions a `delta`, and with
`stream_options.include_usage` every chunk says `usage: null` (the usage comes last, alone).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from service.http import protocol

if TYPE_CHECKING:
    from service.http.serving import HttpError


async def sse(
    events: AsyncIterator[dict],
    error_of: Callable[[Exception], Awaitable[HttpError]],
    fields: dict,
    end: Callable[[], None],
) -> AsyncIterator[str]:
    """Server-sent events, ending with `data: [DONE]`; calls `end()` (the call's end: its log
    line) when the stream ends, however it ends. `fields` is the call's log: an error puts its
    code and message there, a client gone mid-stream its code 499."""
    try:
        async for event in events:
            yield f"data: {protocol.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"
    except asyncio.CancelledError:  # the client left mid-stream (Starlette cancels us)
        fields["code"] = 499
        raise
    except Exception as e:
        error = await error_of(e)
        fields.update(code=error.status, error=str(error))
        body = protocol.error_body(str(error), error.type, error.param, error.code)
        yield f"data: {protocol.dumps(body)}\n\n"
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()
        end()


def chunk(head: dict, include_usage: bool, choice: dict) -> dict:
    """One chunk of a stream, with one choice."""
    chunk = {**head, "choices": [choice]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def text_choice(index, text, logprobs, finish_reason) -> dict:
    """A /v1/completions choice (whole, or a chunk's piece of it)."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def delta_choice(index, delta, logprobs, finish_reason) -> dict:
    """A /v1/chat/completions chunk's choice: what the message gained since the last chunk."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
