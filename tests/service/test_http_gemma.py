"""Gemma behind the OpenAI API (issue 46, item 4): a tiny random Gemma 3 with Gemma's
262,144-word vocabulary, served with Gemma's own chat template (no system role: the system
text opens the first user turn; roles must alternate; the assistant is "model"), tool calls
and structured output through the official `openai` client.

No Gemma tokenizer is on this machine, so the embedded model's tokenizer serves, with ids 512
and up words that no grammar may emit; the template is Gemma 3's, as its tokenizer_config.json
ships it (the multimodal branches left out)."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from checkpoints import DEFAULT_MODEL_DIR
from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from tests.engine.conftest import SMALL
from tests.engine.test_moe_engine import TOKENIZER_FILES
from tests.models.gemma_helpers import build_gemma
from tests.models.helpers import save_hf
from tests.service.conftest import serving
from tests.service.test_http_structured import CLOCK, WEATHER

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
GEMMA_VOCAB = 262_144


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(engine, openai client) of a served tiny Gemma 3 with the 262k vocabulary."""
    hf = build_gemma("gemma3", vocab_size=GEMMA_VOCAB, max_position_embeddings=1024, eos_token_id=2)
    folder = save_hf(hf, tmp_path_factory.mktemp("gemma3-chat"))
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    engine = Engine(EngineConfig(model=str(folder), **SMALL))
    engine.tokenizer.chat_template = GEMMA_TEMPLATE
    with serving(engine, http_port=0) as server:
        yield engine, server.openai()


def test_a_system_message_opens_the_first_user_turn(gemma):
    engine, client = gemma
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me a story"},
        {"role": "assistant", "content": "Once upon a time"},
        {"role": "user", "content": "Go on"},
    ]
    out = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
    text = (
        "<s><start_of_turn>user\nBe brief.\n\nTell me a story<end_of_turn>\n"
        "<start_of_turn>model\nOnce upon a time<end_of_turn>\n"
        "<start_of_turn>user\nGo on<end_of_turn>\n<start_of_turn>model\n"
    )
    rendered = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered == text.replace("<s>", engine.tokenizer.bos_token)
    ids = engine.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert out.usage.prompt_tokens == len(ids)
    assert all(t < 512 for t in engine.tokenizer(out.choices[0].message.content)["input_ids"])


def test_roles_out_of_turn_are_refused_with_the_templates_sentence(gemma):
    _, client = gemma
    with pytest.raises(openai.BadRequestError, match="Conversation roles must alternate"):
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            max_tokens=4,
        )


def test_tool_calls_and_json_hold_over_the_262k_vocabulary(gemma):
    """Gemma's template writes no tools: the grammar alone makes the call, over a mask 8,192
    words wide whose ids past the tokenizer's are always masked."""
    engine, client = gemma
    assert engine.runner.mask_words == GEMMA_VOCAB // 32
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for seed in range(2):
        out = client.chat.completions.create(
            model="m",
            messages=messages,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )
        (call,) = out.choices[0].message.tool_calls
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
    schema = WEATHER["function"]["parameters"]
    out = client.chat.completions.create(
        model="m",
        messages=messages,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        temperature=0,
        max_tokens=60,
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
