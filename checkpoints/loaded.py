"""`LoadedModel`: what every loader returns, and the abstract param tree loaders fill."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.batch import SeqChunk, pack_chunks
from jaxserve.config import ModelConfig, RopeConfig
from jaxserve.kv_pages import KVPages
from jaxserve.models import LlamaForCausalLM


@dataclasses.dataclass
class LoadedModel:
    """A model ready to run: config, params on the device, tokenizer (None if random)."""

    config: ModelConfig
    params: dict  # the flax param tree (without the outer {"params": ...})
    tokenizer: Any | None
    dtype: jnp.dtype
    source: str  # where it came from, for logs and GetModelInfo


def model_for(config: ModelConfig, dtype=jnp.float32, attention_backend: str = "auto", plan=None):
    """The flax module of `config`; `plan` (a jaxserve.sharding.ShardingPlan) splits it."""
    return LlamaForCausalLM(config, attention_backend=attention_backend, dtype=dtype, plan=plan)


def abstract_params(config: ModelConfig, dtype) -> dict:
    """Shapes and dtypes of the param tree, traced without allocating any weights."""
    model = model_for(config, dtype)
    kv_shape = (config.num_layers, 1, 1, config.num_kv_heads, config.head_dim)
    kv = KVPages(k=jax.ShapeDtypeStruct(kv_shape, dtype), v=jax.ShapeDtypeStruct(kv_shape, dtype))
    batch = pack_chunks(
        [SeqChunk([0], 0, [0])], page_size=1, num_tokens=1, num_seqs=1, pages_per_seq=1, num_pages=1
    )
    variables = jax.eval_shape(
        lambda: model.init(jax.random.key(0), kv, batch, method=model.init_all)
    )
    return variables["params"]


def config_to_json(config: ModelConfig) -> dict:
    return dataclasses.asdict(config)


def config_from_json(data: dict) -> ModelConfig:
    data = dict(data)
    data["rope"] = RopeConfig(**data["rope"])
    data["eos_token_ids"] = tuple(data["eos_token_ids"])
    return ModelConfig(**data)
