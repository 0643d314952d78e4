"""What an engine runs on, built from its config: the model placed on its mesh, and a runner whose
KV pool fits the devices' free memory.

Kept out of `Engine.__init__`, so that the engine reads as the loop it is, and so that anyone who
needs the runner alone (a benchmark of steps, a follower process) builds it the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from checkpoints import LoadedModel, load_model
from jaxserve.engine_config import EngineConfig
from jaxserve.models.config import ModelConfig
from jaxserve.models.kv_pool import kv_bytes_per_page, pages_that_fit
from jaxserve.models.sharding import ShardingPlan, make_mesh
from jaxserve.runtime.buckets import bucket_ladder
from jaxserve.runtime.model_runner import ModelRunner, RunnerConfig, enable_compilation_cache
from jaxserve.runtime.multihost import agree_min

DEFAULT_MAX_MODEL_LEN = 4096


def max_model_len_for(config: EngineConfig, model: ModelConfig) -> int:
    """The longest sequence served: the config's, else the model's context capped at 4096 (a
    longer default would size every request's page table, and the KV it may claim, for it)."""
    asked = config.max_model_len or min(model.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    return min(asked, model.max_position_embeddings)


def build_runner(
    config: EngineConfig,
    model: LoadedModel | None = None,
    runner_class: Callable[..., ModelRunner] = ModelRunner,
) -> ModelRunner:
    """Loads the model (unless given) onto the config's mesh and sizes the KV pool: the config's
    `num_pages`, else what fits `kv_cache_memory_fraction` of the devices' free memory, never more
    than `max_num_seqs` full-length sequences need. Every host of a multi-host mesh gets the same
    pool shape (the smallest fit among them). `runner_class` builds the runner from (model,
    RunnerConfig, ShardingPlan): the host benchmark's runner whose device call costs nothing."""
    if config.compilation_cache_dir:
        enable_compilation_cache(config.compilation_cache_dir)
    mesh = make_mesh(config.tensor_parallel, config.mesh_shape)
    model = model or load_model(config.model, dtype=config.dtype, seed=config.seed, mesh=mesh)
    sharding = ShardingPlan.create(mesh, model.config)
    # Params into their shardings (a no-op when loaded there) before free memory is measured.
    model = dataclasses.replace(model, params=sharding.place(model.params))
    max_model_len = max_model_len_for(config, model.config)
    pages_per_seq = math.ceil(max_model_len / config.page_size)
    # Each device holds 1 / kv_shards of every page.
    page_bytes = kv_bytes_per_page(model.config, config.page_size, model.dtype)
    fit = pages_that_fit(
        page_bytes // sharding.kv_shards,
        list(mesh.devices.flat),
        fraction=config.kv_cache_memory_fraction,
        fallback_gb=config.kv_cache_memory_gb,
    )
    num_pages = config.num_pages or min(config.max_num_seqs * pages_per_seq, agree_min(fit))
    return runner_class(
        model,
        RunnerConfig(
            num_pages=num_pages,
            page_size=config.page_size,
            max_model_len=max_model_len,
            token_buckets=config.token_buckets,
            seq_buckets=bucket_ladder(1, config.max_num_seqs, config.seq_bucket_factor),
            attention_backend=config.attention_backend,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
        ),
        sharding,
    )
