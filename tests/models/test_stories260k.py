"""The embedded default (stories260k): it loads with no argument and decodes like transformers.

Greedy decoding from the BOS token through jaxserve's paged step (one token per step, pages
shuffled, a (1 token, 1 sequence) bucket compiled once) must give transformers' greedy `generate`
token for token for 200 tokens.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from transformers import AutoModelForCausalLM

import checkpoints
from tests.models.helpers import STORIES_BUCKET, hf_greedy, paged_greedy
from tests.torch_reference import require_torch

NUM_TOKENS = 200
# Known start of the story: "Once upon a time, there was".
EXPECTED_START = [403, 407, 261, 378, 432, 383, 286]


@pytest.fixture(scope="module")
def default_model():
    return checkpoints.load_model()


def test_default_is_the_embedded_stories260k(default_model):
    m = default_model
    assert m.source == str(checkpoints.DEFAULT_MODEL_DIR)
    assert (m.config.vocab_size, m.config.num_layers, m.config.hidden_size) == (512, 5, 64)
    assert (m.config.num_heads, m.config.num_kv_heads, m.config.head_dim) == (8, 4, 8)
    assert m.config.tie_word_embeddings
    assert m.config.bos_token_id == 1
    assert set(m.config.eos_token_ids) == {1, 2}  # config.json's 2 and generation_config's [2, 1]
    assert isinstance(m.dtype, np.dtype) and m.dtype == checkpoints.default_dtype()
    assert m.tokenizer is not None
    assert m.tokenizer.decode(EXPECTED_START) == "Once upon a time, there was"


def test_greedy_from_bos_matches_transformers():
    torch = require_torch()
    loaded = checkpoints.load_model(dtype=jnp.float32)
    bos = loaded.config.bos_token_id
    ours = paged_greedy(loaded, [[bos]], NUM_TOKENS, **STORIES_BUCKET)[0]
    hf = AutoModelForCausalLM.from_pretrained(
        checkpoints.DEFAULT_MODEL_DIR, dtype=torch.float32, attn_implementation="eager"
    )
    ref = hf_greedy(hf.eval(), [bos], NUM_TOKENS)
    assert ours[: len(EXPECTED_START)] == EXPECTED_START
    assert len(ref) == NUM_TOKENS
    first_diff = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), None)
    assert first_diff is None, f"greedy tokens differ from transformers' from index {first_diff}"
