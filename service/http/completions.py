"""Serving /v1/completions: prompts (texts, token ids, or lists of either) in, text choices out.

After vLLM's serving_completion.py. A call may send up to MAX_PROMPTS prompts and ask `n`
samples of each; each (prompt, sample) is one engine request (serving.py's `Job`), choice
`index` of the response, prompt after prompt. `echo` puts each prompt's text before its choice
(with logprobs, the prompt's own token logprobs first); `max_tokens=0` with `echo` scores the
prompt without generating. Logprob tokens are decoded in context (token_texts.py): joined,
they are the choice's text. With vLLM's `use_beam_search`, beams.py runs the call instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid

from fastapi import Request

from jaxserve.outputs import RequestOutput, TokenLogprob
from service import validation
from service.http import beams, protocol, pumps, streaming
from service.http.serving import MAX_PROMPTS, Job, OpenAIServing, include_usage, span_fields
from service.tracing import NO_SPAN, NoSpan
from service.validation import InvalidRequest


class OpenAIServingCompletion(OpenAIServing):
    """The /v1/completions handler."""

    async def create(self, request: Request, fields: dict, span: NoSpan = NO_SPAN):
        """The response of a call: a dict, or an async iterator of chunks when streamed; what
        it asked and answered recorded into its `span` (service/tracing.py)."""
        body = await self.parse(request, protocol.CompletionRequest)
        if body.suffix is not None:
            raise InvalidRequest("suffix is not supported: send the whole prompt.", "suffix")
        width = beams.beam_width(body)
        priority = self.priority(body)
        prompts = await self._prompts(body.prompt)
        scoring_only = body.max_tokens == 0
        if scoring_only and not body.echo:
            raise InvalidRequest(
                "max_tokens=0 asks for no output; it is allowed only with echo=true (to score "
                "the prompt with logprobs). Send max_tokens >= 1.",
                "max_tokens",
            )
        sampling = self.sampling_fields(body, 1 if scoring_only else body.max_tokens)
        if body.logprobs is not None:
            sampling["logprobs"] = body.logprobs
            if body.echo:  # the prompt's tokens come first in the logprobs, as OpenAI sends them
                sampling["prompt_logprobs"] = body.logprobs
        if width is not None:
            span.request(model=self.requested_model(body), n=body.n, **span_fields(sampling))
            if scoring_only:
                raise InvalidRequest(
                    "max_tokens=0 (scoring the prompt) cannot be combined with "
                    "use_beam_search=true: a beam search needs max_tokens >= 1.",
                    "max_tokens",
                )
            return await beams.respond(
                self, request, body, prompts, sampling, width, fields, priority
            )
        jobs = self.jobs(prompts, body, sampling, fields)
        for job in jobs:
            job.scoring_only = scoring_only
            if job.sample > 0 and job.params.prompt_logprobs is not None:
                # The n samples of a prompt share its logprobs: the first sample computes them.
                job.params = dataclasses.replace(job.params, prompt_logprobs=None)
        cid = f"cmpl-{uuid.uuid4().hex}"
        fields.update(id=cid, prompts=len(prompts), n=body.n, stream=body.stream)
        head = self.head(cid, "text_completion", body.model)
        span.request(model=self.requested_model(body), params=jobs[0].params, n=body.n)
        span.response(cid, head["model"])
        running = await pumps.start(request, self.lifecycle, jobs, priority, span)
        if body.stream:
            return self._events(head, jobs, running, body, include_usage(body))
        choices = await pumps.unless_gone(request, pumps.collect(running, len(jobs)))

        def build() -> list[dict]:  # decoding every logprob token in context: off the loop
            return [
                self._choice(
                    job, choices[job.index], body, choices[_first_sample(job)].prompt_logprobs
                )
                for job in jobs
            ]

        built = await self.lifecycle.off_loop(build) if body.logprobs is not None else build()
        return {**head, "choices": built, "usage": pumps.collected_usage(jobs, choices)}

    async def _prompts(self, prompt) -> list[tuple[list[int], str | None]]:
        """(token ids, text or None) of each prompt, checked and tokenized."""
        info = self.info
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompts, single = [prompt], True
        else:
            prompts, single = list(prompt), False
        if not prompts:
            raise InvalidRequest("prompt=[] is empty: send a text or token ids.", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise InvalidRequest(
                f"prompt has {len(prompts)} prompts; at most {MAX_PROMPTS} per call.", "prompt"
            )
        out = []
        for i, p in enumerate(prompts):
            field = "prompt" if single else f"prompt[{i}]"
            if isinstance(p, str):
                validation.check_text(field, p, info, self.lifecycle.prompt_limit)
                ids = await self.lifecycle.off_loop(self.engine.encode, p)
                what = f"{field}={validation.short(p)}"
            else:
                validation.check_token_ids(field, p, info)
                ids, what = list(p), field
            validation.check_prompt_fits(what, ids, info, field)
            out.append((ids, p if isinstance(p, str) else None))
        return out

    def _choice(self, job: Job, c: pumps.Choice, body, prompt_logprobs) -> dict:
        text, entries, ids = "".join(c.text), list(c.logprobs), list(c.token_ids)
        if job.scoring_only:
            text, entries, ids = "", [], []
        prefix = self.echo_text(job.prompt_ids, job.prompt_text) if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            # The output's offsets count from the end of the echoed text, as when streamed.
            texts = self.token_texts(job.prompt_ids)
            logprobs = protocol.completion_logprobs(entries, ids, texts, len(prefix))
            if body.echo:
                echoed = protocol.completion_logprobs(
                    _prompt_entries(job, prompt_logprobs),
                    job.prompt_ids,
                    self.token_texts(),
                    0,
                )
                logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
        choice = {
            "index": job.index,
            "text": prefix + text,
            "logprobs": logprobs,
            "finish_reason": _finish_reason(job, c.last),
        }
        if body.return_token_ids:  # vLLM's: on the choice, the prompt's and the output's
            choice.update(prompt_token_ids=list(job.prompt_ids), token_ids=ids)
        return choice

    async def _events(self, head, jobs, running: pumps.Pumps, body, include_usage: bool):
        head = {**head}
        offsets = [0] * len(jobs)  # characters of each choice's tokens so far
        outputs = [0] * len(jobs)
        echoed = [not body.echo] * len(jobs)
        # return_token_ids: whether each choice has had its first chunk (which carries the
        # prompt's ids); every chunk carries the ids of its own new tokens.
        ids_sent = [False] * len(jobs)

        def with_ids(choice: dict, index: int, token_ids: list[int]) -> dict:
            if body.return_token_ids:
                if not ids_sent[index]:
                    ids_sent[index] = True
                    choice["prompt_token_ids"] = list(jobs[index].prompt_ids)
                choice["token_ids"] = list(token_ids)
            return choice

        # Each choice's output tokens in context, from chunk to chunk (with logprobs).
        texts = [self.token_texts(job.prompt_ids) for job in jobs]
        # Every choice's first output is in by now (Pumps.first_outputs), so each choice's
        # echo can carry its prompt's logprobs, which came with its prompt's first sample.
        prompt_logprobs = {i: out.prompt_logprobs for i, out in running.firsts.items()}
        async with contextlib.aclosing(running):
            async for index, out in running:
                pumps.fail_if_error(out)
                job = jobs[index]
                if not echoed[index]:  # the prompt first; its logprobs come with the first output
                    echoed[index] = True
                    text = self.echo_text(job.prompt_ids, job.prompt_text)
                    lp = None
                    if body.logprobs is not None:
                        entries = _prompt_entries(job, prompt_logprobs[_first_sample(job)])
                        lp = protocol.completion_logprobs(
                            entries, job.prompt_ids, self.token_texts(), 0
                        )
                    offsets[index] = len(text)
                    choice = with_ids(streaming.text_choice(index, text, lp, None), index, [])
                    yield streaming.chunk(head, include_usage, choice)
                if job.scoring_only:
                    if out.finished:
                        choice = streaming.text_choice(index, "", None, _finish_reason(job, out))
                        yield streaming.chunk(head, include_usage, with_ids(choice, index, []))
                    continue
                lp = None
                if body.logprobs is not None and out.logprobs:
                    lp = protocol.completion_logprobs(
                        out.logprobs, out.new_token_ids, texts[index], offsets[index]
                    )
                    offsets[index] += sum(len(t) for t in lp["tokens"])
                else:
                    offsets[index] += len(out.text_delta)
                outputs[index] = out.num_output_tokens
                # With return_token_ids, tokens that add no text (yet) have a chunk too: a client
                # counting them sees every one.
                ids = body.return_token_ids and out.new_token_ids
                if out.text_delta or lp or out.finished or ids:
                    choice = streaming.text_choice(index, out.text_delta, lp, out.finish_reason)
                    choice = with_ids(choice, index, out.new_token_ids)
                    yield streaming.chunk(head, include_usage, choice)
            if include_usage:
                usage = pumps.usage(jobs, outputs, running.firsts)
                yield {**head, "choices": [], "usage": usage}


def _prompt_entries(job: Job, entries: list[TokenLogprob | None] | None) -> list:
    """The prompt's logprob entries (None for the first token; all None if none came back, as
    for a request that ended before its prompt was computed)."""
    return list(entries) if entries is not None else [None] * len(job.prompt_ids)


def _first_sample(job: Job) -> int:
    """The choice index of sample 0 of `job`'s prompt (a prompt's samples are consecutive)."""
    return job.index - job.sample


def _finish_reason(job: Job, out: RequestOutput) -> str | None:
    # Scoring only: the token sampled past the prompt is not shown, so the output stopped at
    # its length (0), whatever ended the engine's request.
    if job.scoring_only and out.finish_reason not in (None, "abort", "error"):
        return "length"
    return out.finish_reason
