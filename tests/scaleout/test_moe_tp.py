"""Mixtures of experts split over 2 and 4 simulated devices (expert parallelism) against
transformers' own forward: the parity checks of tests/models/test_moe_parity.py (prompts batched
and alone, chunked prefill, batched decode, a 32-token greedy loop) at tensor parallel 2 and 4,
and each device holding only its share of the experts.

Qwen3-MoE's 8 experts split 2 and 4 ways (4 and 2 a device); Mixtral's 8 likewise, its KV heads
(2) replicated at 4. One with 6 experts shows the fallback: not a multiple of 4, so every device
holds and runs all of them, still exact.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import checkpoints
from jaxserve.models.sharding import ShardingPlan, make_mesh
from tests.models.helpers import (
    PagedSession,
    build_hf_model,
    hf_greedy,
    hf_logits,
    paged_greedy,
    save_hf,
)
from tests.models.test_parity import DECODE_STEPS, GREEDY_TOKENS, PROMPTS, assert_close

CASES = [("qwen3_moe", 2), ("qwen3_moe", 4), ("mixtral", 2), ("mixtral", 4), ("six", 4)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-tp{n}" for f, n in CASES])
def case(request, tmp_path_factory):
    """(transformers model, jaxserve's load of its folder, the plan of tensor parallel n)."""
    family, tp = request.param
    hf = (
        build_hf_model("qwen3_moe_norm", num_experts=6)
        if family == "six"
        else build_hf_model(family)
    )
    folder = save_hf(hf, tmp_path_factory.mktemp(family))
    loaded = checkpoints.load_model(folder, dtype="float32")
    plan = ShardingPlan.create(make_mesh(tp), loaded.config)
    return hf, dataclasses.replace(loaded, source=str(folder)), plan


def _experts(params: dict) -> list[tuple[jax.Array, int]]:
    """Every expert weight with its experts' axis (1 when the layers are stacked, else 0)."""
    return [
        (layer["mlp"][name], 1 if key == "layers" else 0)
        for key, layer in params.items()
        if key.startswith("layers")
        for name in ("experts_gate_up", "experts_down")
    ]


def test_each_device_holds_its_share_of_the_experts(case):
    _, loaded, plan = case
    session = PagedSession(loaded, plan=plan)
    e, tp = loaded.config.moe.num_experts, plan.tensor_parallel
    want = e // tp if e % tp == 0 else e
    assert plan.experts_split == (e % tp == 0)
    for array, axis in _experts(session.params):
        shards = {s.device: s.data.shape[axis] for s in array.addressable_shards}
        assert len(shards) == tp and set(shards.values()) == {want}, shards


def test_loaded_onto_the_mesh_each_device_reads_its_own_experts(case):
    """Loading straight onto the mesh (each device's shard read from the files: its experts
    only) gives the whole load's values."""
    _, loaded, plan = case
    mesh = make_mesh(plan.tensor_parallel)
    split = checkpoints.load_model(loaded.source, dtype="float32", mesh=mesh)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(split.params),
        jax.tree.leaves(loaded.params),
        strict=True,
    ):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
    for array, axis in _experts(split.params):
        sizes = {s.data.shape[axis] for s in array.addressable_shards}
        e, tp = loaded.config.moe.num_experts, plan.tensor_parallel
        assert sizes == {e // tp if e % tp == 0 else e}


def test_prompts_batched_and_alone(case):
    hf, loaded, plan = case
    session = PagedSession(loaded, plan=plan)
    ids = [session.add_seq() for _ in PROMPTS]
    for i, (ours, prompt) in enumerate(
        zip(session.step(list(zip(ids, PROMPTS, strict=True))), PROMPTS, strict=True)
    ):
        assert_close(ours, hf_logits(hf, prompt), f"prompt {i} batched")
    alone = session.add_seq()
    (ours,) = session.step([(alone, PROMPTS[1])])
    assert_close(ours, hf_logits(hf, PROMPTS[1]), "prompt 1 alone")


def test_decode_steps_and_greedy(case):
    hf, loaded, plan = case
    session = PagedSession(loaded, plan=plan)
    ids = [session.add_seq() for _ in PROMPTS]
    logits = session.step(list(zip(ids, PROMPTS, strict=True)))
    tokens = [int(lg[-1].argmax()) for lg in logits]
    for step in range(DECODE_STEPS):
        logits = session.step([(s, [t]) for s, t in zip(ids, tokens, strict=True)])
        for s, ours in zip(ids, logits, strict=True):
            ref = hf_logits(hf, session.seqs[s].tokens)[-1:]
            assert_close(ours, ref, f"sequence {s}, decode step {step}")
        tokens = [int(lg[-1].argmax()) for lg in logits]
    ours = paged_greedy(loaded, list(PROMPTS), GREEDY_TOKENS, plan=plan)
    for i, prompt in enumerate(PROMPTS):
        assert ours[i] == hf_greedy(hf, prompt, GREEDY_TOKENS), f"prompt {i} greedy"
    assert len({t for o in ours for t in o}) > 3  # not stuck on one token
