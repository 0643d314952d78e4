"""Parity of the mixtures of experts (Qwen3-MoE, Mixtral) with transformers' PyTorch forward.

Tiny random models saved with `save_pretrained` (per-expert tensors, as the Hub's checkpoints)
and loaded with `checkpoints.load_model`, run through the same paged steps as test_parity.py:
whole prompts, prompts in chunks of 3 tokens beside each other, batched decode steps and a
32-token greedy loop, against transformers' forward and `generate`. The experts are redrawn
with the rest, so a mis-mapped expert, a swapped gate/up, a wrong normalisation or a token routed
to the wrong rows changes the logits visibly; 8 experts and top 2 over 25 tokens use most
experts in every step.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import checkpoints
from tests.models import test_parity as parity
from tests.models.helpers import (
    MOE_FAMILIES,
    PagedSession,
    build_hf_model,
    hf_logits,
    save_hf,
)
from tests.models.test_parity import PROMPTS, assert_close


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers model, the same model loaded by jaxserve from its saved folder)."""
    hf = build_hf_model(request.param)
    path = save_hf(hf, tmp_path_factory.mktemp(request.param))
    return hf, checkpoints.load_model(path, dtype=jnp.float32)


def test_config(pair):
    hf, loaded = pair
    c, m = loaded.config, loaded.config.moe
    family = hf.config.model_type
    assert c.architecture == family
    assert (m.num_experts, m.top_k, m.intermediate_size) == (
        getattr(hf.config, "num_experts", None) or hf.config.num_local_experts,
        2,
        32,
    )
    renorm = family == "mixtral" or hf.config.norm_topk_prob
    assert m.normalization == ("softmax_topk_renorm" if renorm else "softmax_topk")
    assert c.qk_norm == (family == "qwen3_moe")
    assert c.sliding_window == (6 if family == "mixtral" else None)
    layer = loaded.params["layers_0"] if "layers_0" in loaded.params else loaded.params["layers"]
    assert set(layer["mlp"]) == {"router", "experts_gate_up", "experts_down"}


def test_experts_hold_their_own_weights(pair):
    """Expert j's gate, up and down are transformers' expert j's (no two swapped)."""
    hf, loaded = pair
    if "layers_0" in loaded.params:  # the unrolled layout
        layer0 = loaded.params["layers_0"]["mlp"]
    else:
        layer0 = {k: v[0] for k, v in loaded.params["layers"]["mlp"].items()}
    experts = hf.model.layers[0].mlp.experts
    gate_up = np.asarray(layer0["experts_gate_up"])  # [E, H, 2, I]
    down = np.asarray(layer0["experts_down"])  # [E, I, H]
    if hasattr(experts, "gate_up_proj"):  # transformers 5 holds them fused: [E, 2I, H]
        ref_gate_up = experts.gate_up_proj.detach().numpy()
        i = gate_up.shape[-1]
        ref_gate, ref_up = ref_gate_up[:, :i], ref_gate_up[:, i:]
        ref_down = experts.down_proj.detach().numpy()  # [E, H, I]
    else:
        ref_gate = np.stack([e.w1.weight.detach().numpy() for e in experts])
        ref_up = np.stack([e.w3.weight.detach().numpy() for e in experts])
        ref_down = np.stack([e.w2.weight.detach().numpy() for e in experts])
    np.testing.assert_array_equal(gate_up[:, :, 0], ref_gate.transpose(0, 2, 1))
    np.testing.assert_array_equal(gate_up[:, :, 1], ref_up.transpose(0, 2, 1))
    np.testing.assert_array_equal(down, ref_down.transpose(0, 2, 1))


def test_whole_prompt_prefill(pair):
    parity.test_whole_prompt_prefill(pair)


def test_each_prompt_alone(pair):
    """One prompt in the step (the rest of the bucket padding) equals transformers too."""
    hf, loaded = pair
    session = PagedSession(loaded)
    seq = session.add_seq()
    (ours,) = session.step([(seq, PROMPTS[1])])
    assert_close(ours, hf_logits(hf, PROMPTS[1]), "prompt 1 alone")


def test_chunked_prefill(pair):
    parity.test_chunked_prefill(pair)


def test_decode_steps(pair):
    parity.test_decode_steps(pair)


def test_greedy_matches_generate(pair):
    parity.test_greedy_matches_generate(pair)
