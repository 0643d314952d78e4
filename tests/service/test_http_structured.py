"""Structured output and tool calls over the HTTP API, through the official `openai` client.

The embedded stories260k knows no JSON: whatever it says, the constraint must hold, so every
check here is of the constraint (the output validates, the call names a tool and its arguments
fit the tool's parameters), and stream against non-stream at temperature 0.
"""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest

from jaxserve.runtime import compiles
from service.gen.jaxserve.v1 import jaxserve_pb2 as pb
from service.http import tools
from tests.service.conftest import serving

# Short, so the tools fit stories260k's small context; names the offered functions.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools: {{ tools | map(attribute='function.name') | join(',') }}"
    "\n{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {"floor": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["floor"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "home"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "Tell me"}]
JSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "p", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def server(engine):
    # The embedded model has no chat template: the server's own renders chat (--chat-template).
    with serving(engine, http_port=0, chat_template=CHAT_TEMPLATE) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_response_format_json_schema_on_chat_and_completions(client):
    before = compiles.serving()
    for seed in range(4):
        chat = client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            response_format=JSON_FORMAT,
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
        text = client.completions.create(
            model="m",
            prompt="Once upon a time",
            temperature=1.0,
            seed=seed,
            max_tokens=120,
            extra_body={"response_format": JSON_FORMAT},
        )
        assert text.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text.choices[0].text), SCHEMA)
    assert compiles.serving() == before


def test_json_object_and_vllm_structured_outputs(client):
    obj = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        response_format={"type": "json_object"},
        temperature=0.7,
        seed=3,
        max_tokens=100,
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # a free-form object may run long; what there is starts as one
        assert obj.choices[0].message.content.startswith("{")
    regex = r"[0-9]{2}:[0-9]{2} (am|pm)"
    for seed in range(3):
        out = client.completions.create(
            model="m",
            prompt="At",
            temperature=1.0,
            seed=seed,
            max_tokens=20,
            extra_body={"structured_outputs": {"regex": regex}},
        )
        assert __import__("re").fullmatch(regex, out.choices[0].text)
        pick = client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            temperature=1.0,
            seed=seed,
            max_tokens=20,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
        )
        assert pick.choices[0].message.content in ("yes", "no", "maybe so")


def test_stream_equals_non_stream_at_temperature_zero(client):
    args = dict(
        model="m", messages=MESSAGES, response_format=JSON_FORMAT, temperature=0, max_tokens=120
    )
    whole = client.chat.completions.create(**args).choices[0].message.content
    chunks = client.chat.completions.create(**args, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SCHEMA)


def test_tool_choice_required_returns_a_valid_call(client):
    for seed in range(3):
        out = client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"


def test_named_tool_streams_argument_deltas_that_add_up(client):
    args = dict(
        model="m",
        messages=MESSAGES,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
    )
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "stop"
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    name, arguments, reasons = None, "", []
    for chunk in client.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta
        for c in delta.tool_calls or ():
            assert c.index == 0
            name = c.function.name or name
            arguments += c.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert (name, arguments) == ("get_weather", call.function.arguments)
    assert reasons[-1] == "stop"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "strng"}}},
                    },
                }
            },
            "strng",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "1 to 1024"),
        ({"response_format": {"type": "yaml"}}, "'yaml'"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope'",
        ),
        ({"tool_choice": "required"}, "needs tools"),
        ({"structured_outputs": {"regex": "a+"}, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_bad_constraints_are_400_naming_the_problem(client, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert words in str(e.value)
    ok = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"  # the engine serves on


def test_grpc_structured_output_and_its_invalid_argument(server):
    with server.client() as grpc_client:
        for seed in range(2):
            out = grpc_client.generate_unary(
                "Once upon a time",
                max_tokens=120,
                temperature=1.0,
                seed=seed,
                structured_output={"json": SCHEMA},
            )
            assert out.finish_reason == pb.FINISH_REASON_STOP
            jsonschema.validate(json.loads(out.text), SCHEMA)
        pick = grpc_client.generate_unary(
            "Once", max_tokens=8, structured_output={"choice": ["left", "right"]}
        )
        assert pick.text in ("left", "right")
        with pytest.raises(grpc.RpcError) as e:
            grpc_client.generate_unary("Once", structured_output={"regex": "[z-a]"})
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.structured_output.regex" in e.value.details()


def test_auto_parses_hermes_tool_call_blocks():
    """`auto` leaves the output free and reads the Hermes / Qwen format out of its text."""
    plan = tools.ToolPlan("auto", [WEATHER])
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"days": 2}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = tools.parse(text, plan)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("get_time", {}),
    ]
    assert tools.finish_reason(plan, calls, "stop") == "tool_calls"
    # No call, or a block that does not parse: the text is the answer.
    assert tools.parse("Sunny.", plan) == ("Sunny.", [])
    assert tools.parse("<tool_call>{broken</tool_call>", plan) == (
        "<tool_call>{broken</tool_call>",
        [],
    )


def test_an_auto_call_cut_by_max_tokens_finishes_length_streamed_or_not():
    """A whole `<tool_call>` block, then the output cut by max_tokens: the call is parsed, but
    the model did not choose to stop, so the finish is "length" (a client must not run a call
    whose turn did not end); ended by the model, the same text is "tool_calls"."""
    from service.http.chat import _CallStreams

    plan = tools.ToolPlan("auto", [WEATHER])
    text = (
        'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}'
        '</tool_call> and then <tool_call>{"name": "get_'
    )
    content, calls = tools.parse(text, plan)
    assert content == "Checking." and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert tools.finish_reason(plan, calls, "length") == "length"
    assert tools.finish_reason(plan, calls, "stop") == "tool_calls"
    # Streamed: held back to the end, then the call in one delta and the same finish.
    for reason, want in (("length", "length"), ("stop", "tool_calls")):
        streams = _CallStreams(plan, 1)
        pieces = [text[:20], text[20:70], text[70:]]
        got = [streams.delta(0, piece, None) for piece in pieces[:-1]]
        assert got == [({}, None), ({}, None)]
        delta, finish = streams.delta(0, pieces[-1], reason)
        assert finish == want
        assert delta["content"] == "Checking."
        assert [c["function"]["name"] for c in delta["tool_calls"]] == ["get_weather"]
    # `required` cut before its JSON closed: no call, the text is the content, "length".
    required = tools.ToolPlan("required", [WEATHER])
    cut = '{"name": "get_weather", "argu'
    assert tools.parse(cut, required) == (cut, [])
    assert tools.finish_reason(required, [], "length") == "length"


def test_required_tool_call_streams_whole_as_non_streamed(client):
    args = dict(
        model="m",
        messages=MESSAGES,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    (call,) = client.chat.completions.create(**args).choices[0].message.tool_calls
    streamed, reasons = [], []
    for chunk in client.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta
        streamed += [(c.function.name, c.function.arguments) for c in delta.tool_calls or ()]
        reasons.append(chunk.choices[0].finish_reason)
    assert streamed == [(call.function.name, call.function.arguments)]
    assert reasons[-1] == "tool_calls"


def test_a_history_with_a_call_and_its_answer_renders_and_runs(client):
    """The assistant's earlier call and the tool's answer go back in the history."""
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    out = client.chat.completions.create(
        model="m", messages=history, tools=[CLOCK], max_tokens=4, temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length")
