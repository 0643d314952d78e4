"""Pre-quantized folders (tests/models/test_prequantized.py's) loaded onto 2 simulated devices:
every 8-bit leaf and its scales arrive in the plan's shardings, read shard by shard from the
files (the fp8 block scales [blocks, *features] split as their kernel's columns), and the
split model computes the unsplit one's logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from checkpoints import load_model
from jaxserve.models.sharding import KV_AXIS, MODEL, ShardingPlan, make_mesh
from jaxserve.quantization import QuantScheme
from tests.models.helpers import build_hf_model, sequence_logits
from tests.models.test_prequantized import PROMPT, SHAPE, write_compressed_tensors, write_fp8_block


def _flat(tree) -> dict:
    return {
        "/".join(str(k.key) for k in kp): leaf
        for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


@pytest.mark.parametrize("fmt", ["fp8-blocks", "int8-w8a8"])
def test_a_pre_quantized_folder_loads_split_and_computes_the_unsplit_logits(tmp_path, fmt):
    hf = build_hf_model("llama", **SHAPE)
    if fmt == "fp8-blocks":
        path, scheme = write_fp8_block(hf, tmp_path), QuantScheme(weights="fp8", block=128)
    else:
        path = write_compressed_tensors(hf, tmp_path, "W8A8", "int-quantized")
        scheme = QuantScheme(weights="int8", activations="int8")
    mesh = make_mesh(2)
    whole = load_model(path, dtype=jnp.float32, quant=scheme, layer_loop="scan")
    split = load_model(path, dtype=jnp.float32, quant=scheme, mesh=mesh, layer_loop="scan")
    plan = ShardingPlan.create(mesh, split.config)
    flat = _flat(split.params)
    for name, leaf in flat.items():
        want = plan.sharding(plan.param_spec(name, leaf.ndim))
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), name
        got = np.asarray(leaf).view(np.uint8) if leaf.dtype.itemsize == 1 else np.asarray(leaf)
        ref = np.asarray(_flat(whole.params)[name])
        np.testing.assert_array_equal(got, ref.view(np.uint8) if ref.dtype.itemsize == 1 else ref)
    # Split by KV head (qkv) and by column (gate_up), as the kernels; whole beside o and down.
    assert flat["layers/self_attn/qkv_proj/kernel_scale"].sharding.spec[-3] == KV_AXIS
    scales = flat["layers/mlp/gate_up_proj/kernel_scale"]
    assert scales.sharding.spec[-1] == MODEL
    assert scales.addressable_shards[0].data.size == scales.size // 2
    assert flat["layers/mlp/down_proj/kernel_scale"].sharding.spec in (P(), P(None, None))
    got = sequence_logits(split, PROMPT, plan=plan)
    want = sequence_logits(whole, PROMPT)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())
