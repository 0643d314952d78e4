"""Parity of the paged Llama-family model with transformers' PyTorch forward, per architecture.

Four tiny random models, saved with transformers' `save_pretrained` and loaded with
`checkpoints.load_model`: llama (llama3 RoPE scaling, q/k/v/o and MLP biases, untied head),
mistral (sliding window 6, linear RoPE scaling, tied), qwen2 (qkv bias, untied) and qwen3 (q/k
norm, q/k/v/o bias, tied). Three prompts of different lengths then run through jaxserve's ragged
paged step: whole prompts in one step, prompts in chunks of 3 tokens, decode steps, and a greedy
loop, each checked against transformers. Pages are shuffled and the pool starts as NaN. Every
step of a family is packed to the same (32 tokens, 4 sequences) bucket, so each family compiles
the step once."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import checkpoints
from tests.models.helpers import (
    FAMILIES,
    PagedSession,
    build_hf_model,
    hf_greedy,
    hf_logits,
    paged_greedy,
    save_hf,
)

ATOL = 1e-4
# Lengths 5, 11 and 9: all three fit one 32-token step, and 11 exceeds mistral's window of 6.
PROMPTS = ([5, 9, 3, 77, 12], list(range(20, 31)), [100, 1, 2, 3, 4, 5, 6, 8, 90])
CHUNK = 3
DECODE_STEPS = 8
GREEDY_TOKENS = 32


def assert_close(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != transformers' {ref.shape}"
    err = float(np.max(np.abs(ours - ref)))  # NaN (a read of an unused page) fails too
    assert err <= ATOL, f"{what}: max abs logit error {err:.3g} > {ATOL}"


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers model, the same model loaded by jaxserve from its saved folder)."""
    hf = build_hf_model(request.param)
    path = save_hf(hf, tmp_path_factory.mktemp(request.param))
    return hf, checkpoints.load_model(path, dtype=jnp.float32)


def test_config_switches(pair):
    hf, loaded = pair
    c = loaded.config
    family = hf.config.model_type
    assert c.architecture == family
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    assert c.tie_word_embeddings == (family in ("mistral", "qwen3"))
    assert c.qkv_bias == (family in ("llama", "qwen2", "qwen3"))
    assert c.o_bias == (family in ("llama", "qwen3"))
    assert c.mlp_bias == (family == "llama")
    assert c.qk_norm == (family == "qwen3")
    assert c.sliding_window == (6 if family == "mistral" else None)
    rope = {"llama": ("llama3", 8.0), "mistral": ("linear", 2.0)}.get(family, ("default", 1.0))
    assert (c.rope.rope_type, c.rope.factor) == rope
    assert ("lm_head" in loaded.params) != c.tie_word_embeddings


def test_whole_prompt_prefill(pair):
    hf, loaded = pair
    session = PagedSession(loaded)
    ids = [session.add_seq() for _ in PROMPTS]
    logits = session.step(list(zip(ids, PROMPTS, strict=True)))
    for i, (ours, prompt) in enumerate(zip(logits, PROMPTS, strict=True)):
        assert_close(ours, hf_logits(hf, prompt), f"prompt {i}, whole-prompt prefill")


def chunked_prefill(session: PagedSession, prompts) -> tuple[list[int], list[np.ndarray]]:
    """Runs `prompts` in chunks of CHUNK tokens over several ragged steps.

    Sequence i joins at step i and the batch order rotates every step, so sequences sit at
    different progress and in different batch rows from step to step.
    """
    ids = [session.add_seq() for _ in prompts]
    done = [0] * len(prompts)
    logits: list[list[np.ndarray]] = [[] for _ in prompts]
    step = 0
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        active = [i for i, p in enumerate(prompts) if i <= step and done[i] < len(p)]
        active = active[step % len(active) :] + active[: step % len(active)]
        chunks = [(ids[i], prompts[i][done[i] : done[i] + CHUNK]) for i in active]
        for i, (_, tokens), out in zip(active, chunks, session.step(chunks), strict=True):
            logits[i].append(out)
            done[i] += len(tokens)
        step += 1
    return ids, [np.concatenate(parts) for parts in logits]


def test_chunked_prefill(pair):
    hf, loaded = pair
    _, logits = chunked_prefill(PagedSession(loaded), PROMPTS)
    for i, (ours, prompt) in enumerate(zip(logits, PROMPTS, strict=True)):
        assert_close(ours, hf_logits(hf, prompt), f"prompt {i}, prefill in chunks of {CHUNK}")


def test_decode_steps(pair):
    hf, loaded = pair
    session = PagedSession(loaded)
    ids, logits = chunked_prefill(session, PROMPTS)
    next_tokens = [int(lg[-1].argmax()) for lg in logits]
    for step in range(DECODE_STEPS):
        chunks = [(s, [t]) for s, t in zip(ids, next_tokens, strict=True)]
        logits = session.step(chunks)  # one token of every sequence, in one batch
        for s, ours in zip(ids, logits, strict=True):
            ref = hf_logits(hf, session.seqs[s].tokens)[-1:]  # the full sequence so far
            assert_close(ours, ref, f"sequence {s}, decode step {step}")
        next_tokens = [int(lg[-1].argmax()) for lg in logits]
    assert [len(session.seqs[s].tokens) for s in ids] == [len(p) + DECODE_STEPS for p in PROMPTS]


def test_greedy_matches_generate(pair):
    hf, loaded = pair
    ours = paged_greedy(loaded, list(PROMPTS), GREEDY_TOKENS)
    for i, prompt in enumerate(PROMPTS):
        ref = hf_greedy(hf, prompt, GREEDY_TOKENS)
        assert len(ref) == GREEDY_TOKENS
        assert ours[i] == ref, f"prompt {i}: greedy tokens differ from generate()"
