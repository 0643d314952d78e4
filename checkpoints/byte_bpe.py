"""A Qwen-style byte-level BPE tokenizer for the random-weight shapes, which ship none.

Structured output and tool calls need a tokenizer with the properties of the real ones a
random shape stands for (Qwen / Llama 3): byte-level pieces (any UTF-8 text encodes), merges
that cross JSON punctuation, ChatML special tokens and a chat template that offers tools and
expects `<tool_call>` JSON back (the Hermes / Qwen format). Training one here, from a small
fixed text, gives that at the shape's own vocabulary size without a download, deterministically.

    model = load_model("qwen3-tiny")
    model.tokenizer = byte_bpe_tokenizer(model.config.vocab_size)
"""

from __future__ import annotations

import functools

# Ids 0.. in this order; qwen3-tiny's eos_token_ids=(2,) is then <|im_end|>, as in Qwen's chat.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added after the merges, and not special (as in Qwen's tokenizer): decoded text keeps them,
# which is how a front end finds a call in the output.
TOOL_TOKENS = ("<tool_call>", "</tool_call>")

# What the merges are learned from: prose, JSON and code-like text, so that common pieces of
# all three become tokens (the grammar engines then see multi-character tokens that cross
# structure, as with a real vocabulary).
_CORPUS = (
    "Once upon a time there was a little girl named Lily. She liked to play in the park with "
    "her friends. One day she found a shiny red ball under a big green tree, and she was happy.",
    'The weather today is sunny with a high of 25 degrees. {"city": "Paris", "temperature": '
    '21.5, "unit": "celsius", "forecast": ["sunny", "cloudy", "rain"], "ok": true, "n": null}',
    '{"name": "get_weather", "arguments": {"location": "San Francisco, CA", "days": 3}}',
    '[{"id": 1, "tags": ["a", "b"], "price": 9.99}, {"id": 2, "tags": [], "price": 0}]',
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, 2))\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 1e-5. Email: user@example.com",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! the end; (yes) [no] <ok>",
)

# ChatML with Qwen's tool section: tools as JSON in the system turn, calls as <tool_call> JSON.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message.role == 'system') %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.cache
def byte_bpe_tokenizer(vocab_size: int):
    """A `PreTrainedTokenizerFast` of exactly `vocab_size` ids (byte-level BPE, ChatML).

    Deterministic: the same merges from the same text every time. Cached per size, so tests
    and engines of one process share one.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    if vocab_size < base:
        raise ValueError(f"{vocab_size=} must be at least {base} (256 bytes + special tokens).")
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(list(_CORPUS) * 8, trainer)
    raw.add_tokens(list(TOOL_TOKENS))
    # A small text runs out of merges before a large vocabulary is full: the rest become
    # reserved tokens (as Llama 3's are), so ids cover the model's vocabulary exactly.
    missing = vocab_size - raw.get_vocab_size()
    raw.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
