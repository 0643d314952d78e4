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
