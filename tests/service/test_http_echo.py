"""`echo` with `logprobs` on POST /v1/completions: the prompt's own logprobs come first, as
OpenAI sends them, checked through the official `openai` client against transformers' PyTorch
forward of the embedded stories260k (not against our own code); and `max_tokens=0` with echo
scores a prompt without generating. Logprob tokens are texts in context: joined, they are the
choice's text (prompt and output, completions and chat), checked against the tokenizer's own
decode of the whole sequence.
"""

from __future__ import annotations

import itertools

import numpy as np
import openai
import pytest
from transformers import AutoModelForCausalLM

import checkpoints
from tests.service.test_http import _post
from tests.torch_reference import require_torch

PROMPT = "Once upon a time, there was a little girl named Lily"
K = 3
TOL = 1e-4  # float32 on both sides


@pytest.fixture(scope="module")
def reference(engine):
    """(prompt ids, f32[len, V] transformers' log_softmax: row i scores the token after i)."""
    torch = require_torch()
    ids = engine.encode(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoints.DEFAULT_MODEL_DIR, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return ids, torch.log_softmax(logits, dim=-1).numpy()


def _added(engine, context: list[int], token_id: int) -> str:
    """What token_id adds to the text after `context`, by the tokenizer's own decode."""
    tokenizer = engine.tokenizer
    before = tokenizer.decode(context, skip_special_tokens=True)
    return tokenizer.decode([*context, token_id], skip_special_tokens=True)[len(before) :]


def check_offsets(logprobs, start: int = 0) -> None:
    """Each token's offset is where it starts in the text: its predecessors' lengths added up."""
    lengths = [len(t) for t in logprobs.tokens]
    assert logprobs.text_offset == [start + x for x in itertools.accumulate([0, *lengths[:-1]])]


def check_prompt_part(logprobs, reference, engine) -> None:
    """The first len(prompt) entries of a completions logprobs object are the prompt's."""
    ids, ref = reference
    n = len(ids)
    # Texts in context: joined, the prompt; BOS, which is not in the text, adds nothing to it.
    assert logprobs.tokens[0] == "" and "".join(logprobs.tokens[:n]) == PROMPT
    assert logprobs.tokens[2] == " upon"  # SentencePiece's space, lost when decoded alone
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, n):
        assert logprobs.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]], abs=TOL), i
        top = logprobs.top_logprobs[i]
        want = np.sort(ref[i - 1])[::-1][:K]
        assert len(top) == K  # keys never collide
        for value in top.values():
            assert np.min(np.abs(want - value)) < TOL, i
        best = int(np.argmax(ref[i - 1]))
        key = logprobs.tokens[i] if best == ids[i] else _added(engine, ids[:i], best)
        assert top[key] == pytest.approx(ref[i - 1, best], abs=TOL)
    assert logprobs.text_offset[:n] == [sum(map(len, logprobs.tokens[:i])) for i in range(n)]


def test_echo_with_logprobs_starts_with_the_prompts_logprobs(client, engine, reference):
    ids, _ = reference
    got = client.completions.create(
        model="any", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=K
    )
    choice = got.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) + 4
    check_prompt_part(lp, reference, engine)
    # Then the generated tokens, greedy: each is its top entry, offsets after the echoed text.
    for chosen, top in zip(lp.token_logprobs[len(ids) :], lp.top_logprobs[len(ids) :], strict=True):
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
    assert lp.text_offset[len(ids)] == len(PROMPT)
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 4

    # Streamed: the same logprobs, the prompt's in the first chunk of the choice.
    chunks = [
        c
        for c in client.completions.create(
            model="any",
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            echo=True,
            logprobs=K,
            stream=True,
        )
        if c.choices
    ]
    first = chunks[0].choices[0]
    assert first.text == PROMPT and len(first.logprobs.tokens) == len(ids)
    check_prompt_part(first.logprobs, reference, engine)
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    assert "".join(c.choices[0].text for c in chunks) == choice.text


def test_max_tokens_0_with_echo_scores_the_prompt(client, engine, reference, server):
    ids, _ = reference
    for prompt in (PROMPT, ids):  # as text and as token ids
        got = client.completions.create(
            model="any", prompt=prompt, max_tokens=0, echo=True, logprobs=K
        )
        choice = got.choices[0]
        assert choice.text == engine.tokenizer.decode(ids, skip_special_tokens=True)
        assert choice.finish_reason == "length"
        assert len(choice.logprobs.tokens) == len(ids)
        check_prompt_part(choice.logprobs, reference, engine)
        assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == len(ids)
    chunks = list(
        client.completions.create(
            model="any",
            prompt=PROMPT,
            max_tokens=0,
            echo=True,
            logprobs=K,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == PROMPT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    # Without echo there is nothing to return: refused, the field named.
    status, body = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    assert "echo" in body["error"]["message"]


def test_echo_logprobs_for_several_prompts_and_bad_values(client, server, engine, reference):
    ids, _ = reference
    got = client.completions.create(
        model="any", prompt=[ids, ids[:4]], max_tokens=2, temperature=0, echo=True, logprobs=K
    )
    full, short = got.choices[0].logprobs, got.choices[1].logprobs
    check_prompt_part(full, reference, engine)
    assert short.token_logprobs[1:4] == pytest.approx(full.token_logprobs[1:4], abs=1e-5)
    assert len(short.tokens) == 4 + 2
    # n samples of a prompt: each choice starts with the prompt's logprobs (the first sample
    # computes them for all), streamed or not.
    kwargs = dict(model="any", prompt=PROMPT, max_tokens=3, n=2, seed=5, echo=True, logprobs=K)
    for choice in client.completions.create(**kwargs).choices:
        check_prompt_part(choice.logprobs, reference, engine)
    firsts = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice)
    assert sorted(firsts) == [0, 1]
    for choice in firsts.values():
        assert choice.text == PROMPT
        check_prompt_part(choice.logprobs, reference, engine)
    # Echo without logprobs: the text only, no logprobs object.
    plain = client.completions.create(model="any", prompt=PROMPT, max_tokens=2, echo=True)
    assert plain.choices[0].logprobs is None and plain.choices[0].text.startswith(PROMPT)
    with pytest.raises(openai.BadRequestError, match="logprobs=21"):
        client.completions.create(model="any", prompt=PROMPT, echo=True, logprobs=21)


def test_logprob_tokens_add_up_to_the_text_and_top_keys_never_collide(client, engine):
    """Tokens decoded in context, streamed or not, completions and chat: joined they are the
    text, offsets point into it, and logprobs=20 gives 20 keys however the alternatives read
    alone ("▁a" and "a" were both "a", so 19 keys came back)."""
    got = client.completions.create(
        model="any", prompt=PROMPT, max_tokens=40, temperature=0, logprobs=20
    )
    choice = got.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and " " in choice.text
    check_offsets(lp)
    assert all(len(top) == 20 for top in lp.top_logprobs)
    for token, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        if token:  # greedy, keyed by the text in `tokens` (EOS adds none: keyed "</s>")
            assert top[token] == max(top.values())
    chunks = list(
        client.completions.create(
            model="any", prompt=PROMPT, max_tokens=40, temperature=0, logprobs=20, stream=True
        )
    )
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.tokens]
    offsets = [
        x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset
    ]
    assert streamed == lp.tokens and offsets == lp.text_offset
    # logprobs=0: the chosen tokens alone, streamed too
    chunks = list(
        client.completions.create(
            model="any", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0, stream=True
        )
    )
    tokens = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.tokens]
    assert "".join(tokens) == "".join(c.choices[0].text for c in chunks) and len(tokens) == 8
    # With echo: the prompt's tokens, then the output's, one text.
    echoed = client.completions.create(
        model="any", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2, echo=True
    ).choices[0]
    assert "".join(echoed.logprobs.tokens) == echoed.text
    check_offsets(echoed.logprobs)


def test_chat_logprob_tokens_add_up_to_the_content(client, engine):
    from tests.service.test_http import CHAT_TEMPLATE, MESSAGES

    engine.tokenizer.chat_template = CHAT_TEMPLATE
    try:
        for stream in (False, True):
            got = client.chat.completions.create(
                model="any",
                messages=MESSAGES,
                max_tokens=30,
                temperature=0,
                logprobs=True,
                top_logprobs=20,
                stream=stream,
            )
            if stream:
                chunks = list(got)
                content = "".join(c.choices[0].delta.content or "" for c in chunks)
                entries = [
                    e
                    for c in chunks
                    if c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content
                ]
            else:
                content = got.choices[0].message.content
                entries = got.choices[0].logprobs.content
            assert "".join(e.token for e in entries) == content and " " in content
            assert b"".join(bytes(e.bytes) for e in entries) == content.encode()
            for e in entries:
                assert len({t.token for t in e.top_logprobs}) == 20
                assert e.top_logprobs[0].token == (e.token or "</s>")  # greedy
    finally:
        engine.tokenizer.chat_template = None
