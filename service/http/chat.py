"""Serving /v1/chat/completions: messages in, assistant messages out.

After vLLM's serving_chat.py. The messages are rendered by the model's chat template and
tokenized on the server's tokenizer threads (serving.py), then run as one engine request per
sample (`n`); a streamed response sends each choice's role first, then its content as deltas.
Logprob tokens are decoded in context (token_texts.py): joined, they are the message's content.
With vLLM's `use_beam_search`, beams.py runs the call instead. With `tools`, tools.py says
what the output is constrained to and how its text becomes `tool_calls`; a streamed call sends
a named function's arguments as deltas, and the calls of `auto` and `required` (which are
known only once their text is complete) in one delta at the end.
"""

from __future__ import annotations

import contextlib
import uuid

from fastapi import Request

from service import validation
from service.http import beams, protocol, pumps, streaming, tools
from service.http.serving import OpenAIServing, include_usage, span_fields, structured_output
from service.tracing import NO_SPAN, NoSpan
from service.validation import InvalidRequest


class OpenAIServingChat(OpenAIServing):
    """The /v1/chat/completions handler."""

    async def create(self, request: Request, fields: dict, span: NoSpan = NO_SPAN):
        """The response of a call: a dict, or an async iterator of chunks when streamed; what
        it asked and answered recorded into its `span` (service/tracing.py)."""
        body = await self.parse(request, protocol.ChatCompletionRequest)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest(
                f"top_logprobs={body.top_logprobs} needs logprobs=true.", "top_logprobs"
            )
        priority = self.priority(body)
        plan = tools.plan(body)
        if plan is not None and plan.constraint is not None and structured_output(body):
            raise InvalidRequest(
                f"tool_choice={plan.mode!r} constrains the output to a call, which cannot be "
                "combined with response_format or structured_outputs.",
                "tool_choice",
            )
        offered = plan.tools if plan is not None else None
        ids = await self.chat_ids(body.messages, body.add_generation_prompt, offered)
        validation.check_prompt_fits("messages", ids, self.info, "messages")
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        sampling = self.sampling_fields(body, max_tokens)
        if plan is not None and plan.constraint is not None:
            sampling["structured_output"] = plan.constraint
        if body.logprobs:
            sampling["logprobs"] = body.top_logprobs or 0
        width = beams.beam_width(body)
        if width is not None:
            span.request(model=self.requested_model(body), n=body.n, **span_fields(sampling))
            return await beams.respond(
                self, request, body, [(ids, None)], sampling, width, fields, priority
            )
        jobs = self.jobs([(ids, None)], body, sampling, fields)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        fields.update(id=cid, n=body.n, stream=body.stream)
        head = self.head(cid, "chat.completion", body.model)
        span.request(model=self.requested_model(body), params=jobs[0].params, n=body.n)
        span.response(cid, head["model"])
        running = await pumps.start(request, self.lifecycle, jobs, priority, span)
        if body.stream:
            return self._events(head, jobs, running, include_usage(body), plan, body)
        choices = await pumps.unless_gone(request, pumps.collect(running, len(jobs)))

        def build() -> list[dict]:  # decoding every logprob token in context: off the loop
            out = []
            for job in jobs:
                c = choices[job.index]
                lp = None
                if body.logprobs:
                    lp = protocol.chat_logprobs(c.logprobs, self.token_texts(job.prompt_ids))
                text, reason = "".join(c.text), c.last.finish_reason
                msg = {"role": "assistant", "content": text}
                if plan is not None:
                    content, calls = tools.parse(text, plan)
                    msg = tools.message(content, calls)
                    reason = tools.finish_reason(plan, calls, reason)
                choice = {
                    "index": job.index,
                    "message": msg,
                    "logprobs": lp,
                    "finish_reason": reason,
                }
                if body.return_token_ids:  # vLLM's: the output's on the choice
                    choice["token_ids"] = list(c.token_ids)
                out.append(choice)
            return out

        built = await self.lifecycle.off_loop(build) if body.logprobs else build()
        response = {**head, "choices": built, "usage": pumps.collected_usage(jobs, choices)}
        if body.return_token_ids:  # vLLM's: the prompt's (one prompt, the rendered messages)
            response["prompt_token_ids"] = list(ids)
        return response

    async def _events(
        self,
        head,
        jobs,
        running: pumps.Pumps,
        include_usage: bool,
        plan: tools.ToolPlan | None,
        body: protocol.ChatCompletionRequest,
    ):
        head = {**head, "object": "chat.completion.chunk"}
        outputs = [0] * len(jobs)
        texts = [self.token_texts(job.prompt_ids) for job in jobs]  # logprob tokens in context
        calls = _CallStreams(plan, len(jobs)) if plan is not None else None
        ids_wanted = body.return_token_ids
        async with contextlib.aclosing(running):
            for job in jobs:  # the role first, as OpenAI's stream does
                delta = {"role": "assistant", "content": ""}
                choice = streaming.delta_choice(job.index, delta, None, None)
                chunk = streaming.chunk(head, include_usage, choice)
                if ids_wanted:  # vLLM's: the prompt's in the first chunk, beside the choices
                    choice["token_ids"] = []
                    if job.index == 0:
                        chunk["prompt_token_ids"] = list(job.prompt_ids)
                yield chunk
            async for index, out in running:
                pumps.fail_if_error(out)
                lp = None
                if out.logprobs:
                    lp = protocol.chat_logprobs(out.logprobs, texts[index])
                outputs[index] = out.num_output_tokens
                # With return_token_ids, tokens that add no text (yet) have a chunk too.
                if out.text_delta or lp or out.finished or (ids_wanted and out.new_token_ids):
                    delta = {"content": out.text_delta} if out.text_delta else {}
                    reason = out.finish_reason
                    if calls is not None:
                        delta, reason = calls.delta(index, out.text_delta, reason)
                    choice = streaming.delta_choice(index, delta, lp, reason)
                    if ids_wanted:
                        choice["token_ids"] = list(out.new_token_ids)
                    yield streaming.chunk(head, include_usage, choice)
            if include_usage:
                usage = pumps.usage(jobs, outputs, running.firsts)
                yield {**head, "choices": [], "usage": usage}


class _CallStreams:
    """Turns each choice's text deltas into OpenAI's tool-call deltas.

    A named function's output is its arguments: a first delta names the call, then each text
    delta is an arguments delta. `auto` and `required` outputs are calls only once complete
    (a `<tool_call>` block, or the JSON object naming the function): their text is held back
    and sent at the end as content and/or calls, each call whole in one delta.
    """

    def __init__(self, plan: tools.ToolPlan, n: int):
        self.plan = plan
        self.held = [""] * n
        self.ids = [tools.new_call_id() for _ in range(n)]
        self.started = [False] * n

    def delta(self, index: int, text: str, reason: str | None) -> tuple[dict, str | None]:
        plan = self.plan
        if plan.mode == "named":
            call = {"index": 0, "function": {"arguments": text}}
            if not self.started[index]:
                self.started[index] = True
                call = {**tools.call(plan.name, text, self.ids[index]), "index": 0}
            return ({"tool_calls": [call]} if text or call.get("id") else {}), reason
        self.held[index] += text
        if reason is None:
            return {}, None
        content, calls = tools.parse(self.held[index], plan)
        delta = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(calls)]
        return delta, tools.finish_reason(plan, calls, reason)
