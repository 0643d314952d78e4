"""Beam search over the OpenAI-compatible HTTP API (service/http/beams.py): the official `openai`
client against a real server, its choices checked against `LLM.beam_search` run offline on the
same engine before it serves.
"""

from __future__ import annotations

import http.client
import json
import math
import time

import pytest

from jaxserve import LLM
from tests.service.conftest import serving, wait_until
from tests.service.test_http import CHAT_TEMPLATE, MESSAGES, _chat_ids, _post

PROMPTS = ["Once upon a time", "Lily was sad. She cried and"]
MAX_TOKENS = 8
PERIOD = 426  # "." in stories260k's vocabulary
BEAM = dict(use_beam_search=True)  # the vLLM extra field, sent as extra_body


@pytest.fixture(scope="module")
def served(engine):
    """(server, expected): expected[key] is LLM.beam_search's beams (best first) for that case."""
    llm = LLM(engine=engine)
    expected = {}
    for prompt, beams in zip(
        PROMPTS, llm.beam_search(PROMPTS, beam_width=3, max_tokens=MAX_TOKENS), strict=True
    ):
        expected[prompt, 3] = beams
    # "." as a stop token ends beams at uneven lengths, and a length penalty below 1 then
    # ranks a short one among long ones that it would not reach at 1.
    [expected["short", 4]] = llm.beam_search(
        PROMPTS[1:], beam_width=4, max_tokens=12, length_penalty=0.3, stop_token_ids=[PERIOD]
    )
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    try:
        [expected["chat", 3]] = llm.beam_search(
            [_chat_ids(engine)], beam_width=3, max_tokens=MAX_TOKENS
        )
    finally:
        engine.tokenizer.chat_template = None
    with serving(engine, http_port=0) as server:
        yield server, expected


@pytest.fixture(scope="module")
def client(served):
    server, _ = served
    return server.openai()


def _same_beams(choices, beams, first_index=0):
    """The choices are these beams in this order: text, finish reason, logprob and score."""
    assert [c.index for c in choices] == list(range(first_index, first_index + len(beams)))
    assert [c.text if hasattr(c, "text") else c.message.content for c in choices] == [
        b.text for b in beams
    ]
    assert [c.finish_reason for c in choices] == [b.finish_reason for b in beams]
    for c, b in zip(choices, beams, strict=True):
        assert math.isclose(c.cumulative_logprob, b.cumulative_logprob, abs_tol=1e-4)
        assert math.isclose(c.score, b.score, abs_tol=1e-4)
    scores = [c.score for c in choices]
    assert scores == sorted(scores, reverse=True), "best first"


def test_width_three_returns_the_beams_of_llm_beam_search(served, client):
    _, expected = served
    want = expected[PROMPTS[0], 3]
    assert len({tuple(b.token_ids) for b in want}) == 3, "three distinct beams to compare"
    got = client.completions.create(
        model="any", prompt=PROMPTS[0], n=3, max_tokens=MAX_TOKENS, extra_body=BEAM
    )
    _same_beams(got.choices, want)
    # Each choice's tokens are the beam's: its text tokenizes back to them after the prompt.
    tokenizer = served[0].server.engine.tokenizer
    prompt_ids = tokenizer(PROMPTS[0])["input_ids"]
    for choice, beam in zip(got.choices, want, strict=True):
        ids = tokenizer(PROMPTS[0] + choice.text)["input_ids"]
        assert ids[len(prompt_ids) :] == [t for t in beam.token_ids if t != tokenizer.eos_token_id]
    assert got.usage.prompt_tokens == len(prompt_ids)
    assert got.usage.completion_tokens == sum(len(b.token_ids) for b in want)


def test_best_of_sets_the_width_and_n_how_many_per_prompt(served, client):
    _, expected = served
    got = client.completions.create(
        model="any", prompt=PROMPTS, n=2, max_tokens=MAX_TOKENS, extra_body={**BEAM, "best_of": 3}
    )
    assert len(got.choices) == 4
    _same_beams(got.choices[:2], expected[PROMPTS[0], 3][:2])
    _same_beams(got.choices[2:], expected[PROMPTS[1], 3][:2], first_index=2)
    want = [b for p in PROMPTS for b in expected[p, 3][:2]]
    assert got.usage.completion_tokens == sum(len(b.token_ids) for b in want)


def test_length_penalty_stop_token_ids_and_echo(served, client):
    _, expected = served
    want = expected["short", 4]
    assert {b.finish_reason for b in want} == {"stop", "length"}, "beams of uneven lengths"
    got = client.completions.create(
        model="any",
        prompt=PROMPTS[1],
        n=4,
        echo=True,
        max_tokens=12,
        extra_body={**BEAM, "length_penalty": 0.3, "stop_token_ids": [PERIOD]},
    )
    assert all(c.text.startswith(PROMPTS[1]) for c in got.choices)
    for c in got.choices:
        c.text = c.text[len(PROMPTS[1]) :]
    _same_beams(got.choices, want)


def test_chat_returns_the_best_beam_of_best_of(served, client, engine):
    _, expected = served
    want = expected["chat", 3]
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    try:
        got = client.chat.completions.create(
            model="any",
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={**BEAM, "best_of": 3},
        )
        _same_beams(got.choices, want[:1])
        assert got.choices[0].message.role == "assistant"
        chunks = list(
            client.chat.completions.create(
                model="any",
                messages=MESSAGES,
                max_tokens=MAX_TOKENS,
                n=3,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=BEAM,
            )
        )
    finally:
        engine.tokenizer.chat_template = None
    # One chunk per whole choice once the search has ended, then the usage.
    assert [[c.index for c in chunk.choices] for chunk in chunks] == [[0], [1], [2], []]
    assert [c.choices[0].delta.content for c in chunks[:3]] == [b.text for b in want]
    assert [c.choices[0].finish_reason for c in chunks[:3]] == [b.finish_reason for b in want]
    assert chunks[-1].usage.completion_tokens == sum(len(b.token_ids) for b in want)


def test_streamed_completion_sends_each_beam_whole(served, client):
    _, expected = served
    want = expected[PROMPTS[0], 3]
    chunks = list(
        client.completions.create(
            model="any", prompt=PROMPTS[0], n=3, max_tokens=MAX_TOKENS, stream=True,
            extra_body=BEAM,
        )
    )  # fmt: skip
    assert len(chunks) == 3
    _same_beams([c.choices[0] for c in chunks], want)


BAD = [
    (dict(temperature=0.7), "use_beam_search", ["use_beam_search=true", "temperature=0.7"]),
    (dict(top_p=0.5), "use_beam_search", ["top_p=0.5"]),
    (dict(logprobs=2), "use_beam_search", ["logprobs=2"]),
    (dict(n=4, best_of=2), "n", ["n=4", "best_of=2"]),
    (dict(n=1), "n", ["use_beam_search=true with n=1", "[2, 10]"]),
    (dict(n=2, best_of=11), "best_of", ["best_of=11", "[2, 10]"]),
    (dict(n=2, early_stopping=False), "early_stopping", ["early_stopping=False"]),
    (dict(n=2, max_tokens=0, echo=True), "max_tokens", ["max_tokens=0", "use_beam_search"]),
    (dict(use_beam_search=False, length_penalty=0.5), "length_penalty", ["length_penalty=0.5"]),
    (dict(use_beam_search=False, n=1, best_of=3), "best_of", ["best_of=3", "n=1"]),
]


@pytest.mark.parametrize("what,param,parts", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_combinations_are_400_naming_the_values(served, what, param, parts):
    server, _ = served
    body = {"model": "any", "prompt": PROMPTS[0], "n": 3, **BEAM, **what}
    status, error = _post(server, "/v1/completions", body)
    assert status == 400, error
    error = error["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for part in parts:
        assert part in error["message"], error["message"]
    assert error["message"].endswith("."), "a whole sentence"


def test_a_client_that_leaves_mid_search_aborts_its_beams(served):
    server, _ = served
    async_engine = server.server.engine
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=30)
    body = {"prompt": PROMPTS[0], "n": 4, "max_tokens": 200, "ignore_eos": True, **BEAM}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    # Past the first iteration: several beams' requests in the engine at once.
    wait_until(lambda: len(async_engine.snapshot().request_ids) > 1, timeout=20)
    start = async_engine.snapshot().iteration
    conn.sock.close()
    conn.close()

    def idle():
        # Twice, 0.2 s apart: between two iterations of a search its requests have all finished
        # and the next ones are not added yet, so one look can find no requests mid-search.
        first = async_engine.snapshot()
        time.sleep(0.2)
        second = async_engine.snapshot()
        quiet = first.iteration == second.iteration
        return quiet and not first.request_ids and not second.request_ids

    wait_until(idle, timeout=30)
    snap = async_engine.snapshot()
    assert snap.slots_used == 0 and snap.kv_pages_used == 0
    assert snap.iteration - start < 150  # cancelled, not run to its 200 tokens
