"""Gemma 2 and 3 split over 2 simulated devices against transformers' own forward (issue 46):
the parity checks of tests/models/test_gemma_parity.py (prompts batched and alone, batched
decode, a 32-token greedy loop) at tensor parallel 2, each device holding one of the 2 KV heads
(and its query group), and the model loaded straight onto the mesh equal to the whole load."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import checkpoints
from jaxserve.models.sharding import ShardingPlan, make_mesh
from tests.models.gemma_helpers import GEMMA_FAMILIES, build_gemma
from tests.models.helpers import PagedSession, hf_greedy, hf_logits, paged_greedy, save_hf
from tests.models.test_gemma_parity import BUCKET, DECODE_STEPS, GREEDY_TOKENS, PROMPTS
from tests.models.test_parity import assert_close

TP = 2


@pytest.fixture(scope="module", params=GEMMA_FAMILIES)
def case(request, tmp_path_factory):
    """(transformers model, jaxserve's load of its folder, the plan of tensor parallel 2)."""
    hf = build_gemma(request.param)
    folder = save_hf(hf, tmp_path_factory.mktemp(request.param))
    loaded = checkpoints.load_model(folder, dtype="float32")
    plan = ShardingPlan.create(make_mesh(TP), loaded.config)
    return hf, dataclasses.replace(loaded, source=str(folder)), plan


def test_split_by_kv_head_and_loaded_onto_the_mesh(case):
    _, loaded, plan = case
    assert plan.kv_shards == TP and plan.attention_is_local
    split = checkpoints.load_model(loaded.source, dtype="float32", mesh=make_mesh(TP))
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(split.params),
        jax.tree.leaves(loaded.params),
        strict=True,
    ):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    qkv = split.params["layers_0"]["self_attn"]["qkv_proj"]["kernel"]
    assert {s.data.shape[1] for s in qkv.addressable_shards} == {1}  # one KV head a device


def test_prompts_batched_alone_decode_and_greedy(case):
    hf, loaded, plan = case
    session = PagedSession(loaded, plan=plan, **BUCKET)
    ids = [session.add_seq() for _ in PROMPTS]
    logits = session.step(list(zip(ids, PROMPTS, strict=True)))
    for i, (ours, prompt) in enumerate(zip(logits, PROMPTS, strict=True)):
        assert_close(ours, hf_logits(hf, prompt), f"prompt {i} batched, tp {TP}")
    tokens = [int(lg[-1].argmax()) for lg in logits]
    for step in range(DECODE_STEPS):
        logits = session.step([(s, [t]) for s, t in zip(ids, tokens, strict=True)])
        for s, ours in zip(ids, logits, strict=True):
            ref = hf_logits(hf, session.seqs[s].tokens)[-1:]
            assert_close(ours, ref, f"sequence {s}, decode step {step}, tp {TP}")
        tokens = [int(lg[-1].argmax()) for lg in logits]
    alone = session.add_seq()
    (ours,) = session.step([(alone, PROMPTS[1])])
    assert_close(ours, hf_logits(hf, PROMPTS[1]), f"prompt 1 alone, tp {TP}")
    ours = paged_greedy(loaded, list(PROMPTS), GREEDY_TOKENS, plan=plan, **BUCKET)
    for i, prompt in enumerate(PROMPTS):
        assert ours[i] == hf_greedy(hf, prompt, GREEDY_TOKENS), f"prompt {i} greedy, tp {TP}"


def test_the_hybrid_pool_split_over_two_devices_serves_transformers_tokens(case):
    """The engine at tensor parallel 2 on the hybrid pool (each device's lanes one KV head of
    every group's pages): prompts of 70-110 tokens, chunked by 32 across window 6 and pages of
    16, batched, greedy as transformers' `generate`."""
    from jaxserve.engine.core import Engine
    from jaxserve.engine_config import EngineConfig
    from jaxserve.sampling_params import SamplingParams
    from tests.engine.conftest import drain
    from tests.engine.test_moe_engine import _hf_greedy

    hf, loaded, _ = case
    config = EngineConfig(
        model=loaded.source,
        tensor_parallel=TP,
        kv_layout="hybrid",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        min_token_bucket=16,
        show_progress=False,
    )
    engine = Engine(config)
    assert engine.runner.config.kv_layout.num_groups > 1
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, n).tolist() for n in (70, 90, 110)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
           for p in prompts]  # fmt: skip
    tokens = {i: [] for i in ids}
    for out in drain(engine):
        tokens[out.request_id] += out.new_token_ids
    for i, prompt in zip(ids, prompts, strict=True):
        assert tokens[i] == _hf_greedy(hf, prompt, 12), f"prompt of {len(prompt)}, tp {TP}"
