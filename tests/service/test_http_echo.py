"""`echo` with `logprobs` on POST /v1/completions: the prompt's own logprobs come first, as
OpenAI sends them, checked through the official `openai` client against transformers' PyTorch
forward of the embedded stories260k (not against our own code); and `max_tokens=0` with echo
scores a prompt without generating.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
from transformers import AutoModelForCausalLM

import checkpoints
from tests.service.conftest import serving
from tests.service.test_http import _post
from tests.torch_reference import require_torch

PROMPT = "Once upon a time, there was a little girl named Lily"
K = 3
TOL = 1e-4  # float32 on both sides


@pytest.fixture(scope="module")
def server(engine):
    with serving(engine, http_port=0) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="none", max_retries=0
    )


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


def check_prompt_part(logprobs, reference, engine) -> None:
    """The first len(prompt) entries of a completions logprobs object are the prompt's."""
    ids, ref = reference
    n = len(ids)
    token_text = engine.tokenizer.decode
    assert logprobs.tokens[:n] == [token_text([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, n):
        assert logprobs.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]], abs=TOL), i
        top = logprobs.top_logprobs[i]
        want = np.sort(ref[i - 1])[::-1][:K]
        # Keys are token texts; distinct ids could share one, so compare the values.
        assert len(top) <= K
        for value in top.values():
            assert np.min(np.abs(want - value)) < TOL, i
        best = int(np.argmax(ref[i - 1]))
        assert top[token_text([best])] == pytest.approx(ref[i - 1, best], abs=TOL)
    offsets = logprobs.text_offset[:n]
    assert offsets[0] == 0 and offsets == sorted(offsets)


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
