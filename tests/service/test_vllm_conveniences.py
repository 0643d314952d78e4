"""vLLM's client conveniences (issue 47, item 3): `--served-model-name` and `return_token_ids`.

A router addresses a model by a name its operator picks: the names are listed by /v1/models
and gRPC's GetModelInfo, accepted as a request's `model`, given back as the answer's `model`,
and any other name is a 404. `return_token_ids` puts the token ids beside the text, as vLLM
does: `prompt_token_ids` and `token_ids` on a completion's choice, `token_ids` on a chat choice
and `prompt_token_ids` beside the choices; streamed, the prompt's in the first chunk and each
chunk's own new ids, with a chunk for tokens that add no text, so that the chunks' ids add up
to the whole answer's.
"""

from __future__ import annotations

import openai
import pytest

from jaxserve.cli import build_parser
from jaxserve.cli.common import UserError
from jaxserve.cli.serve import _served_model_names
from service.server import ServerOptions
from tests.service import strict_json
from tests.service.conftest import serving
from tests.service.test_http import _get
from tests.service.test_http_structured import CHAT_TEMPLATE, MESSAGES

PROMPT = "Once upon a time"
NAMES = ("tiny-stories", "stories")


@pytest.fixture(scope="module")
def server(engine):
    with serving(
        engine, http_port=0, chat_template=CHAT_TEMPLATE, served_model_names=NAMES
    ) as server:
        yield server


def _post(server, path: str, body: dict):
    return strict_json.post(server.server.http_port, path, body)


# ---- --served-model-name --------------------------------------------------------------------


def test_served_names_are_listed_and_each_is_a_model(server):
    status, text = _get(server, "/v1/models")
    cards = strict_json.loads(text)["data"]
    assert status == 200 and [c["id"] for c in cards] == list(NAMES)
    assert all(c["root"] == "stories260k" for c in cards)  # where it came from
    for name in NAMES:
        status, text = _get(server, f"/v1/models/{name}")
        assert status == 200 and strict_json.loads(text)["id"] == name
    # Served under other names, its folder's name is not one of them.
    assert _get(server, "/v1/models/stories260k")[0] == 404
    with server.client() as grpc_client:
        info = grpc_client.model_info()
    assert list(info.served_model_names) == list(NAMES)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_served_name_is_accepted_and_answered_an_unknown_one_is_404(server, path, stream):
    base = {"max_tokens": 3, "temperature": 0, "stream": stream}
    base |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    for model, answered in [(NAMES[1], NAMES[1]), (NAMES[0], NAMES[0]), (None, NAMES[0])]:
        body = base if model is None else {**base, "model": model}
        status, answer = _post(server, path, body)
        assert status == 200, answer
        chunks = answer[:-1] if stream else [answer]
        assert chunks and all(c["model"] == answered for c in chunks), (model, chunks)
    status, answer = _post(server, path, {**base, "model": "stories260k"})
    assert status == 404, answer
    error = answer["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["message"] == (
        f"The model 'stories260k' does not exist; this server serves {list(NAMES)}."
    )


def test_the_official_client_addresses_the_model_by_a_served_name(server):
    client = server.openai()
    assert [m.id for m in client.models.list()] == list(NAMES)
    got = client.completions.create(model=NAMES[1], prompt=PROMPT, max_tokens=2)
    assert got.model == NAMES[1]
    with pytest.raises(openai.NotFoundError, match="'gpt-4o' does not exist"):
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)


def test_without_served_names_the_folder_name_is_served_and_any_name_accepted(engine):
    with serving(engine, http_port=0) as plain:
        status, answer = _post(plain, "/v1/completions", {"prompt": PROMPT, "model": "x"})
        assert status == 200 and answer["model"] == "stories260k"
        with plain.client() as grpc_client:
            assert list(grpc_client.model_info().served_model_names) == ["stories260k"]


def test_served_names_on_the_command_line_and_their_checks():
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b/c"])
    assert _served_model_names(args.served_model_name) == ("a", "b/c")
    assert build_parser().parse_args(["serve"]).served_model_name == []
    with pytest.raises(UserError, match="names a model twice"):
        _served_model_names(["a", "a"])
    with pytest.raises(UserError, match="is empty"):
        _served_model_names([" "])
    with pytest.raises(ValueError, match="names a model twice"):
        ServerOptions(served_model_names=("a", "a"))
    with pytest.raises(ValueError, match="non-empty names"):
        ServerOptions(served_model_names=("",))


# ---- return_token_ids -----------------------------------------------------------------------


def _byte_piece(engine) -> int:
    """The id of a byte piece that starts a 2-byte UTF-8 character: alone, it adds no text."""
    token_id = engine.tokenizer.convert_tokens_to_ids("<0xC3>")
    assert isinstance(token_id, int) and token_id != engine.tokenizer.unk_token_id
    return token_id


def _added(tokenizer, prompt_ids: list[int], ids: list[int]) -> str:
    """The text `ids` add after the prompt (decoded alone, a first piece loses its space)."""
    before = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    return tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)[len(before) :]


def _streamed_ids(events) -> tuple[dict, dict, list]:
    """Per choice index: the prompt ids its chunks carried (each a list), the ids summed over
    its chunks; and every choice chunk with its text."""
    assert events[-1] == "[DONE]", events[-3:]
    prompts, outputs, pieces = {}, {}, []
    for event in events[:-1]:
        for c in event["choices"]:
            assert "token_ids" in c, c
            if "prompt_token_ids" in c:
                prompts.setdefault(c["index"], []).append(c["prompt_token_ids"])
            outputs[c["index"]] = outputs.get(c["index"], []) + c["token_ids"]
            pieces.append((c.get("text", c.get("delta", {}).get("content")), c["token_ids"]))
    return prompts, outputs, pieces


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 0, "max_tokens": 12},
        {"temperature": 1.0, "seed": 5, "max_tokens": 12, "n": 2},
        # Every token a byte piece that completes no character: none adds text.
        "byte pieces",
    ],
    ids=["greedy", "n2", "no-text"],
)
def test_completion_token_ids_streamed_add_up_to_the_whole_answer(server, engine, extra):
    if extra == "byte pieces":
        extra = {"temperature": 0, "max_tokens": 6, "logit_bias": {str(_byte_piece(engine)): 100}}
    body = {"prompt": PROMPT, "return_token_ids": True, **extra}
    status, whole = _post(server, "/v1/completions", body)
    assert status == 200, whole
    prompt_ids = engine.encode(PROMPT)
    tokenizer = engine.tokenizer
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids
        if not body.get("logit_bias"):  # (byte pieces decode to what completes no character)
            assert _added(tokenizer, prompt_ids, choice["token_ids"]) == choice["text"]
    generated = sum(len(c["token_ids"]) for c in whole["choices"])
    assert generated == whole["usage"]["completion_tokens"]
    status, events = _post(server, "/v1/completions", {**body, "stream": True})
    assert status == 200, events
    prompts, outputs, pieces = _streamed_ids(events)
    n = len(whole["choices"])
    assert prompts == {i: [prompt_ids] for i in range(n)}  # once per choice: its first chunk
    assert outputs == {c["index"]: c["token_ids"] for c in whole["choices"]}
    if body.get("logit_bias"):
        assert outputs[0] == [_byte_piece(engine)] * 6
        silent = [ids for text, ids in pieces if ids and not text]
        assert len(silent) >= 5, pieces  # a chunk for each token that added no text


@pytest.mark.parametrize("no_text", [False, True], ids=["text", "no-text"])
@pytest.mark.parametrize("stream", [False, True])
def test_chat_token_ids_beside_the_message(server, engine, stream, no_text):
    body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    if no_text:  # every token a byte piece that completes no character
        body |= {"max_tokens": 6, "logit_bias": {str(_byte_piece(engine)): 100}}
    status, tokenized = _post(server, "/tokenize", {"messages": MESSAGES})
    assert status == 200
    status, whole = _post(server, "/v1/chat/completions", body)
    assert status == 200, whole
    assert whole["prompt_token_ids"] == tokenized["tokens"]
    (choice,) = whole["choices"]
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"]
    if no_text:
        assert choice["token_ids"] == [_byte_piece(engine)] * 6
    else:
        text = _added(engine.tokenizer, tokenized["tokens"], choice["token_ids"])
        assert text == choice["message"]["content"]
    if stream:
        status, events = _post(server, "/v1/chat/completions", {**body, "stream": True})
        assert status == 200, events
        _, outputs, _ = _streamed_ids(events)
        assert outputs == {0: choice["token_ids"]}
        with_prompt = [e for e in events[:-1] if "prompt_token_ids" in e]
        assert with_prompt == [events[0]], "the prompt's ids come once, in the first chunk"
        assert events[0]["prompt_token_ids"] == tokenized["tokens"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_beam_search_choices_carry_their_token_ids(server, engine, path):
    body = {"max_tokens": 6, "n": 2, "use_beam_search": True, "return_token_ids": True}
    body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    status, answer = _post(server, path, body)
    assert status == 200, answer
    prompt_ids = answer.get("prompt_token_ids") or answer["choices"][0]["prompt_token_ids"]
    for choice in answer["choices"]:
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert _added(engine.tokenizer, prompt_ids, choice["token_ids"]) == text
    if path == "/v1/completions":
        assert all(c["prompt_token_ids"] == engine.encode(PROMPT) for c in answer["choices"])
    else:
        assert answer["prompt_token_ids"][0] == engine.tokenizer.bos_token_id


def test_without_return_token_ids_answers_carry_no_ids(server):
    for stream in (False, True):
        body = {"prompt": PROMPT, "max_tokens": 3, "stream": stream}
        status, answer = _post(server, "/v1/completions", body)
        chunks = answer[:-1] if stream else [answer]
        assert status == 200
        for chunk in chunks:
            assert "prompt_token_ids" not in chunk
            assert all(
                "token_ids" not in c and "prompt_token_ids" not in c for c in chunk["choices"]
            )
