"""The HTTP front end's pieces that need no server: the bounded JSON parser (service/http/body.py),
the strict JSON every response is written in (service/http/protocol.dumps) and logprob tokens
decoded in context (service/http/token_texts.py), against references that are not our code
(`json.loads`, the tokenizer's own decode of the whole sequence)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.http import body, protocol
from service.http.token_texts import TokenTexts
from service.validation import InvalidRequest

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),  # NaN != NaN: checked apart
    st.text(),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(value=_json, indent=st.sampled_from([None, 0, 2]), separators=st.booleans())
def test_the_paced_parser_reads_what_json_loads_reads(value, indent, separators):
    text = json.dumps(value, indent=indent, separators=(",", ":") if separators else None)
    assert body.loads(text, 10**6) == json.loads(text)


def test_the_paced_parser_takes_json_loads_extras_and_refuses_what_it_refuses():
    # NaN and the infinities, a repeated key (the last wins), runs of integers in big arrays
    got = body.loads('[NaN, Infinity, -Infinity, {"a": 1, "a": 2}]', 100)
    assert math.isnan(got[0]) and got[1:] == [math.inf, -math.inf, {"a": 2}]
    ids = list(range(-5, 20_000))
    assert body.loads(json.dumps({"prompt": ids}), 10**6) == {"prompt": ids}
    assert body.loads("[1, 2.5, 3, 12345678901234567890123, 4]", 100)[3] == 12345678901234567890123
    for bad in ("[1,]", "[01]", '{"a" 1}', "[1 2]", "", "[", '{"a":1,}', "tru", "[1]x", '"\x01"'):
        with pytest.raises(json.JSONDecodeError):
            json.loads(bad)
        with pytest.raises(json.JSONDecodeError):
            body.loads(bad, 100)


@pytest.mark.parametrize("opener,closer", [("[", "]"), ('{"a":', "}")])
def test_nesting_beyond_max_depth_is_refused_without_recursion(opener, closer):
    for depth in (body.MAX_DEPTH + 1, 100_000):
        for closed in (True, False):  # well formed, or the brackets never closed
            text = opener * depth + "1" + (closer * depth if closed else "")
            with pytest.raises(InvalidRequest, match=f"more than {body.MAX_DEPTH} levels"):
                body.decode(text.encode(), 10**7)
    ok = opener * body.MAX_DEPTH + "1" + closer * body.MAX_DEPTH
    assert body.decode(ok.encode(), 10**7) == json.loads(ok)


def test_a_body_with_more_values_than_allowed_is_refused_early():
    for data in (
        {"prompt": list(range(50_000))},
        {"logit_bias": {str(i): 1 for i in range(50_000)}},
        {"messages": [{"role": "user", "content": "a"}] * 20_000},
    ):
        raw = json.dumps(data).encode()
        assert body.decode(raw, 10**6) == data
        with pytest.raises(InvalidRequest, match="holds more than 1000 values"):
            body.decode(raw, 1000)


def test_a_lone_surrogate_is_named_by_its_field():
    raw = b'{"prompt": "ok", "messages": [{"content": "a\\ud800b"}]}'
    with pytest.raises(InvalidRequest) as err:
        body.find_lone_surrogate(raw, json.loads(raw))
    assert err.value.param == "messages"
    assert "messages[0].content='a\\ud800b' holds a lone surrogate (U+D800" in str(err.value)
    pair = b'{"prompt": "\\ud83d\\ude00"}'  # a pair is one character: no error
    body.find_lone_surrogate(pair, json.loads(pair))


# ---- logprob tokens in context --------------------------------------------------------------


def _walk(tokenizer, context, ids):
    texts = TokenTexts(tokenizer, context)
    return [texts.step(t)[0] for t in ids]


def test_responses_are_compact_utf8_strict_json_and_a_non_finite_value_is_named():
    """protocol.dumps writes every body and SSE event: compact, UTF-8 as it is (not \\u
    escapes), and a NaN or infinity anywhere is ResponseNotJson naming where it is."""
    value = {"text": "é ✓", "ids": [1, 2.5], "nested": {"a": None}}
    assert protocol.dumps(value) == '{"text":"é ✓","ids":[1,2.5],"nested":{"a":null}}'
    suffix = " is not a finite number; this is a bug in the server."
    cases = [
        (math.nan, "the body=nan"),
        ({"choices": [{"logprobs": {"top": [0.0, -math.inf]}}]}, "choices[0].logprobs.top[1]=-inf"),
        ([1, {"x": math.inf}], "[1].x=inf"),
        ({math.inf: 1}, "a value"),  # a key: json refuses it, the path search looks at values
    ]
    for bad, where in cases:
        with pytest.raises(protocol.ResponseNotJson) as e:
            protocol.dumps(bad)
        assert str(e.value) == f"The response is not JSON (RFC 8259): {where}{suffix}"
        assert isinstance(e.value.__cause__, ValueError)


@pytest.mark.parametrize(
    "text", ["Once upon a time, there was a little girl", "中文 é 😀 naïve\n  two  spaces."]
)
def test_token_texts_add_up_to_the_decoded_text(engine, text):
    tokenizer = engine.tokenizer
    prompt = tokenizer("Lily said", add_special_tokens=True)["input_ids"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(x):
        return tokenizer.decode(x, skip_special_tokens=True)

    # A prompt from its first token (BOS adds nothing), and an output after its prompt.
    pieces = _walk(tokenizer, (), prompt + ids)
    assert pieces[0] == "" and "".join(pieces) == decode(prompt + ids)
    pieces = _walk(tokenizer, prompt, ids)
    assert "".join(pieces) == decode(prompt + ids)[len(decode(prompt)) :]
    assert pieces[0].startswith(" ")  # SentencePiece's leading space, which decode([id]) drops


def test_token_texts_stay_in_context_far_past_the_kept_window(engine):
    """TokenTexts keeps the tokens since the last text it gave out, trimming them once that
    point passes 64 tokens: over a sequence of several hundred tokens (trimmed many times,
    byte pieces of split characters across the trims), the chosen texts still add up to the
    decoded text, and each alternative's text is what it would have added in the whole
    sequence's context."""
    tokenizer = engine.tokenizer
    vocab = tokenizer.get_vocab()
    line = "Once upon a time, there was a little girl. 中文 é 😀 naïve  two  spaces.\n"
    ids = tokenizer(line * 10, add_special_tokens=False)["input_ids"]
    assert len(ids) > 6 * 64
    prompt = tokenizer("Lily said", add_special_tokens=True)["input_ids"]
    alternatives = [vocab["\u2581a"], vocab["a"], tokenizer.eos_token_id]

    def decode(x):
        return tokenizer.decode(x, skip_special_tokens=True)

    texts = TokenTexts(tokenizer, prompt)
    pieces, checked = [], 0
    for i, token in enumerate(ids):
        whole = prompt + ids[:i]
        complete = not decode(whole).endswith("\ufffd")  # no split character pending
        text, alt_texts = texts.step(token, alternatives)
        pieces.append(text)
        if complete and i > 64:
            before = decode(whole)
            want = [decode([*whole, a])[len(before) :] for a in alternatives]
            assert alt_texts == want, (i, alt_texts, want)
            checked += 1
    assert "".join(pieces) == decode(prompt + ids)[len(decode(prompt)) :]
    assert checked > 4 * 64  # most positions past the first trim
    assert alt_texts[0] == " a" and alt_texts[2] == ""  # in context: the space; EOS adds none


def test_alternatives_with_the_same_text_keep_distinct_keys(engine):
    tokenizer = engine.tokenizer
    vocab = tokenizer.get_vocab()
    a, byte_a, space_a = vocab["a"], vocab["<0x61>"], vocab["\u2581a"]
    eos, byte_e4 = tokenizer.eos_token_id, vocab["<0xE4>"]
    context = tokenizer("Once upon", add_special_tokens=True)["input_ids"]
    texts = TokenTexts(tokenizer, context)
    alternatives = [(space_a, -1.0), (a, -2.0), (byte_a, -3.0), (eos, -4.0), (byte_e4, -5.0)]
    chosen = space_a
    text, alt_texts = texts.step(chosen, [t for t, _ in alternatives])
    top = texts.top(chosen, text, alternatives, alt_texts)
    keys = [key for key, _, _ in top]
    # " a" and "a" differ in context; the byte piece that also reads "a" keeps its id; EOS is
    # named, and a byte that is no character alone is OpenAI's "bytes:".
    assert keys == [" a", "a", f"token_id:{byte_a}", "</s>", "bytes:\\xe4"]
    assert [raw for _, _, raw in top] == [b" a", b"a", b"a", b"", b"\xe4"]
    assert text == " a"
