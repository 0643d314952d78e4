"""The incremental detokenizer's fast path streams exactly the text transformers decodes."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from checkpoints import DEFAULT_MODEL_DIR
from jaxserve.detokenizer import IncrementalDetokenizer


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
