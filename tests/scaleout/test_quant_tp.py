"""Quantized weights split over 2 simulated devices: each scale leaf is split as its kernel's
output columns are, the quantizer puts each shard where the plan says, and the split quantized
model computes what the unsplit one does."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from checkpoints import NAMED_SHAPES, load_model
from checkpoints.config_json import abstract_params, unstack_layers
from jaxserve.models.quant import SCALE_SUFFIX, contracting_axis, quantize_params
from jaxserve.models.sharding import KV_AXIS, MODEL, ShardingPlan, make_mesh
from jaxserve.quantization import QuantScheme
from tests.models.test_quant import TOKENS, _logits

INT8 = QuantScheme(weights="int8")
FP8_T = QuantScheme(weights="fp8", activations="fp8", transposed=True)  # GPUs' fp8 W8A8
LLAMA = NAMED_SHAPES["llama-tiny"].replace(num_heads=8, num_kv_heads=4, qkv_bias=True)


def _flat(tree) -> dict:
    return {
        "/".join(str(k.key) for k in kp): leaf
        for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


@pytest.mark.parametrize("name", ["llama", "qwen3-moe-tiny", "llama-transposed"])
@pytest.mark.parametrize("layout", ["scan", "unrolled"])
def test_each_scale_is_split_as_its_kernel_s_output_columns(name, layout):
    config = NAMED_SHAPES[name] if name == "qwen3-moe-tiny" else LLAMA
    scheme = FP8_T if name == "llama-transposed" else INT8
    shapes = abstract_params(config, jnp.float32, quant=scheme)
    if layout == "unrolled":
        shapes = unstack_layers(shapes)
    specs = {
        k: s.spec
        for k, s in _flat(ShardingPlan.create(make_mesh(2), config).params(shapes)).items()
    }
    scales = [k for k in specs if k.endswith(SCALE_SUFFIX)]
    assert len(scales) == 4 * (config.num_layers if layout == "unrolled" else 1)
    for scale in scales:
        kernel = scale.removesuffix(SCALE_SUFFIX)
        ndim = len(_flat(shapes)[kernel].shape)
        want = _padded(specs[kernel], ndim)
        del want[contracting_axis(tuple(kernel.split("/")))]  # gone; the rest keep their split
        assert _padded(specs[scale], ndim - 1) == want, scale
    # Spelled out for the stacked dense layer: columns split -> scales split with them; rows
    # split (o, down: their output columns whole on every device) -> scales replicated.
    if name == "llama" and layout == "scan":
        assert specs["layers/self_attn/qkv_proj/kernel_scale"] == P(None, KV_AXIS, None, None)
        assert specs["layers/mlp/gate_up_proj/kernel_scale"] == P(None, None, MODEL)
        assert specs["layers/self_attn/o_proj/kernel_scale"] == P()
        assert specs["layers/mlp/down_proj/kernel_scale"] == P()
    if name == "llama-transposed" and layout == "scan":  # [layers, *features, in]: same splits
        assert specs["layers/self_attn/qkv_proj/kernel_t"] == P(None, KV_AXIS, None, None, None)
        assert specs["layers/mlp/gate_up_proj/kernel_t"] == P(None, None, MODEL, None)
        assert specs["layers/self_attn/o_proj/kernel_t"] == P(None, None, MODEL)
        assert specs["layers/mlp/down_proj/kernel_t_scale"] == P()
    if name == "qwen3-moe-tiny" and layout == "scan":  # expert parallel: by expert
        assert specs["layers/mlp/experts_gate_up_scale"] == P(None, MODEL, None, None)
        assert specs["layers/mlp/experts_down_scale"] == P(None, MODEL, None)


def _padded(spec: P, ndim: int) -> list:
    """A spec's entries for all `ndim` axes (P() and P(None, None) say the same)."""
    return [*spec, *[None] * (ndim - len(spec))]


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-moe-tiny"])
def test_a_split_quantized_model_holds_its_shards_and_computes_the_unsplit_logits(name):
    mesh = make_mesh(2)
    config = NAMED_SHAPES[name]
    plan = ShardingPlan.create(mesh, config)
    whole = load_model(name, dtype=jnp.float32)
    split = load_model(name, dtype=jnp.float32, mesh=mesh)
    q_whole = quantize_params(whole.params, INT8)
    q_split = quantize_params(split.params, INT8, plan, donate=True)
    for path, leaf in _flat(q_split).items():
        want = plan.sharding(plan.param_spec(path, leaf.ndim))
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), path
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(_flat(q_whole)[path]))
    gate_up = next(
        v
        for k, v in _flat(q_split).items()
        if k.endswith(("gate_up_proj/kernel_scale", "experts_gate_up_scale"))
    )
    # One device holds half the scales of its gate/up columns (or of its experts).
    assert gate_up.addressable_shards[0].data.size == gate_up.size // 2
    got = _logits(dataclasses.replace(split, params=q_split, quant=INT8), INT8, TOKENS[:12], plan)
    want = _logits(dataclasses.replace(whole, params=q_whole, quant=INT8), INT8, TOKENS[:12])
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


def test_host_arrays_are_quantized_onto_the_plan_s_shardings():
    """A trainer's numpy state (Engine.update_weights, builder.load_params) has no sharding of
    its own: each quantized leaf lands where the plan puts it, split across the devices."""
    mesh = make_mesh(2)
    plan = ShardingPlan.create(mesh, LLAMA)
    shapes = abstract_params(LLAMA, jnp.float32)
    host = jax.tree.map(lambda a: np.ones(a.shape, a.dtype), shapes)
    quantized = quantize_params(host, INT8, plan)
    for path, leaf in _flat(quantized).items():
        if contracting_axis(tuple(path.split("/"))) is None and not path.endswith(SCALE_SUFFIX):
            continue  # left as they were (numpy)
        want = plan.sharding(plan.param_spec(path, leaf.ndim))
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), path
    qkv = _flat(quantized)["layers/self_attn/qkv_proj/kernel"]
    assert qkv.addressable_shards[0].data.shape[-3] == LLAMA.num_kv_heads // 2
