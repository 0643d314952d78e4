"""Incremental detokenization and stop strings: text deltas that are safe to stream.

Two promises to a streaming client: a delta never holds broken UTF-8 (a multi-byte character
split over byte-fallback tokens is held back until it is whole), and no part of a stop string is
ever sent (text that could still become a stop string is held back until it cannot).
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

# Prompt tokens kept as context: SentencePiece-style tokenizers decode a leading space only
# when something precedes it.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._decode_ids = _fast_decode(tokenizer)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._decode_ids(ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends tokens and returns the new, complete text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full_text[len(prefix_text) :]
        return ""


def _fast_decode(tokenizer: Any):
    """`ids -> text` as `tokenizer.decode(ids, skip_special_tokens=True)` gives it.

    Runs twice per generated token, so it matters: a fast (Rust) tokenizer that does no
    clean-up of spaces after decoding is called directly, 2-3x cheaper than through
    transformers' wrapper, which then adds nothing. Any other tokenizer goes through `decode`.
    """
    raw = getattr(tokenizer, "_tokenizer", None)
    if (
        raw is not None
        and hasattr(raw, "decode")
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        return lambda ids: raw.decode(list(ids), skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class TokenTable:
    """Each token's text, read once from a tokenizer whose decoding is concatenation.

    The two decoders of nearly every Llama-family tokenizer only concatenate the tokens'
    bytes for any token after the first: SentencePiece's (`▁` is a space, `<0xNN>` pieces are
    bytes, one leading space stripped from the whole text) and GPT-2's byte-level one. For them
    `TableDetokenizer` streams text from this table at a fraction of a microsecond a token,
    against two calls of the tokenizer's decode (~10 us) for `IncrementalDetokenizer`: at 256
    running requests that was 2.5 ms of each step. `build` returns None for any other decoder,
    for a tokenizer that cleans up spaces after decoding, and for one whose own decode
    disagrees with the table on a check of single tokens and of a text with multi-byte
    characters; the caller then keeps `IncrementalDetokenizer`.
    """

    def __init__(self, pieces: list, kind: str):
        # Per id: str (its text), int (a byte-fallback piece: one byte of UTF-8 that may be
        # split over pieces), or bytes (byte-level: the token's bytes). "" for skipped specials.
        self.pieces = pieces
        self.byte_level = kind == "byte_level"  # `_decoder_kind`'s name of the decoder
        self.strip_first_space = kind == "sentencepiece_strip"

    @classmethod
    def build(cls, tokenizer: Any) -> TokenTable | None:
        """The table of `tokenizer`, checked against its own decode; None where it does not
        apply (module docstring: the caller then decodes through the tokenizer)."""
        try:
            table = cls._read(tokenizer)
            if table is not None and not table._agrees_with(tokenizer):
                logger.warning(
                    "%s decodes differently from its token table; streaming text through "
                    "its decode instead (slower).",
                    type(tokenizer).__name__,
                )
                return None
            return table
        except Exception:  # an unusual tokenizer: the general path serves it
            logger.debug("no token table for %r", tokenizer, exc_info=True)
            return None

    @classmethod
    def _read(cls, tokenizer: Any) -> TokenTable | None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
            return None
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        kind = _decoder_kind(decoder)
        if kind is None:
            return None
        special = set(tokenizer.all_special_ids)
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        pieces: list = []
        if kind == "byte_level":
            to_byte = {c: b for b, c in _bytes_to_unicode().items()}
            for i, token in enumerate(tokens):
                if i in special or token is None:
                    pieces.append(b"")
                elif i in added:
                    pieces.append(added[i].encode())
                else:
                    pieces.append(bytes(to_byte[c] for c in token))
        else:
            for i, token in enumerate(tokens):
                if i in special or token is None:
                    pieces.append("")
                elif (m := _BYTE_PIECE.fullmatch(token)) is not None and i not in added:
                    pieces.append(int(m.group(1), 16))
                else:
                    pieces.append(token.replace("\u2581", " "))
        return cls(pieces, kind)

    def _agrees_with(self, tokenizer: Any) -> bool:
        """Every token (or 2,048 of them, spread over a large vocabulary) after a context token,
        and a text with multi-byte characters, stream what the tokenizer decodes."""
        decode = _fast_decode(tokenizer)
        n = len(self.pieces)
        ids = list(range(0, n, max(1, n // 2048)))
        context = tokenizer("Once upon a time", add_special_tokens=False)["input_ids"][-1:]
        text = "Once upon a time, 中文 é 😀 naïve\n  two  spaces."
        checks = [(context, [i]) for i in ids]
        checks.append((context, tokenizer(text, add_special_tokens=False)["input_ids"]))
        checks.append((list(tokenizer.all_special_ids[:1]), checks[-1][1]))  # strip at start
        for prompt, out in checks:
            want = decode(prompt + out)
            if want.endswith("\ufffd"):  # an incomplete byte piece alone: held back either way
                continue
            got = TableDetokenizer(self, prompt)
            if decode(prompt) + "".join(got.add([t]) for t in out) != want:
                return False
        return True


class TableDetokenizer:
    """`IncrementalDetokenizer`'s deltas from a `TokenTable`, without calling the tokenizer.

    Bytes of a character split over byte pieces are held until the character is whole, as the
    general path holds back a trailing U+FFFD. A byte-fallback run that can never be valid
    UTF-8 comes out as one U+FFFD per piece, as SentencePiece decodes it, when the next
    ordinary piece ends the run.
    """

    __slots__ = ("_run", "_strip", "_utf8", "table")

    def __init__(self, table: TokenTable, prompt_token_ids: Sequence[int]):
        self.table = table
        self._run = bytearray()  # byte-fallback pieces not yet whole characters
        # Byte-level: one incremental UTF-8 decoder over all the output's bytes.
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if table.byte_level else None
        # SentencePiece strips one leading space off the whole text: an output's, when the
        # prompt decodes to no text at all (only special tokens).
        pieces = table.pieces
        self._strip = table.strip_first_space and not any(
            t < len(pieces) and pieces[t] != "" for t in prompt_token_ids
        )

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends tokens and returns the new, complete text (possibly empty)."""
        pieces = self.table.pieces
        # Ids past the tokenizer's vocabulary (a model's embedding padded beyond it) decode to
        # nothing, as the tokenizer decodes them.
        n = len(pieces)
        if self._utf8 is not None:
            text = self._utf8.decode(b"".join([pieces[t] for t in token_ids if t < n]))
        else:
            parts = []
            run = self._run
            for t in token_ids:
                if t >= n:
                    continue
                piece = pieces[t]
                if type(piece) is int:
                    run.append(piece)
                    try:
                        parts.append(run.decode())
                        run.clear()
                    except UnicodeDecodeError:  # incomplete (or never valid): wait for more
                        pass
                elif piece:
                    if run:  # ended by an ordinary piece: never valid, one U+FFFD a byte
                        parts.append("\ufffd" * len(run))
                        run.clear()
                    parts.append(piece)
            text = "".join(parts)
        if self._strip and text:
            self._strip = False
            if text[0] == " ":
                text = text[1:]
        return text


def make_detokenizer(
    tokenizer: Any, table: TokenTable | None, prompt_token_ids: Sequence[int]
) -> TableDetokenizer | IncrementalDetokenizer:
    """The table's detokenizer when the tokenizer has one (`TokenTable.build`), else the
    general one."""
    if table is not None:
        return TableDetokenizer(table, prompt_token_ids)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kind(decoder: dict) -> str | None:
    """'byte_level', 'sentencepiece' or 'sentencepiece_strip' for the two concatenating
    decoders (TokenTable), None for anything else."""
    if decoder.get("type") == "ByteLevel":
        return "byte_level"
    if decoder.get("type") != "Sequence":
        return None
    steps = decoder.get("decoders", [])
    names = [d.get("type") for d in steps]
    strip = names[-1:] == ["Strip"]
    if strip:
        last = steps[-1]
        if (last.get("content"), last.get("start"), last.get("stop")) != (" ", 1, 0):
            return None
        names = names[:-1]
    if names != ["Replace", "ByteFallback", "Fuse"]:
        return None
    replace = steps[0]
    if replace.get("pattern") != {"String": "\u2581"} or replace.get("content") != " ":
        return None
    return "sentencepiece_strip" if strip else "sentencepiece"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character that stands for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class StopStringMatcher:
    """Accumulates output text, finds stop strings, and says how much text may be sent."""

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        # The output text up to a stop string, of which `sent` characters were taken; without
        # stop strings only the part not yet taken.
        self.text = ""
        self.sent = 0
        self.matched: str | None = None

    def add(self, delta: str) -> None:
        """Appends text; on a stop string, truncates the text just before it."""
        if not self.stop:  # nothing to find or hold back: the text need not be kept whole
            self.text = self.text[self.sent :] + delta
            self.sent = 0
            return
        if self.matched is not None:
            return
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            index, self.matched = min(hits)
            self.text = self.text[:index]

    def take(self, final: bool) -> str:
        """The text not sent yet that can no longer turn into a stop string (all of it if final)."""
        end = len(self.text)
        if not final and self.matched is None:
            end -= self.holdback
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out
