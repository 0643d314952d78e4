"""Frozen, validated model configuration.

A `ModelConfig` is hashable, so it can be a static argument of the jitted step: everything the
model's shapes depend on lives here, and nothing that varies per request does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding parameters, as Hugging Face's `rope_parameters` describe them."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type={self.rope_type!r} is not supported; use one of {SUPPORTED_ROPE_TYPES}."
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"RoPE needs theta > 0 and factor > 0: {self.theta=}, {self.factor=}.")

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies f32[head_dim // 2], with the llama3 or linear scaling applied."""
        inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        if self.rope_type == "linear":
            inv = inv / self.factor
        elif self.rope_type == "llama3":
            old_len = self.original_max_position_embeddings
            low_wavelen = old_len / self.low_freq_factor
            high_wavelen = old_len / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old_len / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        return inv.astype(np.float32)


ROUTER_NORMALIZATIONS = ("softmax_topk", "softmax_topk_renorm")
# A layer's attention kind, as transformers' `config.layer_types` names it (Gemma 2 and 3).
LAYER_TYPES = ("sliding_attention", "full_attention")
# The MLP's gate activation: SwiGLU (Llama family) or GeGLU with gelu's tanh approximation
# (Gemma's `gelu_pytorch_tanh`).
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """The mixture-of-experts MLP of Qwen3-MoE and Mixtral: each token's router picks `top_k` of
    `num_experts` experts (SwiGLU MLPs of width `intermediate_size`) and sums their outputs
    weighted by its router probabilities.

    `normalization` is the family's: "softmax_topk" keeps the top-k softmax probabilities as they
    are (Qwen3-MoE with norm_topk_prob false), "softmax_topk_renorm" divides them by their sum
    (Mixtral always, Qwen3-MoE with norm_topk_prob true). Every decoder layer runs experts: the
    scanned layer loop and the checkpoints' stacked layers need all layers alike, so Qwen3-MoE's
    dense layers (mlp_only_layers, decoder_sparse_step > 1; no released Qwen3-MoE has any) are
    refused at load (checkpoints/hf_config.py)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalization: str = "softmax_topk_renorm"

    def __post_init__(self):
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoeConfig.{name}={value!r} must be a positive integer.")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoeConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}: a token "
                "cannot be routed to more experts than there are."
            )
        if self.normalization not in ROUTER_NORMALIZATIONS:
            raise ValueError(
                f"MoeConfig.normalization={self.normalization!r} is not one of "
                f"{ROUTER_NORMALIZATIONS}."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and switches of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM),
    of the mixtures of experts built on it (Qwen3-MoE, Mixtral: `moe`), and of Gemma 2 and 3
    (`gemma_norms`, `layer_types`, `local_rope`, the soft caps, `query_pre_attn_scalar`).

    Per-layer attention (Gemma): `layer_types[i]` says whether layer i is "sliding_attention"
    (local: the last `sliding_window` positions, RoPE `local_rope` where set) or
    "full_attention" (global: every position, RoPE `rope`). None means every layer alike,
    windowed where `sliding_window` is set (Mistral). `layer_window` / `layer_rope` answer per
    layer; a config whose layers differ runs the unrolled layer loop (`layers_differ`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama when attention_bias is set
    o_bias: bool = False  # Llama's attention_bias also biases o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # Mistral: attend to the last `sliding_window` positions
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    moe: MoeConfig | None = None  # the experts that replace the MLP (None: a dense model)
    # Gemma 2 / 3 (see the class docstring; all off for the Llama family).
    layer_types: tuple[str, ...] | None = None  # per layer, one of LAYER_TYPES
    local_rope: RopeConfig | None = None  # RoPE of sliding layers (Gemma 3); None: `rope`
    query_pre_attn_scalar: float | None = None  # queries scaled by its **-0.5 (None: head_dim)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap), before masking
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    hidden_act: str = "silu"  # one of HIDDEN_ACTS
    # Gemma's block: RMSNorm scaled by (1 + w), norms before and after both the attention and
    # the MLP, embeddings multiplied by sqrt(hidden_size) in the compute dtype.
    gemma_norms: bool = False

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive integer.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}.")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings.")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 or None.")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not one of {HIDDEN_ACTS}.")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name}={value!r} must be positive or None.")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(
                LAYER_TYPES
            ):
                raise ValueError(
                    f"layer_types={self.layer_types!r} must name one of {LAYER_TYPES} for each "
                    f"of the {self.num_layers} layers."
                )
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but no sliding_window.")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def _is_local(self, layer: int | None) -> bool:
        """Whether `layer` (None: any layer of a config whose layers are alike) is windowed."""
        if self.layer_types is None:
            return self.sliding_window is not None
        return self.layer_types[layer or 0] == "sliding_attention"

    def layer_window(self, layer: int | None = None) -> int | None:
        """The sliding window of decoder layer `layer` (None: a full-attention layer)."""
        return self.sliding_window if self._is_local(layer) else None

    def layer_rope(self, layer: int | None = None) -> RopeConfig:
        """The RoPE of decoder layer `layer`: `local_rope` for a sliding layer where set."""
        if self.local_rope is not None and self._is_local(layer):
            return self.local_rope
        return self.rope

    @property
    def layers_differ(self) -> bool:
        """Whether layers differ in window or RoPE (Gemma): such a model runs unrolled."""
        kinds = {(self.layer_window(i), self.layer_rope(i)) for i in range(self.num_layers)}
        return len(kinds) > 1

    @property
    def sm_scale(self) -> float:
        """The attention's query scale: query_pre_attn_scalar**-0.5 where set, else
        head_dim**-0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)
