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
    and of the mixtures of experts built on it (Qwen3-MoE, Mixtral: `moe`)."""

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

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)
