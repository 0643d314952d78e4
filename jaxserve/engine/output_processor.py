"""The last stage of `Engine.step`: the scheduler's updates become what callers receive.

Per request: text deltas safe to stream (detokenizer.py), stop strings, logprobs, the prompt's
logprobs once, timings, and the finish. A failure while making one request's output ends that
request alone (finish reason `error`). The processor owns each request's `Tracked` state from
`add_request` until its last output; the engine's collect stage adds to it (prompt logprobs, the
penalty row) through `tracked`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from jaxserve.engine.detokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    TableDetokenizer,
    TokenTable,
    make_detokenizer,
)
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.outputs import RequestMetrics, RequestOutput
from jaxserve.scheduling.request import FinishReason, Request
from jaxserve.scheduling.scheduler import Scheduler
from jaxserve.scheduling.types import RequestUpdate

logger = logging.getLogger("jaxserve.engine.core")


@dataclasses.dataclass
class Tracked:
    """One request from add_request until its last output: its text pipeline and what the
    engine gathers for it on the way (penalty row, prompt logprobs)."""

    request: Request
    detokenizer: TableDetokenizer | IncrementalDetokenizer | None
    stops: StopStringMatcher
    # (slot, preemptions) when its penalty row was last filled: a new pair means a new slot.
    penalty_row: tuple[int, int] | None = None
    # SamplingParams.prompt_logprobs: filled chunk by chunk as the prompt is computed (entry p
    # is prompt token p's), until delivered with the first output.
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    # The timings its last output carried, shared by outputs until one of them changes.
    metrics: RequestMetrics | None = None
    # Generated up to the update being made into an output (the request's own list may have
    # run ahead of it, with outputs made off the engine thread).
    num_output_tokens: int = 0


class OutputProcessor:
    """Makes every request's outputs; ends a request whose output cannot be made."""

    def __init__(self, tokenizer, scheduler: Scheduler, metrics: EngineMetrics):
        self.tokenizer = tokenizer  # None for a model without one: token ids, no text
        # Each token's text, when the tokenizer's decoding is concatenation (detokenizer.py).
        self.token_table = None if tokenizer is None else TokenTable.build(tokenizer)
        # Ends a request whose output ended it (a stop string, a failure): the scheduler's own,
        # or, with outputs made off the engine thread (AsyncEngine), one that asks the engine
        # thread to, at its next iteration.
        self.finish_request: Callable[[str, FinishReason], object] = scheduler.finish_request
        self.metrics = metrics
        self.tracked: dict[str, Tracked] = {}  # every request not yet given its last output
        # Tests only: called with each request id before its output is made, to inject a fault.
        self.fault_hook: Callable[[str], None] | None = None

    def add(self, request: Request) -> None:
        """Starts tracking a request the scheduler has just accepted."""
        detok = None
        if self.tokenizer is not None:
            detok = make_detokenizer(self.tokenizer, self.token_table, request.prompt_token_ids)
        stops = StopStringMatcher(request.sampling_params.stop)
        self.tracked[request.request_id] = Tracked(request, detok, stops)

    def process(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """Each request's output; a failure while making one ends that request alone.

        Detokenizing, stop strings and logprobs are per-request host work: a bug or an odd
        token there is that request's problem, not a reason to stop serving the others. Only a
        failure of the device step itself (`_dispatch`, `_collect`) leaves `step()`.
        """
        outputs = []
        append, tracked_of, output = outputs.append, self.tracked.get, self._output
        for update in updates:
            tracked = tracked_of(update.request.request_id)
            if tracked is None or tracked.request is not update.request:
                continue  # ended already (its last output made), or an earlier use of the id
            # Counted before anything can fail: a failed output reports the tokens generated.
            tracked.num_output_tokens += len(update.new_token_ids)
            try:
                if self.fault_hook is not None:
                    self.fault_hook(tracked.request.request_id)
                append(output(tracked, update))
            except Exception as e:
                append(self._failed(tracked, e))
        return outputs

    def _until_stop(self, tracked: Tracked, new_ids: list[int], visible: list[int]):
        """(new_ids up to the token that completes a stop string, their text): the tokens
        after it are dropped, as they would never have been generated one step at a time."""
        stops, detok = tracked.stops, tracked.detokenizer
        text = ""
        for i, token in enumerate(visible):
            piece = detok.add([token])
            text += piece
            stops.add(piece)
            if stops.matched is not None:
                dropped = len(new_ids) - (i + 1)
                tracked.num_output_tokens -= dropped
                return new_ids[: i + 1], text
        return new_ids, text

    def _failed(self, tracked: Tracked, error: Exception) -> RequestOutput:
        """Ends a request whose output processing raised: finish reason `error`, its slot and
        pages freed now, the error's text in the output."""
        request = tracked.request
        rid = request.request_id
        logger.exception("processing the output of request %r failed; it ends with 'error'", rid)
        self.finish_request(rid, FinishReason.ERROR)  # a no-op if it had just finished
        self.tracked.pop(rid, None)
        metrics = _metrics_of(request, ended=True)
        self.metrics.on_finished(str(FinishReason.ERROR), metrics, tracked.num_output_tokens)
        return RequestOutput(
            request_id=rid,
            new_token_ids=[],  # their text was never made: the client gets neither
            text_delta="",
            finished=True,
            finish_reason=str(FinishReason.ERROR),
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=tracked.num_output_tokens,
            metrics=metrics,
            num_cached_tokens=request.num_cached_tokens or 0,
            error=f"The server failed while processing this request's output: {error!r}",
        )

    def _output(self, tracked: Tracked, update: RequestUpdate) -> RequestOutput:
        """One request's output of this step (the hot path: a row per running request).

        Made from what the update carried, not from the request's state now: with outputs made
        off the engine thread, the request may already have run further steps.
        """
        request = tracked.request
        new_ids = update.new_token_ids  # the scheduler's own list for this output
        finished = update.finished
        stopped = False  # ended here by its stop string
        text = ""
        if tracked.detokenizer is not None:
            # A stop id ends its request, so only the last new token can be one.
            visible = new_ids[:-1] if new_ids and new_ids[-1] in request.stop_ids else new_ids
            stops = tracked.stops
            if stops.stop and len(visible) > 1:
                # Several tokens at once (a speculative verification): token by token, so
                # that the tokens after the one completing a stop string are not emitted.
                new_ids, text = self._until_stop(tracked, new_ids, visible)
            else:
                text = tracked.detokenizer.add(visible)  # no text for stop ids
                if stops.stop:
                    stops.add(text)
            if stops.stop:  # without stop strings nothing is held back: the delta as it is
                if stops.matched is not None and not finished:
                    self.finish_request(request.request_id, FinishReason.STOP)
                    finished = stopped = True
                text = stops.take(final=finished)
        params = request.sampling_params
        logprobs = None
        if params.logprobs is not None:
            logprobs = [lp for lp in (update.logprobs or []) if lp is not None][: len(new_ids)]
        prompt_logprobs = None
        if params.prompt_logprobs is not None and new_ids and not tracked.prompt_logprobs_sent:
            # The first token came from the prompt's last chunk: every chunk was taken in.
            prompt_logprobs = tracked.prompt_logprobs or [None]  # a 1-token prompt has no chunk
            tracked.prompt_logprobs, tracked.prompt_logprobs_sent = None, True
        # Timings change at the first token, a preemption and the finish: between those the
        # outputs share one (never mutated) RequestMetrics instead of building one per token.
        metrics = tracked.metrics
        if (
            metrics is None
            or finished
            or metrics.first_token_time != request.first_token_time
            or metrics.num_preemptions != request.num_preemptions
        ):
            metrics = tracked.metrics = _metrics_of(request, ended=finished)
        reason = error = None
        if finished:
            reason = str(FinishReason.STOP if stopped else request.finish_reason)
            # A refusal says why (the SLO policy's predicted TTFT against the target).
            if reason == FinishReason.REFUSED:
                error = request.status_message
            del self.tracked[request.request_id]
            self.metrics.on_finished(reason, metrics, tracked.num_output_tokens)
        # Positional, in the fields' order: a third of the cost of keywords, once per row.
        return RequestOutput(
            request.request_id,  # request_id
            new_ids,  # new_token_ids
            text,  # text_delta
            finished,
            reason,  # finish_reason
            len(request.prompt_token_ids),  # num_prompt_tokens
            tracked.num_output_tokens,  # num_output_tokens
            metrics,
            logprobs,
            error,
            request.num_cached_tokens or 0,  # num_cached_tokens
            prompt_logprobs,
            *_spec_counts(request),  # num_proposed_tokens, num_accepted_tokens, verifications
        )


def _spec_counts(request: Request) -> tuple[int, int, int]:
    """(proposed, accepted, verifications) of a request's speculative decoding so far."""
    spec = request.spec
    if spec is None:
        return 0, 0, 0
    return spec.num_proposed, spec.num_accepted, spec.num_verifications


def _metrics_of(request: Request, ended: bool = False) -> RequestMetrics:
    """The request's timings as its outputs report them (finished or failed alike).

    `ended`: this output ends it. A request the output ended itself has no finish time yet
    when the scheduler finishes it later (outputs made off the engine thread): now is its end.
    """
    finished_time = request.finished_time
    if ended and finished_time is None:
        finished_time = time.monotonic()
    return RequestMetrics(
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        finished_time=finished_time,
        num_preemptions=request.num_preemptions,
    )
