"""Serving /v1/chat/completions: messages in, assistant messages out.

After vLLM's serving_chat.py. The messages are rendered by the model's chat template and
tokenized on the server's tokenizer threads (serving.py), then run as one engine request per
sample (`n`); a streamed response sends each choice's role first, then its content as deltas.
Logprob tokens are decoded in context (token_texts.py): joined, they are the message's content.
With vLLM's `use_beam_search`, beams.py runs the call instead.
"""

from __future__ import annotations

import contextlib
import uuid

from fastapi import Request

from service import validation
from service.http import beams, protocol, pumps, streaming
from service.http.serving import OpenAIServing, include_usage
from service.validation import InvalidRequest


class OpenAIServingChat(OpenAIServing):
    """The /v1/chat/completions handler."""

    async def create(self, request: Request, fields: dict):
        """The response of a call: a dict, or an async iterator of chunks when streamed."""
        body = await self.parse(request, protocol.ChatCompletionRequest)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest(
                f"top_logprobs={body.top_logprobs} needs logprobs=true.", "top_logprobs"
            )
        priority = self.priority(body)
        ids = await self.chat_ids(body.messages, body.add_generation_prompt)
        validation.check_prompt_fits("messages", ids, self.info, "messages")
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        sampling = self.sampling_fields(body, max_tokens)
        if body.logprobs:
            sampling["logprobs"] = body.top_logprobs or 0
        width = beams.beam_width(body)
        if width is not None:
            return await beams.respond(
                self, request, body, [(ids, None)], sampling, width, fields, priority
            )
        jobs = self.jobs([(ids, None)], body, sampling, fields)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        fields.update(id=cid, n=body.n, stream=body.stream)
        running = await pumps.start(request, self.lifecycle, jobs, priority)
        head = self.head(cid, "chat.completion", jobs[0].lora)
        if body.stream:
            return self._events(head, jobs, running, include_usage(body))
        choices = await pumps.unless_gone(request, pumps.collect(running, len(jobs)))

        def build() -> list[dict]:  # decoding every logprob token in context: off the loop
            out = []
            for job in jobs:
                c = choices[job.index]
                lp = None
                if body.logprobs:
                    lp = protocol.chat_logprobs(c.logprobs, self.token_texts(job.prompt_ids))
                out.append(
                    {
                        "index": job.index,
                        "message": {"role": "assistant", "content": "".join(c.text)},
                        "logprobs": lp,
                        "finish_reason": c.last.finish_reason,
                    }
                )
            return out

        built = await self.lifecycle.off_loop(build) if body.logprobs else build()
        return {**head, "choices": built, "usage": pumps.collected_usage(jobs, choices)}

    async def _events(self, head, jobs, running: pumps.Pumps, include_usage: bool):
        head = {**head, "object": "chat.completion.chunk"}
        outputs = [0] * len(jobs)
        texts = [self.token_texts(job.prompt_ids) for job in jobs]  # logprob tokens in context
        async with contextlib.aclosing(running):
            for job in jobs:  # the role first, as OpenAI's stream does
                delta = {"role": "assistant", "content": ""}
                choice = streaming.delta_choice(job.index, delta, None, None)
                yield streaming.chunk(head, include_usage, choice)
            async for index, out in running:
                pumps.fail_if_error(out)
                lp = None
                if out.logprobs:
                    lp = protocol.chat_logprobs(out.logprobs, texts[index])
                outputs[index] = out.num_output_tokens
                if out.text_delta or lp or out.finished:
                    delta = {"content": out.text_delta} if out.text_delta else {}
                    choice = streaming.delta_choice(index, delta, lp, out.finish_reason)
                    yield streaming.chunk(head, include_usage, choice)
            if include_usage:
                usage = pumps.usage(jobs, outputs, running.firsts)
                yield {**head, "choices": [], "usage": usage}
