"""Incremental detokenization and stop strings: text deltas that are safe to stream.

Two promises to a streaming client: a delta never holds broken UTF-8 (a multi-byte character
split over byte-fallback tokens is held back until it is whole), and no part of a stop string is
ever sent (text that could still become a stop string is held back until it cannot).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
