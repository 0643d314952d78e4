"""Hugging Face `config.json` -> `ModelConfig`, for the Llama-family architectures jaxserve runs."""

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
}


class UnsupportedModelError(ValueError):
    """The model folder holds an architecture or a feature jaxserve does not implement."""


def _rope_config(hf: Any) -> RopeConfig:
    # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in rope_theta/rope_scaling.
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
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


def model_config_from_hf(hf: Any, eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
    """Maps a transformers config object onto `ModelConfig`, refusing what we cannot run exactly."""
    architectures = list(getattr(hf, "architectures", None) or [])
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"Unsupported architecture {architectures or hf.model_type!r}: jaxserve runs "
            f"{sorted(SUPPORTED_ARCHITECTURES)}."
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={hf.hidden_act!r} is not supported (only silu).")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    attention_bias = bool(getattr(hf, "attention_bias", False))
    eos = set(eos_token_ids)
    hf_eos = getattr(hf, "eos_token_id", None)
    eos.update([hf_eos] if isinstance(hf_eos, int) else (hf_eos or []))
    return ModelConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        max_position_embeddings=hf.max_position_embeddings,
        rms_norm_eps=float(hf.rms_norm_eps),
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
