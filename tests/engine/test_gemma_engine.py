"""Gemma behind the engine (issue 46): a tiny random Gemma 2 (soft caps: the jnp attention) and
Gemma 3 (per-layer RoPE: the fused CPU call) saved by transformers with the embedded model's
tokenizer beside them, served with continuous batching and chunked prefill: greedy tokens equal
to transformers' `generate`, and nothing compiles after warm-up. Hidden size 64 fills the CPU
kernels' panels, so where the CPU has AVX-512 the packed matmuls and head are under test."""

from __future__ import annotations

import shutil

import pytest

from checkpoints import DEFAULT_MODEL_DIR
from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.runtime import compiles
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import SMALL, drain
from tests.engine.test_moe_engine import PROMPTS, TOKENIZER_FILES, _hf_greedy
from tests.models.gemma_helpers import GEMMA_FAMILIES, build_gemma
from tests.models.helpers import save_hf


@pytest.fixture(scope="module", params=GEMMA_FAMILIES)
def served(request, tmp_path_factory):
    """(transformers model, an engine serving the same Gemma from its folder)."""
    hf = build_gemma(request.param, vocab_size=512, max_position_embeddings=1024)
    folder = save_hf(hf, tmp_path_factory.mktemp(request.param))
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return hf, Engine(EngineConfig(model=str(folder), **SMALL))


def test_greedy_batched_matches_transformers_generate(served):
    hf, engine = served
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = LLM(engine=engine).generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == _hf_greedy(hf, out.prompt_token_ids, 24), prompt


def test_mixed_workload_never_compiles_after_warmup(served):
    _, engine = served
    before, serving = engine.runner.num_compiles, compiles.serving()
    long_prompt = engine.tokenizer("Once upon a time, " * 30)["input_ids"]
    assert len(long_prompt) > SMALL["max_num_batched_tokens"]  # chunked prefill
    engine.add_request(long_prompt, SamplingParams(max_tokens=8, temperature=0))
    for i in range(10):
        engine.add_request(PROMPTS[i % 4], SamplingParams(max_tokens=3 + i, temperature=0.7))
        engine.step()
    drain(engine)
    assert engine.runner.num_compiles == before
    assert compiles.serving() == serving, f"compiled after warm-up: {compiles.recent()}"


def test_served_packed_where_the_cpu_packs(served):
    """On one AVX-512 CPU device the step reads Gemma's kernels and tied head in
    cpu_matmul.cc's panels, and the final soft cap is applied after the packed head."""
    _, engine = served
    runner = engine.runner
    if not runner.module.packed_weights:
        pytest.skip("this CPU does not pack weights (no AVX-512 or the kernels' library)")
    params = runner.step_params
    assert "packed_head" in params
    assert params["layers_0"]["mlp"]["gate_up_proj"]["kernel"].ndim == 3  # [N / 64, K, 64]


# ---- Gemma's 262,144-word vocabulary: the grammar mask's width, the head's cost ----

GEMMA_VOCAB = 262_144


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """(transformers model, engine) of a tiny Gemma 3 with Gemma's real vocabulary width,
    serving the embedded model's 512-word tokenizer: ids 512 and up are words no grammar may
    emit, as a checkpoint's padded vocabulary rows are."""
    hf = build_gemma(
        "gemma3", vocab_size=GEMMA_VOCAB, max_position_embeddings=1024, eos_token_id=2
    )  # stories260k's </s>: the grammar engine needs an end of sequence
    folder = save_hf(hf, tmp_path_factory.mktemp("gemma3-wide"))
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return hf, Engine(EngineConfig(model=str(folder), **SMALL))


def test_a_262k_vocabulary_serves_grammars_logprobs_and_greedy_text(wide):
    """The mask rows are 262,144 / 32 words wide; choice and regex constraints hold although
    most of the head's 262k logits belong to no token of the tokenizer; logprobs are
    transformers' log_softmax over all 262,144; greedy equals generate; no compile after
    warm-up."""
    import re

    import numpy as np
    import torch

    hf, engine = wide
    assert engine.model.config.vocab_size == GEMMA_VOCAB
    assert engine.runner.mask_words == GEMMA_VOCAB // 32
    llm = LLM(engine=engine)
    before = compiles.serving()
    choices = ["red", "green", "light blue"]
    regex = r"[0-9]{2}\.[0-9] (EUR|USD)"
    params = [SamplingParams(max_tokens=12, seed=i, structured_output={"choice": choices})
              for i in range(4)]  # fmt: skip
    params += [SamplingParams(max_tokens=16, seed=i, structured_output={"regex": regex})
               for i in range(4)]  # fmt: skip
    outs = llm.generate(["Colour:"] * 4 + ["Price:"] * 4, params)
    assert all(o.text in choices for o in outs[:4]), [o.text for o in outs[:4]]
    assert all(re.fullmatch(regex, o.text) for o in outs[4:]), [o.text for o in outs[4:]]
    assert all(t < 512 for o in outs for t in o.token_ids)  # never a word past the tokenizer's
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    out = llm.generate([PROMPTS[0]], greedy)[0]
    assert out.token_ids == _hf_greedy(hf, out.prompt_token_ids, 12)
    with torch.no_grad():
        ids = torch.tensor([out.prompt_token_ids + out.token_ids[:1]])
        want = torch.log_softmax(hf(ids).logits[0, len(out.prompt_token_ids) - 1], -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    np.testing.assert_allclose(first.logprob, float(want[first.token_id]), atol=1e-4)
    assert compiles.serving() == before, f"compiled after warm-up: {compiles.recent()}"
