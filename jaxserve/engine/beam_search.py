"""Beam search over the engine: each iteration every live beam is one ordinary request.

Why over the engine rather than inside it: a beam needs nothing the engine lacks. Every
iteration each live beam of a search becomes one request (prompt = the original prompt + the
beam's tokens, max_tokens=1, temperature 0, logprobs = 2 * beam_width), all the search's
requests are added together and stepped beside whatever else the engine runs, in the same
jitted steps (nothing new to compile). The prefix cache does the forking: a beam's prompt
extends its parent's, so every full page the parent computed is served from the cache, shared
by reference count and never copied, and only the last partial page and the new token are
computed per beam per iteration.

The scores are the engine's `logprobs`, which are the model's log_softmax at temperature 1
whatever the request's temperature (sampling.py takes the log-softmax of the logits after bias
and penalties, which beam requests never have, and before any temperature), so a beam's
cumulative logprob is the sum of log p(token | prefix) under the model.

The rule, as Hugging Face's `num_beams` search with `early_stopping=True` (k = beam_width):

1. Each live beam b (cumulative logprob s_b) offers its 2k most likely next tokens t, with
   cumulative logprob s_b + log p(t | b). All offers are ranked by it (highest first; ties keep
   beam order, then token order) and the first 2k kept.
2. Walking that list in order: an end token (EOS unless ignore_eos, or a stop_token_id) at rank
   < k makes a finished hypothesis (one ranked later is dropped); any other token makes a live
   beam of the next iteration, until k live beams are found.
3. Hypotheses are ranked by score = cumulative logprob / (length ** length_penalty), where
   length is the number of generated tokens (the end token included); at most k are kept.
4. The search ends once it holds k hypotheses, or when the live beams reach max_tokens (then
   each becomes a hypothesis, finish reason "length"), or when no live beam is left. The result
   is the hypotheses, best score first.

With k = 1 this is greedy decoding (the argmax, until an end token or max_tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Sequence

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.outputs import RequestMetrics, RequestOutput
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass
class Beam:
    """One hypothesis of a search: generated tokens (no prompt), how likely, how ranked."""

    token_ids: list[int]
    cumulative_logprob: float  # sum of the model's log p(token | prompt + tokens before)
    finish_reason: str | None = None  # "stop" (an end token) or "length"; None while live
    score: float | None = None  # cumulative_logprob / len(token_ids) ** length_penalty
    text: str = ""  # filled by whoever has the tokenizer


class BeamSearch:
    """The state of one prompt's search; knows no engine (one iteration in, one out)."""

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
        lora: str | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError("The prompt has no tokens.")
        self.prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.params = params
        self.width = params.beam_width
        self.lora = lora  # the adapter every beam's request runs with (None: the base model)
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        self.end_ids = frozenset(eos) | frozenset(params.stop_token_ids)
        self.live = [Beam([], 0.0)]
        self.finished: list[Beam] = []
        self.done = False
        # What each beam's request asks of the engine: its 2k most likely next tokens.
        self.request_params = SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=2 * self.width, ignore_eos=True, seed=0
        )
        self.num_requests = 0  # engine requests made, over all iterations
        self.num_prompt_tokens_sent = 0  # their prompt tokens
        self.num_cached_tokens = 0  # of those, served by the prefix cache
        self.prompt_cached_tokens = 0  # of the prompt itself (the first iteration's one request)
        # The beam request that ended the search early by ending without its token (an error,
        # an abort): the search then has no result.
        self.failure: RequestOutput | None = None

    def requests(self) -> list[list[int]]:
        """The prompt of each live beam's request this iteration, in beam order (counted in
        num_requests: call it once per iteration)."""
        self.num_requests += len(self.live)
        return [self.prompt_token_ids + b.token_ids for b in self.live]

    def count(self, out: RequestOutput) -> None:
        """Adds a finished beam request's prompt and prefix-cache hit to the totals."""
        self.num_prompt_tokens_sent += out.num_prompt_tokens
        self.num_cached_tokens += out.num_cached_tokens
        if out.num_prompt_tokens == len(self.prompt_token_ids):
            self.prompt_cached_tokens = out.num_cached_tokens

    def advance(self, tops: Sequence[Sequence[tuple[int, float]]]) -> None:
        """Takes each live beam's most likely next tokens (token id, logprob; highest first,
        at least 2k of them, or all the vocabulary has) and makes the next iteration's beams."""
        if self.done:
            raise ValueError("The beam search has ended; there is nothing to advance.")
        if len(tops) != len(self.live):
            raise ValueError(f"Got {len(tops)} token lists for {len(self.live)} live beams.")
        k = self.width
        offers = [
            (beam.cumulative_logprob + float(lp), i, int(t))
            for i, (beam, top) in enumerate(zip(self.live, tops, strict=True))
            for t, lp in top[: 2 * k]
        ]
        offers.sort(key=lambda o: -o[0])  # stable: ties keep beam, then token order
        live = []
        for rank, (logprob, i, t) in enumerate(offers[: 2 * k]):
            beam = Beam([*self.live[i].token_ids, t], logprob)
            if t in self.end_ids:
                if rank < k:
                    self._finish(beam, "stop")
                continue
            live.append(beam)
            if len(live) == k:
                break
        self.live = live
        if len(self.finished) >= k:
            self.done = True
        elif not live or len(live[0].token_ids) >= self.params.max_tokens:
            for beam in live:
                self._finish(beam, "length")
            self.done = True
        if self.done:
            self.live = []

    def fail(self, out: RequestOutput) -> None:
        """Ends the search without a result: beam request `out` ended without its token."""
        self.failure, self.done, self.live, self.finished = out, True, [], []

    def _finish(self, beam: Beam, reason: str) -> None:
        beam.finish_reason = reason
        beam.score = beam.cumulative_logprob / len(beam.token_ids) ** self.params.length_penalty
        self.finished.append(beam)
        self.finished.sort(key=lambda b: -b.score)  # stable: the earlier of equals stays
        del self.finished[self.width :]

    def result(self) -> list[Beam]:
        """The finished hypotheses, best score first (at most beam_width)."""
        if not self.done:
            raise ValueError("The beam search has not ended yet.")
        return list(self.finished)


def _top_of(out: RequestOutput) -> list[tuple[int, float]] | None:
    """A beam request's most likely next tokens, from its one output token's logprobs; None if
    it ended without one (failed or aborted)."""
    if out.finish_reason in ("error", "abort") or not out.logprobs:
        return None
    return out.logprobs[0].top


def label(engine, prompt_token_ids: Sequence[int], beams: list[Beam]) -> list[Beam]:
    """The beams with their text as the engine streams it (the same detokenizer: a leading
    space after the prompt kept); none without a tokenizer."""
    if engine.tokenizer is not None:
        for beam in beams:
            beam.text = IncrementalDetokenizer(engine.tokenizer, prompt_token_ids).add(
                beam.token_ids
            )
    return beams


def start_search(
    engine, prompt_token_ids: Sequence[int], params: SamplingParams, lora: str | None = None
) -> BeamSearch:
    """A search for one prompt (under adapter `lora`), checked to fit the engine's context."""
    engine.adapters.check_name(lora)
    room = engine.max_model_len - len(prompt_token_ids)
    if params.max_tokens > room:
        raise ValueError(
            f"max_tokens={params.max_tokens} is beyond the context: the prompt's "
            f"{len(prompt_token_ids)} tokens leave room for {room} "
            f"(max_model_len={engine.max_model_len})."
        )
    return BeamSearch(prompt_token_ids, params, engine.model.config.eos_token_ids, lora)


class BeamDriver:
    """Runs beam searches on an `Engine` beside its other requests.

    The caller keeps stepping the engine and hands every output to `take`, which claims those
    of beam requests; when a search's iteration is complete it adds the next one's requests.
    """

    def __init__(self, engine):
        self.engine = engine
        self._owner: dict[str, tuple[BeamSearch, int]] = {}  # request id -> (search, beam)
        self._tops: dict[int, list] = {}  # id(search) -> each live beam's top, as it arrives

    def submit(self, search: BeamSearch) -> None:
        """Adds the requests of the search's next iteration."""
        if search.done:
            raise ValueError("The beam search has ended; there is nothing to submit.")
        prompts = search.requests()
        self._tops[id(search)] = [None] * len(prompts)
        for i, prompt in enumerate(prompts):
            rid = self.engine.add_request(prompt, search.request_params, lora=search.lora)
            self._owner[rid] = (search, i)

    def take(self, out: RequestOutput) -> bool:
        """Whether `out` belonged to a beam request (then it is consumed here)."""
        owner = self._owner.get(out.request_id)
        if owner is None:
            return False
        if not out.finished:
            return True
        del self._owner[out.request_id]
        search, i = owner
        if search.done:  # a sibling failed and ended the search: nothing waits for this one
            return True
        search.count(out)
        tops = self._tops[id(search)]
        tops[i] = _top_of(out)
        if tops[i] is None:
            search.fail(out)
            del self._tops[id(search)]
            for rid in self.request_ids(search):
                self.engine.abort(rid)
        elif all(t is not None for t in tops):
            del self._tops[id(search)]
            search.advance(tops)
            if not search.done:
                self.submit(search)
        return True

    def request_ids(self, search: BeamSearch) -> list[str]:
        """The search's requests in the engine now (to abort it, say)."""
        return [rid for rid, (owner, _) in self._owner.items() if owner is search]


def run(engine, searches: Sequence[BeamSearch]) -> list[list[Beam]]:
    """Runs the searches together on the engine to their end; the outputs of any other request
    the engine holds are dropped (step the engine with a `BeamDriver` to keep them). Raises
    RuntimeError if a search failed."""
    driver = BeamDriver(engine)
    for search in searches:
        driver.submit(search)
    while engine.has_unfinished():
        for out in engine.step():
            driver.take(out)
    for search in searches:
        if search.failure is not None:
            raise RuntimeError(_failure_message(search.failure))
    return [label(engine, s.prompt_token_ids, s.result()) for s in searches]


def _failure_message(out: RequestOutput) -> str:
    return f"Beam request {out.request_id!r} ended without its token ({out.finish_reason}): " + (
        out.error or "aborted."
    )


@dataclasses.dataclass
class BeamSearchOutput(RequestOutput):
    """The best beam as one finished output (all its tokens at once), and every beam."""

    beams: list[Beam] = dataclasses.field(default_factory=list)  # best first


async def search_async(
    async_engine,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    request_id: str,
    priority: int = 0,
    lora: str | None = None,
) -> BeamSearchOutput:
    """One search through an `AsyncEngine` (its requests named `<request_id>.beam<i>.<j>`)."""
    engine = async_engine.engine
    search = start_search(engine, prompt_token_ids, params, lora)
    arrival = time.monotonic()
    iteration = 0
    while not search.done:
        prompts = search.requests()
        ids = [f"{request_id}.beam{iteration}.{i}" for i in range(len(prompts))]
        lasts = await asyncio.gather(
            *(
                _last_output(async_engine, p, search.request_params, i, priority, lora)
                for p, i in zip(prompts, ids, strict=True)
            )
        )
        tops = []
        for last in lasts:
            search.count(last)
            tops.append(_top_of(last))
            if tops[-1] is None:
                search.fail(last)
                break
        else:
            search.advance(tops)
        iteration += 1
    beams = label(engine, search.prompt_token_ids, search.result())
    return best_output(request_id, search, beams, arrival)


async def _last_output(
    async_engine, prompt, params, request_id, priority, lora=None
) -> RequestOutput:
    """The finished output of one request through an `AsyncEngine`."""
    last = None
    # Closed however this ends: a cancelled search (its call cancelled) aborts the request.
    stream = async_engine.generate(
        prompt, params, request_id=request_id, priority=priority, lora=lora
    )
    async with contextlib.aclosing(stream):
        async for last in stream:  # noqa: B007 (the last one is the result)
            pass
    return last


def best_output(
    request_id: str, search: BeamSearch, beams: list[Beam], arrival_time: float
) -> BeamSearchOutput:
    """The search's result as one finished output (timed from `arrival_time`); a failed search's
    has no token, its beam request's finish reason and an error saying which request failed."""
    now = time.monotonic()
    metrics = RequestMetrics(arrival_time, arrival_time, now, now)
    if search.failure is not None:
        return BeamSearchOutput(
            request_id=request_id,
            new_token_ids=[],
            text_delta="",
            finished=True,
            finish_reason=search.failure.finish_reason,
            num_prompt_tokens=len(search.prompt_token_ids),
            num_output_tokens=0,
            metrics=metrics,
            error=_failure_message(search.failure),
        )
    best = beams[0]
    return BeamSearchOutput(
        request_id=request_id,
        new_token_ids=list(best.token_ids),
        text_delta=best.text,
        finished=True,
        finish_reason=best.finish_reason,
        num_prompt_tokens=len(search.prompt_token_ids),
        num_output_tokens=len(best.token_ids),
        metrics=metrics,
        num_cached_tokens=search.prompt_cached_tokens,
        beams=beams,
    )
