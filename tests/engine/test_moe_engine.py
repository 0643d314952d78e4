"""A mixture of experts behind the engine: everything the engine does works on one (issue 42).

A tiny random Qwen3-MoE (8 experts, top 2) saved by transformers with the embedded model's
tokenizer beside it, so it serves text: greedy parity with transformers' `generate` through
continuous batching and chunked prefill, no compiles after warm-up, the prefix cache, structured
output, logprobs against transformers' own, n-gram speculation token for token, swapping to the
host tier, the experts' load in /metrics, and LoRA adapters on the experts refused by name.
Its hidden size (64) and experts' width (32: gate and up 64 columns) fill the CPU kernels'
panels, so the packed path is the one under test where the CPU has AVX-512.
"""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest

from checkpoints import DEFAULT_MODEL_DIR, load_model
from checkpoints.peft import AdapterLoadError, load_peft_adapter
from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.runtime import compiles
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import SMALL, TINY, drain
from tests.models.helpers import build_hf_model, save_hf
from tests.torch_reference import require_torch

PROMPTS = [
    "Once upon a time",
    "Lily and Tom went to the park to play on the swings. " * 2,
    "The cat",
    "He liked to play with his toys. He liked to play with his toys.",
]
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    """(transformers model, its folder with stories260k's tokenizer) of a text-serving MoE."""
    hf = build_hf_model(
        "qwen3_moe_norm",
        vocab_size=512,
        hidden_size=64,
        num_experts=8,
        max_position_embeddings=1024,
    )
    folder = save_hf(hf, tmp_path_factory.mktemp("qwen3-moe-text"))
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    # The tokenizer's end of sequence, which grammars end on; transformers' model in memory
    # keeps none, so its generate() runs every token as ours do with ignore_eos.
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 2}))
    return hf, folder


@pytest.fixture(scope="module")
def moe_engine(moe_folder) -> Engine:
    return Engine(EngineConfig(model=str(moe_folder[1]), **SMALL))


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    torch = require_torch()
    t = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=n)
    return out[0, len(ids) :].tolist()


def test_greedy_batched_matches_transformers_generate(moe_folder, moe_engine):
    hf, _ = moe_folder
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = LLM(engine=moe_engine).generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == _hf_greedy(hf, out.prompt_token_ids, 24), prompt


def test_mixed_workload_never_compiles_after_warmup(moe_engine):
    engine = moe_engine
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


def test_prefix_cache_hits_give_the_same_tokens(moe_engine):
    llm = LLM(engine=moe_engine)
    prompt = "Tom had a red ball and a blue kite. " * 4
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    hits = moe_engine.metrics.stats.prefix_cache_hits
    again = llm.generate([prompt], params)[0]
    assert moe_engine.metrics.stats.prefix_cache_hits > hits
    assert again.token_ids == first.token_ids


def test_structured_output_holds(moe_engine):
    choices = ["red", "green", "light blue"]
    params = [
        SamplingParams(max_tokens=12, seed=i, structured_output={"choice": choices})
        for i in range(6)
    ]
    regex = r"[0-9]{2}\.[0-9] (EUR|USD)"
    params += [
        SamplingParams(max_tokens=16, seed=i, structured_output={"regex": regex}) for i in range(6)
    ]
    outs = LLM(engine=moe_engine).generate(["Colour:"] * 6 + ["Price:"] * 6, params)
    assert all(o.text in choices for o in outs[:6]), [o.text for o in outs[:6]]
    assert all(re.fullmatch(regex, o.text) for o in outs[6:]), [o.text for o in outs[6:]]


def test_logprobs_are_transformers_log_softmax(moe_folder, moe_engine):
    torch = require_torch()
    hf, _ = moe_folder
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    out = LLM(engine=moe_engine).generate([PROMPTS[0]], params)[0]
    ids = out.prompt_token_ids + out.token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    ref = torch.log_softmax(logits, -1).numpy()
    for i, lp in enumerate(out.logprobs):
        row = ref[len(out.prompt_token_ids) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert math.isclose(lp.logprob, row[lp.token_id], abs_tol=1e-4)
        assert [t for t, _ in lp.top] == np.argsort(-row)[:3].tolist()


def test_the_experts_load_is_in_the_metrics(moe_engine):
    """Every real token computed is routed to top_k experts in each layer, counted once."""
    engine = moe_engine
    stats = engine.metrics.stats
    before = 0 if stats.expert_load is None else stats.expert_load.sum(axis=1)
    computed = stats.real_tokens
    LLM(engine=engine).generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
    load = stats.expert_load if engine.metrics.stats is stats else engine.metrics.stats.expert_load
    c = engine.model.config
    assert load.shape == (c.num_layers, c.moe.num_experts)
    per_layer = load.sum(axis=1) - before
    assert set(per_layer.tolist()) == {(engine.metrics.stats.real_tokens - computed) * 2}
    assert (load > 0).sum() > c.num_layers  # more than one expert a layer
    sample = engine.metrics.registry.get_sample_value
    assert sample("jaxserve_moe_expert_tokens_total", {"layer": "1", "expert": "3"}) == load[1, 3]
    mean = load[0].mean()
    assert sample("jaxserve_moe_expert_imbalance", {"layer": "0"}) == pytest.approx(
        load[0].max() / mean
    )


def test_speculation_gives_the_same_greedy_tokens(moe_folder, moe_engine):
    spec = Engine(
        EngineConfig(model=str(moe_folder[1]), speculative="ngram", prompt_lookup_min=1, **TINY),
        model=moe_engine.model,
    )
    spec.scheduler.set_step_cost(lambda spans: 1.0)  # verify every proposal: exactness only
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    got = LLM(engine=spec).generate(PROMPTS, params)
    want = LLM(engine=moe_engine).generate(PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.metrics.stats.spec_proposed_tokens > 0
    assert spec.metrics.stats.compiles_after_warmup == 0


def test_swapped_to_the_host_tier_and_back_the_same(moe_folder, moe_engine):
    """Pages for ~2 of 4 long requests: victims swap to the host pool and resume exactly."""
    short = Engine(
        EngineConfig(
            model=str(moe_folder[1]),
            num_pages=8,
            page_size=16,
            host_kv_gb=0.01,
            preemption="swap",
            **TINY,
        ),
        model=moe_engine.model,
    )
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    got = LLM(engine=short).generate(PROMPTS, params)
    want = LLM(engine=moe_engine).generate(PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert short.metrics.stats.kv_offload.get("swap_preemptions", 0) > 0


def test_adapters_on_the_experts_are_refused_by_name(tmp_path, moe_folder):
    from safetensors.numpy import save_file

    model = load_model(moe_folder[1])
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"]})
    )
    key = "base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_{}.weight"
    save_file(
        {key.format("A"): np.zeros((4, 64), np.float32), key.format("B"): np.zeros((32, 4), "f4")},
        folder / "adapter_model.safetensors",
    )
    with pytest.raises(AdapterLoadError, match=r"mixture of experts.*q_proj, k_proj"):
        load_peft_adapter(folder, "experts", model.config, max_rank=8)


def test_beam_search_matches_the_brute_force_reference(moe_folder, moe_engine):
    """Beams fork their parent's pages (copy on write) and run as ordinary requests: width 3
    over the experts gives transformers' brute-force beams."""
    from tests.engine.test_beam_search import reference_beam_search

    hf, _ = moe_folder
    ids = moe_engine.encode(PROMPTS[0])
    want = reference_beam_search(hf, ids, 3, 8, 1.0, set(moe_engine.model.config.eos_token_ids))
    (got,) = LLM(engine=moe_engine).beam_search([ids], beam_width=3, max_tokens=8)
    assert [b.token_ids for b in got] == [w[0] for w in want]
    np.testing.assert_allclose([b.cumulative_logprob for b in got], [w[1] for w in want], atol=1e-3)


def test_the_experts_run_packed_where_the_cpu_packs(moe_engine):
    """On one AVX-512 CPU device the step reads the experts in cpu_matmul.cc's panels (the
    grouped kernel), not XLA's ragged_dot over the canonical layout."""
    from pallas_kernels.ragged_paged_attention import cpu_ffi

    runner = moe_engine.runner
    if not runner.module.packed_weights:
        pytest.skip("this CPU does not pack weights (no AVX-512 or the kernels' library)")
    c = moe_engine.model.config
    e, h, i = c.moe.num_experts, c.hidden_size, c.moe.intermediate_size
    mlp = runner.step_params["layers_0"]["mlp"]
    assert mlp["experts_gate_up"].shape == (e, 2 * i // cpu_ffi.PANEL, h, cpu_ffi.PANEL)
    assert mlp["experts_down"].shape == (e, h // cpu_ffi.PANEL, i, cpu_ffi.PANEL)
