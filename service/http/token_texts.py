"""Logprob tokens as texts that add up to the text: each token decoded in its context.

A token decoded alone loses what its context gives it: SentencePiece's leading space (`▁there`
alone is "there", after "time," it is " there"), and a character split over byte pieces. So
the tokens of a logprobs object, joined, gave ',therewasalittlegirl' for ', there was a little
girl', the offsets did not point into the text, and `▁a` and `a` both became the key "a" of
`top_logprobs`. `TokenTexts` follows one sequence (a prompt, or an output after its prompt) as
the engine's detokenizer does (jaxserve/engine/detokenizer.py, IncrementalDetokenizer: the same
context, the same rule), so:

- a chosen token's text is what it added to the text: joined, the tokens are the text (special
  tokens, BOS and EOS, add nothing: ""; the bytes of a character split over byte pieces count
  on the piece that completes it, the others add "");
- an alternative's text is what it would have added instead, in the same context;
- `top_logprobs` keys (`key`): the text; where that is empty, the token's own name (a special
  token's, "</s>"), or OpenAI's "bytes:\\xe4" for a byte piece; and where two ids give the same
  text, the later one is "token_id:<id>" (vLLM's notation), so no alternative is lost. The chosen
  token keeps the key its `tokens` entry shows whenever that is not empty.

The decoding runs on the tokenizer's Rust backend, one batched call per token; text stops
(stop strings) cut the text but not the tokens, so there the tokens run past the text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# As jaxserve/engine/detokenizer.py: prompt tokens kept as context (a leading space decodes
# only when something precedes it).
_CONTEXT_TOKENS = 5
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """The texts the tokens of one sequence add to it, one position at a time."""

    def __init__(self, tokenizer, context: Sequence[int] = ()):
        """`context`: the token ids before the sequence (an output's prompt; none for a prompt,
        whose first token starts the text)."""
        self._tokenizer = tokenizer
        self._decode = _batch_decoder(tokenizer) if tokenizer is not None else None
        self._ids = list(context[-_CONTEXT_TOKENS:])
        self._prefix = 0  # ids[_prefix:_read] decode to text already given out
        self._read = len(self._ids)  # ids[_read:] gave nothing yet (bytes of a split character)

    def step(self, chosen: int, alternatives: Sequence[int] = ()) -> tuple[str, list[str]]:
        """(the text `chosen` adds here, the text each alternative would have added instead);
        the sequence then goes on after `chosen`."""
        if self._decode is None:
            return "", [""] * len(alternatives)
        window = self._ids[self._prefix :]
        texts = self._decode(
            [window[: self._read - self._prefix], [*window, chosen]]
            + [[*window, a] for a in alternatives]
        )
        before = texts[0]

        def added(full: str) -> str:  # IncrementalDetokenizer.add's rule
            if len(full) > len(before) and not full.endswith("\ufffd"):
                return full[len(before) :]
            return ""

        text = added(texts[1])
        self._ids.append(chosen)
        if text:
            self._prefix, self._read = self._read, len(self._ids)
            if self._prefix > 64:  # keep the window short: decoding is per position
                del self._ids[: self._prefix]
                self._read -= self._prefix
                self._prefix = 0
        return text, [added(t) for t in texts[2:]]

    def name(self, token_id: int, text: str) -> str:
        """How an alternative whose text here is `text` is named: the text, or when it adds
        none, the special token's own name, "bytes:\\xNN" for a byte piece, "token_id:<id>"."""
        if text:
            return text
        tokenizer = self._tokenizer
        if tokenizer is not None and 0 <= token_id < len(tokenizer):
            piece = tokenizer.convert_ids_to_tokens(token_id)
            if token_id in tokenizer.all_special_ids and piece:
                return piece
            if piece and (m := _BYTE_PIECE.fullmatch(piece)):
                return f"bytes:\\x{m.group(1).lower()}"
        return f"token_id:{token_id}"

    def top(
        self, chosen: int, text: str, alternatives: Sequence[tuple[int, float]], texts: list[str]
    ) -> list[tuple[str, float, bytes]]:
        """(key, logprob, UTF-8 bytes) of each alternative, keys distinct: the chosen token
        first claims its text, a later id with a text already taken is "token_id:<id>"."""
        keys: dict[int, str] = {}
        taken: set[str] = set()
        order = sorted(range(len(alternatives)), key=lambda i: alternatives[i][0] != chosen)
        for i in order:
            token_id = alternatives[i][0]
            key = self.name(token_id, text if token_id == chosen else texts[i])
            if key in taken:
                key = f"token_id:{token_id}"
            taken.add(key)
            keys[i] = key
        out = []
        for i, (token_id, logprob) in enumerate(alternatives):
            key = keys[i]
            if key.startswith("bytes:\\x"):
                raw = bytes([int(key[-2:], 16)])
            else:
                raw = (text if token_id == chosen else texts[i]).encode("utf-8")
            out.append((key, logprob, raw))
        return out


def _batch_decoder(tokenizer):
    """`[ids] -> [text]` as `tokenizer.decode(ids, skip_special_tokens=True)` gives each: in
    one call of the Rust backend when the tokenizer adds no clean-up of spaces after it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda seqs: backend.decode_batch([list(s) for s in seqs], skip_special_tokens=True)
    return lambda seqs: [tokenizer.decode(list(s), skip_special_tokens=True) for s in seqs]
