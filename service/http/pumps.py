"""The engine streams of one HTTP call, what they add up to, and waiting on them while the client
may leave.

A call with several prompts or `n` samples runs one `AsyncEngine.generate()` stream per `Job`,
each pumped by a task of its own into one queue (`Pumps`). The response (streamed or not)
starts only once every stream has delivered its first output (`start`), so that an error that
ends a stream at once (a full queue, a request refused under load) is the call's status code,
not an event inside a 200 stream. A client that disconnects, before or during the response,
cancels the pumps (`unless_gone`); closing their streams aborts the requests, and the engine
frees their slots and pages at its next iteration. When a drain's grace period ends, the
call's queue receives the lifecycle's 503 (`Lifecycle.end_drain`): a call still waiting for its
first outputs answers 503, and a stream ends with that error as its last event. Everything
runs on the server's event loop; the queue holds at most the outputs of the call's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid

from fastapi import Request

from jaxserve.outputs import RequestOutput, TokenLogprob
from service.http import protocol
from service.http.serving import ClientGone, HttpError, Job
from service.lifecycle import Lifecycle, Refused
from service.tracing import NO_SPAN

__all__ = ["ClientGone", "Pumps", "start", "unless_gone"]


@dataclasses.dataclass
class Choice:
    """What one choice has produced so far."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    last: RequestOutput | None = None


class Pumps:
    """The engine streams of one call, each pumped by a task into one queue of
    (choice index, RequestOutput) or (choice index, exception)."""

    def __init__(self, lifecycle: Lifecycle, jobs: list[Job], priority: int, span=NO_SPAN):
        async_engine = lifecycle.engine
        self._jobs = jobs
        self._span = span  # the call's (service/tracing.py): each finished output goes there
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
                        lora=job.lora,
                    ),
                )
            )
            for job in jobs
        ]
        # The drain's end arrives as an error in the queue, whoever is waiting on it.
        self._unwatch = lifecycle.watch_drain(
            lambda error: self._queue.put_nowait((-1, Refused(error.code, str(error))))
        )

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
            fail_if_refused(item)  # refused before its first token: the call's status
            seen.add(index)
            self.firsts.setdefault(index, item)
            self._buffer.append((index, item))

    async def __aiter__(self):
        for index, out in self._buffer:
            if out.finished:
                self._finished(index, out)
            yield index, out
        self._buffer = []
        while self._open:
            index, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self._finished(index, item)
            yield index, item

    def _finished(self, index: int, out: RequestOutput) -> None:
        self._open -= 1
        job = self._jobs[index]
        # Counted as the call's usage counts them: a prompt once, however many samples it has.
        self._span.output(
            out,
            input_tokens=len(job.prompt_ids) if job.sample == 0 else 0,
            output_tokens=0 if job.scoring_only else out.num_output_tokens,
        )

    async def aclose(self) -> None:
        """Cancels the pumps left; closing their streams aborts their requests (so a call's
        stream of chunks holds its Pumps in `contextlib.aclosing`)."""
        self._unwatch()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def start(
    request: Request, lifecycle: Lifecycle, jobs: list[Job], priority: int, span=NO_SPAN
) -> Pumps:
    """Starts every job's engine stream; returns once each has delivered its first output
    (or raises the first one's error, the others aborted). Finished outputs go to `span`."""
    pumps = Pumps(lifecycle, jobs, priority, span)
    try:
        await unless_gone(request, pumps.first_outputs())
    except BaseException:
        await pumps.aclose()
        raise
    return pumps


async def unless_gone(request: Request, awaitable):
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


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(pumps: Pumps, count: int) -> list[Choice]:
    """Every output of the call, added up per choice (a response that is not streamed)."""
    choices = [Choice() for _ in range(count)]
    try:
        async for index, out in pumps:
            _add(choices[index], out)
    finally:
        await pumps.aclose()
    for c in choices:
        if c.last.finish_reason == "error":
            raise HttpError(500, c.last.error or "The request failed.", "internal_error")
    return choices


def _add(choice: Choice, out: RequestOutput) -> None:
    choice.token_ids += out.new_token_ids
    choice.text.append(out.text_delta)
    choice.logprobs += out.logprobs or []
    if out.prompt_logprobs is not None:
        choice.prompt_logprobs = out.prompt_logprobs
    choice.last = out


def usage(jobs: list[Job], outputs: list[int], seen: dict[int, RequestOutput]) -> dict:
    """Usage of a call; `seen` has an output of each choice (they all carry its number of
    cached prompt tokens)."""
    # A prompt's tokens count once, however many samples it has (as OpenAI counts them),
    # and so do its cached tokens: those of its first sample.
    firsts = [j for j in jobs if j.sample == 0]
    prompt = sum(len(j.prompt_ids) for j in firsts)
    cached = sum(seen[j.index].num_cached_tokens for j in firsts if j.index in seen)
    return protocol.usage(prompt, sum(outputs), cached)


def collected_usage(jobs: list[Job], choices: list[Choice]) -> dict:
    """Usage of a call whose choices were collected whole (a scored prompt shows no output)."""
    outputs = [0 if j.scoring_only else choices[j.index].last.num_output_tokens for j in jobs]
    return usage(jobs, outputs, {j.index: choices[j.index].last for j in jobs})


def fail_if_error(out: RequestOutput) -> None:
    """A request the engine failed alone ends the stream with 500 and the engine's reason."""
    if out.finish_reason == "error":
        raise HttpError(500, out.error or "The request failed.", "internal_error")
    fail_if_refused(out)


def fail_if_refused(out: RequestOutput) -> None:
    """A request the engine refused under load (--shed-late: its predicted TTFT, shown, misses
    the target) ends the call with 429, as a full queue does (gRPC: RESOURCE_EXHAUSTED)."""
    if out.finish_reason == "refused":
        raise HttpError(429, out.error or "Refused under load.", "rate_limit")
