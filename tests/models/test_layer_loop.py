"""Which layer loop `auto` builds: unrolled only for big models on the CPU, env var first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from checkpoints import load_model
from checkpoints.loaded import abstract_params, layer_loop_of
from checkpoints.random_weights import NAMED_SHAPES
from jaxserve.models.llama import (
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
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_layer_loop("auto", big, jnp.float32) == "scan"


def test_small_models_and_the_env_var(monkeypatch):
    monkeypatch.setenv("JAXSERVE_LAYER_LOOP", "unrolled")
    embedded = load_model(None, dtype=jnp.float32)  # the loader follows the env var too
    assert layer_loop_of(embedded.params) == "unrolled"
    assert resolve_layer_loop("scan", embedded.config) == "scan"  # explicit beats the env var
    monkeypatch.setenv("JAXSERVE_LAYER_LOOP", "scan")
    assert resolve_layer_loop("auto", NAMED_SHAPES["smollm2-135m"], jnp.float32) == "scan"
    monkeypatch.delenv("JAXSERVE_LAYER_LOOP")
    assert resolve_layer_loop("auto", embedded.config, jnp.float32) == "scan"  # 1 MB of weights
    monkeypatch.setenv("JAXSERVE_LAYER_LOOP", "sideways")
    with pytest.raises(ValueError, match="sideways"):
        resolve_layer_loop("auto")
