"""Checkpoint formats: orbax round trip, sharded safetensors, and bfloat16 safetensors.

An orbax round trip must give back the same config, dtype, params (bit for bit), logits and
tokenizer. A model saved by transformers in several shards (`model.safetensors.index.json`) and
one saved in bfloat16 (read by our memory-mapped reader) must load and match transformers; run in
bfloat16, the latter must stay as close to the float32 logits as transformers' bfloat16 run.
Loaded for the scanned or the unrolled layer loop, a folder gives the same weights and logits; a
folder of the old unfused orbax format is refused with a message saying to convert it again.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from transformers import AutoModelForCausalLM

import checkpoints
from checkpoints.config_json import stack_layers
from checkpoints.safetensors_io import read_header
from tests.models.helpers import (
    STORIES_BUCKET,
    build_hf_model,
    hf_logits,
    save_hf,
    sequence_logits,
)
from tests.torch_reference import require_torch

ATOL = 1e-4
PROMPT = [1, 103, 107, 61, 78, 17, 99, 3, 45]  # within every test model's vocab (128)


def _max_err(ours: np.ndarray, ref: np.ndarray) -> float:
    assert ours.shape == ref.shape
    return float(np.max(np.abs(ours - ref)))


@pytest.mark.parametrize("source", ["stories260k", "llama", "mixtral"])
def test_orbax_round_trip(source, tmp_path):
    if source == "stories260k":  # has a tokenizer
        model = checkpoints.load_model(dtype=jnp.float32)
        bucket = STORIES_BUCKET
    else:  # llama: untied head, q/k/v/o and MLP biases, llama3 RoPE scaling; mixtral: experts
        hf_dir = save_hf(build_hf_model(source), tmp_path / "hf")
        model = checkpoints.load_model(hf_dir, dtype=jnp.float32)
        bucket = {}
    out = checkpoints.save_orbax(model, tmp_path / "orbax")
    back = checkpoints.load_model(out)

    assert back.config == model.config
    assert back.dtype == model.dtype
    assert jax.tree.structure(back.params) == jax.tree.structure(model.params)
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(model.params), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(
        sequence_logits(back, PROMPT, **bucket), sequence_logits(model, PROMPT, **bucket)
    )
    if model.tokenizer is None:
        assert back.tokenizer is None
    else:
        text = "Once upon a time, there was a little dog."
        ids = model.tokenizer.encode(text)
        assert back.tokenizer.encode(text) == ids
        assert back.tokenizer.decode(ids) == model.tokenizer.decode(ids)
    with pytest.raises(FileExistsError):
        checkpoints.save_orbax(model, out)


def test_scan_and_unrolled_layer_loops_agree(tmp_path):
    """The same HF folder loaded for either layer loop: the unrolled per-layer arrays stack back
    into the scanned model's params bit for bit, and both loops give the same logits (qwen2:
    fused q/k/v with biases, 2 query heads per KV head)."""
    hf_dir = save_hf(build_hf_model("qwen2"), tmp_path / "hf")
    scan = checkpoints.load_model(hf_dir, dtype=jnp.float32, layer_loop="scan")
    unrolled = checkpoints.load_model(hf_dir, dtype=jnp.float32, layer_loop="unrolled")
    assert "layers" in scan.params and "layers_1" in unrolled.params
    restacked = stack_layers(unrolled.params)
    assert jax.tree.structure(restacked) == jax.tree.structure(scan.params)
    for a, b in zip(jax.tree.leaves(restacked), jax.tree.leaves(scan.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(
        sequence_logits(unrolled, PROMPT), sequence_logits(scan, PROMPT), rtol=0, atol=1e-5
    )


def test_a_folder_of_the_unfused_format_asks_for_a_new_conversion(tmp_path):
    model = checkpoints.load_model("llama-tiny", dtype=jnp.float32)
    out = checkpoints.save_orbax(model, tmp_path / "orbax")
    meta = json.loads((out / "jaxserve.json").read_text())
    (out / "jaxserve.json").write_text(json.dumps({**meta, "format": "jaxserve-orbax-1"}))
    with pytest.raises(checkpoints.ModelLoadError, match="jaxserve convert random:llama-tiny"):
        checkpoints.load_model(out)


def test_sharded_safetensors(tmp_path):
    hf = build_hf_model("qwen2")
    path = save_hf(hf, tmp_path / "sharded", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("model-*.safetensors"))) >= 3
    loaded = checkpoints.load_model(path, dtype=jnp.float32)
    err = _max_err(sequence_logits(loaded, PROMPT), hf_logits(hf, PROMPT))
    assert err <= ATOL, f"sharded checkpoint: max abs logit error {err:.3g}"


def test_bfloat16_safetensors(tmp_path):
    torch = require_torch()
    hf = build_hf_model("qwen2").to(torch.bfloat16)
    path = save_hf(hf, tmp_path / "bf16")
    header, _ = read_header(path / "model.safetensors")
    assert {info["dtype"] for info in header.values()} == {"BF16"}

    # Upcast on load, as transformers does when it reads the file into float32. (Not
    # `hf.to(torch.float32)`: that would keep RoPE's inv_freq buffer rounded to bfloat16.)
    as_f32 = checkpoints.load_model(path, dtype=jnp.float32)
    assert {leaf.dtype for leaf in jax.tree.leaves(as_f32.params)} == {jnp.dtype(jnp.float32)}
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    err = _max_err(sequence_logits(as_f32, PROMPT), hf_logits(hf, PROMPT))
    assert err <= ATOL, f"bfloat16 checkpoint read as float32: max abs logit error {err:.3g}"

    # Kept in bfloat16: bit-identical to the stored tensors.
    as_bf16 = checkpoints.load_model(path, dtype=jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree.leaves(as_bf16.params)} == {
        jnp.dtype(ml_dtypes.bfloat16)
    }
    embed = np.asarray(as_bf16.params["embed_tokens"]["embedding"]).astype(np.float32)
    np.testing.assert_array_equal(embed, hf.model.embed_tokens.weight.detach().numpy())
    # Layer 1's q bias: the q piece of the fused qkv bias [num_kv_heads, group + 2, head_dim].
    qkv_bias = stack_layers(as_bf16.params)["layers"]["self_attn"]["qkv_proj"]["bias"][1]
    q_bias = np.asarray(qkv_bias[:, : as_bf16.config.q_per_kv]).reshape(-1)
    np.testing.assert_array_equal(
        q_bias.astype(np.float32), hf.model.layers[1].self_attn.q_proj.bias.detach().numpy()
    )

    # Computing in bfloat16 strays from the float32 logits no more than transformers' bfloat16.
    ref = hf_logits(hf, PROMPT)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    hf_err = _max_err(hf_logits(hf_bf16, PROMPT), ref)
    our_err = _max_err(sequence_logits(as_bf16, PROMPT), ref)
    assert our_err <= 2 * hf_err, (
        f"bfloat16 logits off by {our_err:.3g}; transformers' {hf_err:.3g}"
    )
