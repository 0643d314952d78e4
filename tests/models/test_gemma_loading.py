"""Gemma checkpoints and configs (issue 46): a multimodal Gemma 3 folder serves its text model,
unsupported options are refused by name, and the named random shapes `gemma3-1b` and
`gemma2-2b` are the published models' (their configs through our parser, their parameter
counts those of transformers' own modules, built on the meta device)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

import checkpoints
from checkpoints import NAMED_SHAPES, ModelLoadError
from checkpoints.config_json import abstract_params
from checkpoints.hf_config import model_config_from_hf
from tests.models.gemma_helpers import build_gemma
from tests.models.helpers import hf_logits, save_hf, sequence_logits
from tests.torch_reference import require_torch

# google/gemma-3-1b-pt's config.json (transformers 4.x field names).
GEMMA3_1B = dict(
    architectures=["Gemma3ForCausalLM"],
    attention_bias=False,
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    hidden_size=1152,
    intermediate_size=6912,
    max_position_embeddings=32768,
    num_attention_heads=4,
    num_hidden_layers=26,
    num_key_value_heads=1,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-6,
    rope_local_base_freq=10000,
    rope_scaling=None,
    rope_theta=1000000,
    sliding_window=512,
    sliding_window_pattern=6,
    vocab_size=262144,
    bos_token_id=2,
    eos_token_id=[1, 106],
)
# google/gemma-2-2b's config.json.
GEMMA2_2B = dict(
    architectures=["Gemma2ForCausalLM"],
    attention_bias=False,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    hidden_size=2304,
    intermediate_size=9216,
    max_position_embeddings=8192,
    num_attention_heads=8,
    num_hidden_layers=26,
    num_key_value_heads=4,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    sliding_window=4096,
    vocab_size=256000,
    bos_token_id=2,
    eos_token_id=1,
)


@pytest.mark.parametrize(
    "name, config_cls, fields, model_cls",
    [
        ("gemma3-1b", transformers.Gemma3TextConfig, GEMMA3_1B, "Gemma3ForCausalLM"),
        ("gemma2-2b", transformers.Gemma2Config, GEMMA2_2B, "Gemma2ForCausalLM"),
    ],
)
def test_named_shapes_are_the_published_models(name, config_cls, fields, model_cls):
    torch = require_torch()
    hf = config_cls(**fields)
    parsed = model_config_from_hf(hf)
    named = NAMED_SHAPES[name]
    assert parsed == named.replace(eos_token_ids=parsed.eos_token_ids), name
    if name == "gemma3-1b":
        assert named.layer_types.count("full_attention") == 4  # layers 5, 11, 17, 23
        assert (named.layer_rope(0).theta, named.layer_rope(5).theta) == (10000.0, 1e6)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(hf)
    want = sum(p.numel() for p in model.parameters())
    have = sum(int(np.prod(a.shape)) for a in _leaves(abstract_params(named, jnp.bfloat16)))
    assert have == want, f"{name}: {have} params, transformers' module has {want}"


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_a_multimodal_gemma3_folder_serves_its_text_model(tmp_path):
    """Gemma3ForConditionalGeneration (text_config nested, a vision tower beside it): the
    text model's tensors under model.language_model. load, the vision tensors are skipped,
    and the logits are the multimodal model's on text."""
    torch = require_torch()
    text = build_gemma("gemma3").config
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4
    )
    config._attn_implementation = "eager"
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            scale = 0.3 if n.endswith("norm.weight") else 1.5 * p.shape[-1] ** -0.5
            p.copy_(scale * torch.randn(p.shape, generator=gen))
    folder = save_hf(hf, tmp_path / "mm")
    loaded = checkpoints.load_model(folder, dtype=jnp.float32)
    assert loaded.config.architecture == "gemma3" and loaded.config.qk_norm
    prompt = list(range(5, 27))
    ours = sequence_logits(loaded, prompt, num_tokens=32, pages_per_seq=8, num_pages=16)
    err = float(np.max(np.abs(ours - hf_logits(hf, prompt))))
    assert err <= 1e-4, f"multimodal Gemma 3's text logits differ by {err:.3g}"


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("gemma2", dict(hidden_activation="gelu"), r"hidden_activation='gelu' is not supported"),
        (
            "gemma3",
            dict(use_bidirectional_attention=True),
            r"use_bidirectional_attention=True .* is not supported",
        ),
        ("gemma3", dict(attention_bias=True), r"attention_bias=True is not supported"),
    ],
)
def test_unsupported_options_are_refused_by_name(tmp_path, family, overrides, message):
    hf = build_gemma(family, **overrides)
    folder = save_hf(hf, tmp_path / family)
    with pytest.raises(ModelLoadError, match=message) as info:
        checkpoints.load_model(folder, dtype=jnp.float32)
    assert str(info.value).endswith("."), "the reason is a whole sentence"


def test_a_soft_capped_named_shape_is_refused_on_a_kernel():
    """gemma2-2b on the TPU kernel (model construction, before any weight is drawn)."""
    from jaxserve.models.llama import refuse_soft_cap

    config = NAMED_SHAPES["gemma2-2b"]
    with pytest.raises(ValueError, match=r"^The gemma2 model caps .* pallas_tpu_interpret kernel"):
        refuse_soft_cap(config, "pallas_tpu_interpret")
    refuse_soft_cap(config, "xla")  # the XLA path caps
    refuse_soft_cap(NAMED_SHAPES["gemma3-1b"], "pallas_tpu_interpret")  # no cap: the kernel runs


def test_layer_windows_survive_the_json_round_trip():
    from checkpoints.config_json import config_from_json, config_to_json

    for name in ("gemma3-1b", "gemma2-2b"):
        config = NAMED_SHAPES[name]
        back = config_from_json(config_to_json(config))
        assert back == config and hash(back) == hash(config)
    assert dataclasses.asdict(NAMED_SHAPES["gemma3-1b"])["local_rope"]["theta"] == 10000.0
