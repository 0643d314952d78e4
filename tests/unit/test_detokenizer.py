"""The incremental detokenizer's fast path streams exactly the text transformers decodes."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from checkpoints import DEFAULT_MODEL_DIR
from jaxserve.engine.detokenizer import IncrementalDetokenizer, TableDetokenizer, TokenTable


class _ThroughTransformers:
    """The tokenizer seen only through `decode`: forces the detokenizer's general path."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.mark.parametrize("seed", range(5))
def test_fast_decode_streams_the_same_deltas_as_transformers(seed):
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    rng = np.random.default_rng(seed)
    prompt = tok("Once upon a time")["input_ids"]
    # Random ids over the whole vocabulary: byte-fallback pieces split characters, specials
    # (skipped) and plain pieces, added one or a few at a time as steps deliver them.
    out = rng.integers(0, tok.vocab_size, size=60).tolist()
    fast = IncrementalDetokenizer(tok, prompt)
    plain = IncrementalDetokenizer(_ThroughTransformers(tok), prompt)
    assert fast._decode_ids is not plain._decode_ids
    i, deltas = 0, []
    while i < len(out):
        n = int(rng.integers(1, 4))
        chunk = out[i : i + n]
        delta = fast.add(chunk)
        assert delta == plain.add(chunk)
        deltas.append(delta)
        i += n
    assert "".join(deltas)  # text came out, the same on both paths


# Texts whose characters split over byte-fallback pieces (CJK, accents, emoji), with spaces and
# newlines where SentencePiece's leading space matters.
_TEXTS = [
    "Once upon a time there was a girl named Lily.",
    "中文 and naïve café, 😀 then\nnew  lines   and spaces.",
    " leading space, trailing space ",
    "Ünïcödé 日本語のテキスト 🚀🚀 end",
]


def _stream(detok, out, rng) -> list[str]:
    """`out` added in chunks of 1-3 tokens, as steps deliver them: the deltas."""
    i, deltas = 0, []
    while i < len(out):
        n = int(rng.integers(1, 4))
        deltas.append(detok.add(out[i : i + n]))
        i += n
    return deltas


@pytest.mark.parametrize("seed", range(4))
def test_token_table_streams_the_deltas_transformers_decodes(seed):
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    table = TokenTable.build(tok)
    assert table is not None and table.strip_first_space and not table.byte_level
    rng = np.random.default_rng(seed)
    text = " ".join(rng.permutation(_TEXTS).tolist())
    out = tok(text, add_special_tokens=False)["input_ids"]
    for prompt in (tok("Hello there")["input_ids"], [tok.bos_token_id]):
        want = tok.decode(prompt + out, skip_special_tokens=True)
        want = want[len(tok.decode(prompt, skip_special_tokens=True)) :]
        deltas = _stream(TableDetokenizer(table, prompt), out, np.random.default_rng(seed))
        general = _stream(IncrementalDetokenizer(tok, prompt), out, np.random.default_rng(seed))
        assert "".join(deltas) == want
        # After every chunk the text sent so far is the decoded text's start (no broken
        # characters), and never behind what the general path has sent (it holds back a space
        # before a split character, the table only the character's bytes).
        sent = general_sent = ""
        for delta, general_delta in zip(deltas, general, strict=True):
            sent, general_sent = sent + delta, general_sent + general_delta
            assert want.startswith(sent) and len(sent) >= len(general_sent)
    # A prompt of only BOS: SentencePiece drops the text's leading space ("▁Hello").
    hello = tok("Hello", add_special_tokens=False)["input_ids"]
    assert TableDetokenizer(table, [tok.bos_token_id]).add(hello) == "Hello"
    assert TableDetokenizer(table, tok("Say")["input_ids"]).add(hello) == " Hello"
    # An id past the tokenizer's vocabulary (a padded embedding can sample one) decodes to
    # nothing, as the tokenizer decodes it, instead of failing the request.
    past = len(tok) + 7
    assert TableDetokenizer(table, [tok.bos_token_id]).add([past, *hello]) == "Hello"
    assert TableDetokenizer(table, [tok.bos_token_id, past]).add(hello) == "Hello"
    assert tok.decode([tok.bos_token_id, past, *hello], skip_special_tokens=True) == "Hello"


def test_token_table_ends_a_broken_byte_run_as_sentencepiece_does():
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    table = TokenTable.build(tok)
    prompt = tok("Once")["input_ids"]
    half = tok.convert_tokens_to_ids(["<0xE4>", "<0xB8>"])  # two of the three bytes of 中
    word = tok("upon", add_special_tokens=False)["input_ids"]
    detok = TableDetokenizer(table, prompt)
    assert detok.add(half) == ""  # held: the character may still be completed
    got = detok.add(word)
    want = tok.decode(prompt + half + word, skip_special_tokens=True)
    assert got == want[len(tok.decode(prompt, skip_special_tokens=True)) :]
    assert got.startswith("\ufffd\ufffd")  # one per byte piece, as the tokenizer decodes it


def test_token_table_of_a_byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(_TEXTS * 4, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    table = TokenTable.build(tok)
    assert table is not None and table.byte_level
    rng = np.random.default_rng(0)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    text = "日本語 😀 naïve, and 中文 again"  # characters split over byte-level tokens
    out = tok(text)["input_ids"] + [eos]  # the special token streams no text
    prompt = tok("Once")["input_ids"]
    deltas = _stream(TableDetokenizer(table, prompt), out, rng)
    assert "".join(deltas) == text
    # A tokenizer that cleans up spaces after decoding changes text across tokens: no table.
    tok.clean_up_tokenization_spaces = True
    assert TokenTable.build(tok) is None


def test_a_table_that_disagrees_with_the_tokenizer_is_not_used(monkeypatch):
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    read = TokenTable._read

    def wrong(tokenizer):
        table = read(tokenizer)
        table.pieces[tok.convert_tokens_to_ids("▁the")] = " teh"
        return table

    monkeypatch.setattr(TokenTable, "_read", staticmethod(wrong))
    assert TokenTable.build(tok) is None
