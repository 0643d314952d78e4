"""Loading straight into the sharding: Hugging Face safetensors and orbax restores put each
shard on its device, and the values are those of the unsplit model."""

from __future__ import annotations

import jax
import numpy as np

from checkpoints import DEFAULT_MODEL_DIR, load_model, save_orbax
from checkpoints.config_json import abstract_params
from jaxserve.models.sharding import ShardingPlan, make_mesh


def _assert_placed_like(model, reference, tp: int) -> None:
    """Same values as `reference`, each leaf in the plan's sharding, each shard only its slice."""
    plan = ShardingPlan.create(make_mesh(tp), model.config)
    # In the layout the platform's layer loop runs (the model was loaded for it).
    want_shardings = plan.params(abstract_params(model.config, model.dtype, layer_loop="auto"))
    flat = jax.tree_util.tree_flatten_with_path(model.params)[0]
    ref = jax.tree.leaves(reference.params)
    want = jax.tree.leaves(want_shardings)
    split = 0
    for (keypath, leaf), ref_leaf, sharding in zip(flat, ref, want, strict=True):
        name = jax.tree_util.keystr(keypath)
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), name
        full = np.asarray(ref_leaf)
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index], err_msg=name)
        split += leaf.addressable_shards[0].data.size < leaf.size
    assert split >= 5  # qkv, o, gate_up and down of every layer and the embedding are split


def test_hf_safetensors_load_into_the_sharding():
    whole = load_model(DEFAULT_MODEL_DIR)  # stories260k: 8 heads, 4 KV heads, tied embeddings
    split = load_model(DEFAULT_MODEL_DIR, mesh=make_mesh(4))
    _assert_placed_like(split, whole, 4)


def test_orbax_restores_into_the_sharding(tmp_path):
    whole = load_model(DEFAULT_MODEL_DIR)
    save_orbax(whole, tmp_path / "ckpt")
    split = load_model(tmp_path / "ckpt", mesh=make_mesh(2))
    _assert_placed_like(split, whole, 2)
