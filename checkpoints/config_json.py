"""Model configs to and from JSON, and (re-exported from `jaxserve.models.loaded`, where they live
beside the model) what loaders return and fill."""

from __future__ import annotations

import dataclasses

from jaxserve.models.config import ModelConfig, MoeConfig, RopeConfig
from jaxserve.models.loaded import (
    LoadedModel,
    abstract_params,
    is_unstacked,
    layer_loop_of,
    model_for,
    stack_layers,
    unstack_layers,
)

__all__ = [
    "LoadedModel",
    "abstract_params",
    "config_from_json",
    "config_to_json",
    "is_unstacked",
    "layer_loop_of",
    "model_for",
    "stack_layers",
    "unstack_layers",
]


def config_to_json(config: ModelConfig) -> dict:
    """`config` as plain JSON data (what orbax checkpoints store beside the params)."""
    return dataclasses.asdict(config)


def config_from_json(data: dict) -> ModelConfig:
    """The `ModelConfig` of `config_to_json`'s data (older checkpoints lack the newer keys)."""
    data = dict(data)
    data["rope"] = RopeConfig(**data["rope"])
    data["eos_token_ids"] = tuple(data["eos_token_ids"])
    if data.get("layer_types") is not None:  # JSON lists back to the hashable tuple
        data["layer_types"] = tuple(data["layer_types"])
    if data.get("local_rope") is not None:
        data["local_rope"] = RopeConfig(**data["local_rope"])
    if data.get("moe") is not None:  # absent in configs written before the experts
        data["moe"] = MoeConfig(**data["moe"])
    return ModelConfig(**data)
