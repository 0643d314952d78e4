"""Tool calls on /v1/chat/completions: `tools` and `tool_choice` in, OpenAI `tool_calls` out.

After vLLM's tool parsers, for the Hermes / Qwen format the chat templates of those models ask
for: the tools are rendered into the prompt by the model's chat template, and a call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the output.

- `none` (the default without tools): tools are not offered; the output is text.
- `auto` (the default with tools): the output is free; `<tool_call>` blocks that parse become
  `tool_calls`, the text before them the content.
- `required`: the output is constrained (structured output) to one call of one of the tools,
  the JSON object `{"name": <one of the names>, "arguments": <that tool's parameters>}`.
- a named function: the output is constrained to that function's arguments object.

`parse` turns an output's text into (content, calls). A front end only translates: no
token logic here, the constraint does the enforcing.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from jaxserve.structured_output import StructuredOutput
from service import validation
from service.http import protocol
from service.validation import InvalidRequest

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ANY_OBJECT = {"type": "object"}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a chat call's tools ask of the engine and of the response."""

    mode: str  # "auto", "required" or "named"
    tools: list[dict]  # as the chat template receives them (OpenAI's shape)
    name: str | None = None  # the named function
    constraint: StructuredOutput | None = None  # required / named: the output's grammar


def plan(body: protocol.ChatCompletionRequest) -> ToolPlan | None:
    """The call's tool plan (None: no tools offered), checked: 400 naming the field at fault."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequest(
                f"tool_choice={_shown(choice)} needs tools: send the functions it may call.",
                "tool_choice",
            )
        return None
    if choice == "none":
        return None
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"tools has functions of the same name: {names}.", "tools")
    tools = [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools]
    params = {t.function.name: t.function.parameters or _ANY_OBJECT for t in body.tools}
    if choice in (None, "auto"):
        return ToolPlan("auto", tools)
    if choice == "required":
        one_of = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": schema},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, schema in params.items()
        ]
        spec = {"anyOf": one_of} if len(one_of) > 1 else one_of[0]
        return ToolPlan("required", tools, constraint=_constraint(spec, "tools"))
    name = choice.function.name
    if name not in params:
        raise InvalidRequest(
            f"tool_choice names function {name!r}, which is not among tools {names}.",
            "tool_choice",
        )
    i = names.index(name)
    return ToolPlan(
        "named", tools, name, _constraint(params[name], f"tools[{i}].function.parameters")
    )


def _constraint(schema: dict, field: str) -> StructuredOutput:
    return validation.structured_output({"json": schema}, field)


def _shown(choice) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.model_dump())


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call(name: str, arguments, call_id: str | None = None) -> dict:
    """One OpenAI tool call; `arguments` a JSON value or its text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


def parse(text: str, tools: ToolPlan) -> tuple[str | None, list[dict]]:
    """An output's (content, tool calls). Text that is not a call (an output cut by max_tokens
    before its JSON closed, or an `auto` answer in words) stays the content."""
    if tools.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [call(tools.name, text)]
    if tools.mode == "required":
        try:
            obj = json.loads(text)
        except ValueError:
            return text, []
        return None, [call(obj["name"], obj["arguments"])]
    calls = []
    for match in _CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            calls.append(call(obj["name"], obj.get("arguments", {})))
    if not calls:
        return text, []
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls


def finish_reason(tools: ToolPlan, calls: list[dict], reason: str | None) -> str | None:
    """OpenAI's: "tool_calls" where the model chose to call (auto, required); a forced call of
    a named function ends as "stop", as OpenAI's does."""
    if calls and tools.mode != "named" and reason == "stop":
        return "tool_calls"
    return reason


def message(content: str | None, calls: list[dict]) -> dict:
    """The assistant message of a choice."""
    out = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = calls
    return out
