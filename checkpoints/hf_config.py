"""Hugging Face `config.json` -> `ModelConfig`, for the Llama-family and Gemma architectures
jaxserve runs."""

from __future__ import annotations

from typing import Any

from jaxserve.models.config import ModelConfig, MoeConfig, RopeConfig

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    # Gemma 3's multimodal folders: the text model nested as `text_config` (its vision tower
    # and projector are not served; checkpoints/weights.py skips their tensors).
    "Gemma3ForConditionalGeneration": "gemma3",
}
GEMMA_FAMILIES = ("gemma2", "gemma3")


class UnsupportedModelError(ValueError):
    """The model folder holds an architecture or a feature jaxserve does not implement."""


def _rope_config(hf: Any, params: dict | None = None) -> RopeConfig:
    """The RoPE of `hf` (or of one layer type's `params`, Gemma 3's per-type dicts)."""
    # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in rope_theta/rope_scaling.
    if params is None:
        params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    if rope_type not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(f"RoPE scaling type {rope_type!r} is not supported.")
    kwargs = {"theta": float(theta), "rope_type": rope_type}
    if rope_type != "default":
        kwargs["factor"] = float(params["factor"])
    if rope_type == "llama3":
        kwargs.update(
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    return RopeConfig(**kwargs)


def _moe_config(hf: Any, family: str) -> MoeConfig | None:
    """The experts of a Qwen3-MoE or Mixtral config (None for the dense families)."""
    if family == "mixtral":
        return MoeConfig(
            num_experts=int(hf.num_local_experts),
            top_k=int(hf.num_experts_per_tok),
            intermediate_size=int(hf.intermediate_size),
            normalization="softmax_topk_renorm",  # Mixtral always renormalises its top k
        )
    if family != "qwen3_moe":
        return None
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", 0)
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    only = sorted(getattr(hf, "mlp_only_layers", None) or ())
    # transformers' Qwen3MoeDecoderLayer keeps a dense MLP where the layer is listed in
    # mlp_only_layers or (layer + 1) is not a multiple of decoder_sparse_step.
    if not experts or step != 1 or only:
        raise UnsupportedModelError(
            f"Qwen3MoeForCausalLM with dense layers (num_experts={experts}, decoder_sparse_step="
            f"{step}, mlp_only_layers={only}) is not supported: jaxserve runs mixtures of experts "
            "whose every layer has experts (as every released Qwen3-MoE)."
        )
    return MoeConfig(
        num_experts=int(experts),
        top_k=int(hf.num_experts_per_tok),
        intermediate_size=int(hf.moe_intermediate_size),
        normalization="softmax_topk_renorm" if hf.norm_topk_prob else "softmax_topk",
    )


def _sliding_window(hf: Any, family: str) -> int | None:
    if family in ("mistral", "mixtral"):
        return getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", False):
        raise UnsupportedModelError(
            f"{family} with use_sliding_window=True (per-layer windows) is not supported."
        )
    return None


def _gemma_fields(hf: Any, family: str) -> dict:
    """The `ModelConfig` fields of a Gemma 2 or 3 text config, refusing what we cannot run."""
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModelError(
            f"{family} with hidden_activation={act!r} is not supported: jaxserve runs Gemma's "
            "GeGLU with gelu_pytorch_tanh only."
        )
    if getattr(hf, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{family} with use_bidirectional_attention=True (an encoder, as EmbeddingGemma) is "
            "not supported: jaxserve serves causal decoders."
        )
    layer_types = tuple(getattr(hf, "layer_types", None) or ())
    if set(layer_types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(
            f"{family} with layer_types {sorted(set(layer_types))} is not supported: jaxserve "
            "runs sliding_attention and full_attention layers."
        )
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if family == "gemma3" and "full_attention" in params:  # transformers 5: one dict per type
        rope = _rope_config(hf, params["full_attention"])
        local = _rope_config(hf, params.get("sliding_attention") or {"rope_theta": 10000.0})
    else:
        rope, local = _rope_config(hf), None
    if family == "gemma3" and local is None:  # transformers 4.x's flat fields
        local = RopeConfig(theta=float(getattr(hf, "rope_local_base_freq", 10000.0)))
    soft = {
        name: None if value is None else float(value)
        for name, value in (
            ("attn_logit_softcap", getattr(hf, "attn_logit_softcapping", None)),
            ("final_logit_softcap", getattr(hf, "final_logit_softcapping", None)),
        )
    }
    return dict(
        rope=rope,
        local_rope=local,
        layer_types=layer_types or None,
        query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
        hidden_act="gelu_pytorch_tanh",
        gemma_norms=True,
        sliding_window=getattr(hf, "sliding_window", None)
        if "sliding_attention" in layer_types
        else None,
        **soft,
    )


def model_config_from_hf(hf: Any, eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
    """Maps a transformers config object onto `ModelConfig`, refusing what we cannot run exactly."""
    architectures = list(getattr(hf, "architectures", None) or [])
    if not architectures and getattr(hf, "model_type", None) in ("gemma2", "gemma3_text"):
        architectures = ["Gemma2ForCausalLM" if hf.model_type == "gemma2" else "Gemma3ForCausalLM"]
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"Unsupported architecture {architectures or hf.model_type!r}: jaxserve runs "
            f"{sorted(SUPPORTED_ARCHITECTURES)}."
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    if family in GEMMA_FAMILIES:
        return _gemma_config(hf, family, eos_token_ids)
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={hf.hidden_act!r} is not supported (only silu).")
    attention_bias = bool(getattr(hf, "attention_bias", False))
    eos = set(eos_token_ids)
    hf_eos = getattr(hf, "eos_token_id", None)
    eos.update([hf_eos] if isinstance(hf_eos, int) else (hf_eos or []))
    return ModelConfig(
        **_shape_fields(hf),
        rope=_rope_config(hf),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=attention_bias and family in ("llama", "qwen3", "qwen3_moe"),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        sliding_window=_sliding_window(hf, family),
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=tuple(sorted(eos)),
        architecture=family,
        moe=_moe_config(hf, family),
    )


def _shape_fields(hf: Any) -> dict[str, Any]:
    """The decoder's shape in `ModelConfig`'s names, read alike from every family's config."""
    return dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        max_position_embeddings=hf.max_position_embeddings,
        rms_norm_eps=float(hf.rms_norm_eps),
    )


def _gemma_config(hf: Any, family: str, eos_token_ids: tuple[int, ...]) -> ModelConfig:
    """A Gemma 2 or 3 config (a multimodal Gemma 3's `text_config`) as a `ModelConfig`."""
    outer = hf
    if getattr(hf, "text_config", None) is not None:
        hf = hf.text_config
    if getattr(hf, "attention_bias", False):
        raise UnsupportedModelError(
            f"{family} with attention_bias=True is not supported: no released Gemma has one."
        )
    eos = set(eos_token_ids)
    hf_eos = getattr(hf, "eos_token_id", None)
    if hf_eos is None:
        hf_eos = getattr(outer, "eos_token_id", None)
    eos.update([hf_eos] if isinstance(hf_eos, int) else (hf_eos or []))
    return ModelConfig(
        **_shape_fields(hf),
        # Gemma always ties its head to the embedding (a multimodal config says so outside).
        tie_word_embeddings=bool(
            getattr(outer, "tie_word_embeddings", getattr(hf, "tie_word_embeddings", True))
        ),
        qk_norm=family == "gemma3",
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=tuple(sorted(eos)),
        architecture=family,
        **_gemma_fields(hf, family),
    )
