"""`load_model` failures: each raises `ModelLoadError` with a message naming the path and problem.

Covered: a missing folder, a file instead of a folder, a folder without config.json, an
unsupported architecture (a tiny GPT-2 saved by transformers), a checkpoint missing one weight,
a checkpoint with a tensor we do not know, and a tensor whose shape disagrees with config.json.
"""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import pytest
import transformers
from safetensors.numpy import load_file, save_file

import checkpoints
from tests.models.helpers import build_hf_model, save_hf
from tests.torch_reference import require_torch


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_hf(build_hf_model("llama"), tmp_path_factory.mktemp("llama"))


def _copy_with_weights(src, dst, edit):
    """A copy of the HF folder `src` at `dst` whose tensors are `edit(tensors)`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors")
    return dst


def test_missing_folder(tmp_path):
    path = tmp_path / "no_such_model"
    with pytest.raises(checkpoints.ModelLoadError, match="does not exist") as e:
        checkpoints.load_model(path)
    assert str(path) in str(e.value)


def test_file_instead_of_folder(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    with pytest.raises(checkpoints.ModelLoadError, match="is a file"):
        checkpoints.load_model(path)


def test_folder_without_config(tmp_path):
    with pytest.raises(checkpoints.ModelLoadError, match=r"no config\.json"):
        checkpoints.load_model(tmp_path)


def test_unsupported_architecture(tmp_path):
    require_torch()  # transformers builds the GPT-2 model in torch
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    save_hf(transformers.GPT2LMHeadModel(config), tmp_path)
    with pytest.raises(checkpoints.ModelLoadError, match="Unsupported architecture") as e:
        checkpoints.load_model(tmp_path)
    assert "GPT2LMHeadModel" in str(e.value)
    assert isinstance(e.value.__cause__, checkpoints.UnsupportedModelError)


def test_missing_weight(llama_dir, tmp_path):
    def drop(tensors):
        del tensors["model.layers.1.mlp.up_proj.weight"]
        return tensors

    path = _copy_with_weights(llama_dir, tmp_path / "m", drop)
    with pytest.raises(checkpoints.ModelLoadError, match="lacks weights") as e:
        checkpoints.load_model(path, dtype=jnp.float32)
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value)
    # Layer 0's tensor, and layer 1's gate half of the same fused param, are there.
    assert "model.layers.0.mlp.up_proj.weight" not in str(e.value)
    assert "gate_proj" not in str(e.value)


def test_unknown_tensor(llama_dir, tmp_path):
    def add(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = tensors["model.norm.weight"]
        tensors["model.layers.0.cross_attn.q_proj.weight"] = tensors["model.norm.weight"]
        return tensors

    path = _copy_with_weights(llama_dir, tmp_path / "m", add)
    with pytest.raises(checkpoints.ModelLoadError, match="does not know") as e:
        checkpoints.load_model(path, dtype=jnp.float32)
    assert "model.layers.0.cross_attn.q_proj.weight" in str(e.value)
    assert "inv_freq" not in str(e.value)  # a known buffer without weights is skipped


def test_shape_mismatch(llama_dir, tmp_path):
    path = _copy_with_weights(llama_dir, tmp_path / "m", lambda tensors: tensors)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 80
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(checkpoints.ModelLoadError, match="has shape") as e:
        checkpoints.load_model(path, dtype=jnp.float32)
    assert "mlp" in str(e.value)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_hf(build_hf_model("mixtral"), tmp_path_factory.mktemp("mixtral"))


def test_missing_expert_is_named(moe_dir, tmp_path):
    def drop(tensors):
        del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
        return tensors

    path = _copy_with_weights(moe_dir, tmp_path / "m", drop)
    with pytest.raises(checkpoints.ModelLoadError, match="lacks weights") as e:
        checkpoints.load_model(path, dtype=jnp.float32)
    assert "model.layers.1.block_sparse_moe.experts.5.w3.weight" in str(e.value)
    assert "experts.4" not in str(e.value) and "w1" not in str(e.value)


def test_an_expert_past_the_configured_count_is_refused(moe_dir, tmp_path):
    def add(tensors):
        extra = "model.layers.0.block_sparse_moe.experts.{}.w1.weight"
        tensors[extra.format(8)] = tensors[extra.format(0)]
        return tensors

    path = _copy_with_weights(moe_dir, tmp_path / "m", add)
    with pytest.raises(checkpoints.ModelLoadError, match=r"expert 8.*has 8 experts"):
        checkpoints.load_model(path, dtype=jnp.float32)


def test_a_router_of_the_wrong_width_is_refused(moe_dir, tmp_path):
    def first_four(tensors):  # experts 0-3 only, as the edited config says; the routers of 8
        return {k: v for k, v in tensors.items() if not re.search(r"experts\.[4-7]\.", k)}

    path = _copy_with_weights(moe_dir, tmp_path / "m", first_four)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_local_experts": 4}))
    with pytest.raises(checkpoints.ModelLoadError, match=r"gate\.weight.*has shape"):
        checkpoints.load_model(path, dtype=jnp.float32)


@pytest.mark.parametrize("change", [{"decoder_sparse_step": 2}, {"mlp_only_layers": [1]}])
def test_qwen3_moe_with_dense_layers_is_refused(tmp_path, change):
    path = save_hf(build_hf_model("qwen3_moe"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(checkpoints.ModelLoadError, match="dense layers") as e:
        checkpoints.load_model(path, dtype=jnp.float32)
    assert isinstance(e.value.__cause__, checkpoints.UnsupportedModelError)
