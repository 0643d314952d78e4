"""Logprobs under a constraint, in strict JSON (RFC 8259), over raw HTTP (issue 47, item 1).

A grammar's mask gives every token it forbids logprob -inf. Listed among the top logprobs,
they made a constrained request with `logprobs` answer 400 ("Out of range float values are not
JSON compliant": a server fault read as the client's error) and stream `-Infinity` inside
`data:` lines, which a strict client cannot parse. Here every body and every `data:` line is
read as the bytes the server sent and parsed refusing NaN and Infinity (strict_json.loads), for
the three constraints a client can send with logprobs (vLLM's `structured_outputs` regex and
`choice`, OpenAI's `response_format` json_schema on chat), streamed and not, and each row's
alternatives are checked against the constraint: a masked token is never listed, and where
fewer tokens than asked are allowed the row lists fewer, all of them (their probabilities then
sum to 1: the logprobs are those of the masked distribution). A response the server cannot
write as JSON is a 500 logged with its traceback, never a 400.
"""

from __future__ import annotations

import json
import logging
import math

import jsonschema
import pytest
import regex

from jaxserve.engine import core
from jaxserve.outputs import TokenLogprob
from tests.service import strict_json
from tests.service.conftest import serving
from tests.service.test_http_structured import CHAT_TEMPLATE, JSON_FORMAT, MESSAGES, SCHEMA

TIME = r"[0-9]{2}:[0-9]{2} (am|pm)"
CHOICES = ["yes", "no", "maybe so"]
END_TOKENS = ("<s>", "</s>")  # stories260k's end tokens (its config lists both as EOS)


@pytest.fixture(scope="module")
def server(engine):
    # The embedded model has no chat template: the server's own renders chat (--chat-template).
    with serving(engine, http_port=0, chat_template=CHAT_TEMPLATE) as server:
        yield server


def _call(server, path: str, body: dict) -> tuple[int, object]:
    return strict_json.post(server.server.http_port, path, body)


def _completion_rows(status: int, answer, stream: bool) -> tuple[str, list[tuple]]:
    """The text of choice 0 and its (token, chosen logprob, top logprobs) rows, joined over the
    chunks when streamed."""
    assert status == 200, answer
    if not stream:
        choice = answer["choices"][0]
        text, pieces = choice["text"], [choice["logprobs"]]
    else:
        assert answer[-1] == "[DONE]", answer[-3:]
        choices = [e["choices"][0] for e in answer[:-1] if e["choices"]]
        text = "".join(c["text"] for c in choices)
        pieces = [c["logprobs"] for c in choices if c["logprobs"] is not None]
    rows = [
        row
        for lp in pieces
        for row in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
    ]
    return text, rows


def _check_rows(rows, n: int, allowed) -> None:
    """Each row: the chosen token's logprob finite and <= 0, at most n alternatives, each allowed
    by the constraint after the text so far (`allowed(prefix, key)`), the chosen one listed at
    its own logprob when it is among them; a row of fewer than n lists every allowed token, so
    their probabilities sum to 1. Some row must be such a one, or the test proves nothing."""
    prefix, narrowed = "", 0
    for token, logprob, top in rows:
        assert math.isfinite(logprob) and logprob <= 0, (prefix, token, logprob)
        assert 1 <= len(top) <= n, (prefix, top)
        for key, value in top.items():
            assert math.isfinite(value) and value <= 0, (prefix, key, value)
            assert allowed(prefix, key), f"{key!r} is masked after {prefix!r}, yet listed: {top}"
        if token in top:
            assert top[token] == pytest.approx(logprob, abs=1e-6), (prefix, token, top)
        if len(top) < n:
            narrowed += 1
            total = sum(math.exp(v) for v in top.values())
            assert total == pytest.approx(1.0, abs=1e-3), (prefix, top)
        prefix += token
    assert narrowed, f"no row allowed fewer than {n} tokens: {rows}"


def _is_choice_prefix(prefix: str, key: str) -> bool:
    if key in END_TOKENS:  # only where the text is one of the choices
        return prefix in CHOICES
    return key.startswith("token_id:") or any(c.startswith(prefix + key) for c in CHOICES)


def _is_time_prefix(prefix: str, key: str) -> bool:
    if key in END_TOKENS:
        return regex.fullmatch(TIME, prefix) is not None
    return key.startswith("token_id:") or bool(regex.fullmatch(TIME, prefix + key, partial=True))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("constraint", "n", "allowed", "check_text"),
    [
        ({"choice": CHOICES}, 5, _is_choice_prefix, lambda t: t in CHOICES),
        ({"regex": TIME}, 2, _is_time_prefix, lambda t: regex.fullmatch(TIME, t) is not None),
    ],
    ids=["choice", "regex"],
)
def test_constrained_completion_logprobs_are_strict_json(
    server, constraint, n, allowed, check_text, stream
):
    for seed in range(3):
        body = {
            "prompt": "At",
            "max_tokens": 20,
            "temperature": 1.0,
            "seed": seed,
            "logprobs": n,
            "structured_outputs": constraint,
            "stream": stream,
        }
        text, rows = _completion_rows(*_call(server, "/v1/completions", body), stream)
        assert check_text(text), text
        assert "".join(token for token, _, _ in rows) == text
        _check_rows(rows, n, allowed)


def test_streamed_constrained_logprobs_equal_the_whole_answer(server):
    body = {
        "prompt": "At",
        "max_tokens": 20,
        "temperature": 0,
        "logprobs": 5,
        "structured_outputs": {"choice": CHOICES},
    }
    text, rows = _completion_rows(*_call(server, "/v1/completions", body), False)
    streamed = _completion_rows(*_call(server, "/v1/completions", {**body, "stream": True}), True)
    assert streamed[0] == text and len(streamed[1]) == len(rows)
    for (token, logprob, top), (s_token, s_logprob, s_top) in zip(rows, streamed[1], strict=True):
        assert s_token == token and s_logprob == pytest.approx(logprob, abs=1e-5)
        assert s_top == pytest.approx(top, abs=1e-5)  # the same alternatives, as many


def _chat_rows(status: int, answer, stream: bool) -> tuple[str, list[tuple]]:
    """The content of choice 0 and its (token, logprob, {alternative: logprob}) rows."""
    assert status == 200, answer
    if not stream:
        choice = answer["choices"][0]
        content, entries = choice["message"]["content"], choice["logprobs"]["content"]
    else:
        assert answer[-1] == "[DONE]", answer[-3:]
        choices = [e["choices"][0] for e in answer[:-1] if e["choices"]]
        content = "".join(c["delta"].get("content") or "" for c in choices)
        entries = [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
    rows = []
    for e in entries:
        assert bytes(e["bytes"]).decode("utf-8") == e["token"]
        rows.append(
            (e["token"], e["logprob"], {t["token"]: t["logprob"] for t in e["top_logprobs"]})
        )
    return content, rows


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_with_logprobs_is_strict_json(server, stream):
    body = {
        "messages": MESSAGES,
        "response_format": JSON_FORMAT,
        "max_tokens": 120,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "stream": stream,
    }
    content, rows = _chat_rows(*_call(server, "/v1/chat/completions", body), stream)
    jsonschema.validate(json.loads(content), SCHEMA)
    assert "".join(token for token, _, _ in rows) == content

    def allowed(prefix: str, key: str) -> bool:  # the object's first character, then any
        return bool(prefix) or key.startswith("{")

    _check_rows(rows, 3, allowed)


def test_a_response_that_is_not_json_is_a_500_logged_as_a_server_bug(server, monkeypatch, caplog):
    """The engine's filter of masked tokens undone (one function patched): the -inf that then
    reaches the response is the server's bug, answered 500 naming where it is, not 400."""
    unfiltered = core._logprob_of

    def with_a_masked_token(host, row, seq) -> TokenLogprob:
        entry = unfiltered(host, row, seq)
        return TokenLogprob(entry.token_id, entry.logprob, [*entry.top, (0, -math.inf)])

    monkeypatch.setattr(core, "_logprob_of", with_a_masked_token)
    body = {"prompt": "At", "max_tokens": 3, "logprobs": 2, "structured_outputs": {"regex": TIME}}
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        status, answer = _call(server, "/v1/completions", body)
        stream_status, events = _call(server, "/v1/completions", {**body, "stream": True})
    assert status == 500, answer
    message = answer["error"]["message"]
    assert answer["error"]["type"] == "internal_error"
    assert "is not JSON (RFC 8259)" in message and "bug in the server" in message, message
    assert "choices[0].logprobs.top_logprobs[0]" in message and "=-inf" in message, message
    # Streamed, the status was sent before the first chunk: the stream ends with the error.
    assert stream_status == 200 and "[DONE]" not in events, events
    assert events[-1]["error"]["type"] == "internal_error", events
    assert "is not JSON (RFC 8259)" in events[-1]["error"]["message"]
    bugs = [r for r in caplog.records if r.message == "unexpected error in an HTTP call"]
    assert len(bugs) == 2 and all(r.exc_info for r in bugs), caplog.text
    codes = [r.fields["code"] for r in caplog.records if r.message == "http call"]
    assert codes == [500, 500], caplog.text
