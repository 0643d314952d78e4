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
    return dataclasses.asdict(config)


def config_from_json(data: dict) -> ModelConfig:
    data = dict(data)
    data["rope"] = RopeConfig(**data["rope"])
    data["eos_token_ids"] = tuple(data["eos_token_ids"])
    if data.get("moe") is not None:  # absent in configs written before the experts
        data["moe"] = MoeConfig(**data["moe"])
    return ModelConfig(**data)
