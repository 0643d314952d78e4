"""Which layer loop `auto` builds: unrolled only on the CPU, for big or shallow models; env var
first."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from checkpoints import load_model
from checkpoints.config_json import abstract_params, layer_loop_of
from checkpoints.random_weights import NAMED_SHAPES
from jaxserve import target
from jaxserve.models.llama import (
    UNROLL_MAX_SHALLOW_LAYERS,
    UNROLL_MIN_LAYER_BYTES,
    layer_weight_bytes,
    resolve_layer_loop,
)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_weight_bytes_are_the_decoder_kernels_of_the_param_tree(dtype):
    config = NAMED_SHAPES["smollm2-135m"]
    layers = abstract_params(config, dtype)["layers"]
    kernels = [x for x in jax.tree.leaves(layers) if x.ndim >= 3]  # not the [L, H] norm scales
    assert len(kernels) == 4  # qkv, o, gate/up, down
    expected = sum(x.size * jnp.dtype(x.dtype).itemsize for x in kernels)
    assert layer_weight_bytes(config, dtype) == expected


def test_auto_unrolls_big_models_on_the_cpu_only(monkeypatch):
    monkeypatch.delenv("JAXSERVE_LAYER_LOOP", raising=False)
    big = NAMED_SHAPES["smollm2-135m"]
    assert layer_weight_bytes(big, jnp.float32) > UNROLL_MIN_LAYER_BYTES
    assert resolve_layer_loop("auto", big, jnp.float32) == "unrolled"
    assert resolve_layer_loop("auto") == "scan"  # no config: nothing to weigh
    with target.use(target.Target(platform="tpu", device_kind="TPU v5 lite")):
        assert resolve_layer_loop("auto", big, jnp.float32) == "scan"


def test_small_models_and_the_env_var(monkeypatch):
    monkeypatch.setenv("JAXSERVE_LAYER_LOOP", "unrolled")
    embedded = load_model(None, dtype=jnp.float32)  # the loader follows the env var too
    assert layer_loop_of(embedded.params) == "unrolled"
    assert resolve_layer_loop("scan", embedded.config) == "scan"  # explicit beats the env var
    monkeypatch.setenv("JAXSERVE_LAYER_LOOP", "scan")
    assert resolve_layer_loop("auto", NAMED_SHAPES["smollm2-135m"], jnp.float32) == "scan"
    monkeypatch.delenv("JAXSERVE_LAYER_LOOP")
    # 1 MB of weights in 5 layers: shallow, so unrolled (see test_auto_by_depth_for_small_weights).
    assert resolve_layer_loop("auto", embedded.config, jnp.float32) == "unrolled"
    monkeypatch.setenv("JAXSERVE_LAYER_LOOP", "sideways")
    with pytest.raises(ValueError, match="sideways"):
        resolve_layer_loop("auto")


def test_auto_by_depth_for_small_weights(monkeypatch):
    """Small weights: the CPU unrolls a shallow model and scans a deep one; accelerators scan."""
    monkeypatch.delenv("JAXSERVE_LAYER_LOOP", raising=False)
    shallow = dataclasses.replace(NAMED_SHAPES["llama-tiny"], num_layers=UNROLL_MAX_SHALLOW_LAYERS)
    deep = dataclasses.replace(shallow, num_layers=UNROLL_MAX_SHALLOW_LAYERS + 1)
    assert layer_weight_bytes(deep, jnp.float32) < UNROLL_MIN_LAYER_BYTES
    assert resolve_layer_loop("auto", shallow, jnp.float32) == "unrolled"
    assert resolve_layer_loop("auto", deep, jnp.float32) == "scan"
    load = load_model("llama-tiny", dtype=jnp.float32)  # the loader lays params out the same way
    assert layer_loop_of(load.params) == "unrolled"
    with target.use(target.Target(platform="tpu", device_kind="TPU v5 lite")):
        assert resolve_layer_loop("auto", shallow, jnp.float32) == "scan"
