"""Colocation with a trainer (docs/rl.md): an engine built on a given device list or on a
trainer's jax.sharding.Mesh places its params and KV pool there and nowhere else, and its pool
stays within the memory it was given; on 4 simulated CPU devices (conftest.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.runtime import compiles
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import SMALL

# One token bucket: one compiled step per engine.
CONFIG = {**SMALL, "min_token_bucket": 64, "max_model_len": 256}
PROMPT = list(range(1, 30))
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def devices_of(tree) -> set:
    return {d for leaf in jax.tree.leaves(tree) for d in leaf.sharding.device_set}


def per_device_bytes(array) -> dict:
    """Bytes of `array` on each device (its addressable shards)."""
    out: dict = {}
    for shard in array.addressable_shards:
        out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


@pytest.fixture(scope="module")
def reference() -> list[int]:
    """Greedy tokens of an engine on the default mesh (the first device)."""
    return LLM(EngineConfig(**CONFIG)).generate([PROMPT], GREEDY)[0].token_ids


def test_an_engine_on_one_given_device_lives_there_only(reference):
    device = jax.devices()[1]
    llm = LLM(EngineConfig(**CONFIG), devices=[device])
    runner = llm.engine.runner
    assert devices_of(runner.params) == {device}
    assert devices_of(runner.kv) == {device}
    mark = compiles.serving()
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == reference
    # New weights land on that device too (placed like the old), with no compile.
    llm.update_weights(jax.device_get(runner.params))
    assert devices_of(llm.engine.runner.params) == {device}
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == reference
    assert compiles.serving() - mark == 0, compiles.recent()


def test_an_engine_on_a_trainers_mesh_shards_over_its_devices(reference):
    chips = jax.devices()[2:4]
    trainer_mesh = Mesh(np.asarray(chips), ("fsdp",))  # a trainer's axes, not jaxserve's
    llm = LLM(EngineConfig(**CONFIG), mesh=trainer_mesh)
    runner = llm.engine.runner
    assert runner.sharding.tensor_parallel == 2
    assert devices_of(runner.params) == set(chips)
    assert devices_of(runner.kv) == set(chips)
    # Split, not replicated: each chip holds half the pool's lanes and half the projections.
    kv = runner.kv.kv  # [layers, pages, page_size, lanes]
    assert {s.data.shape[3] for s in kv.addressable_shards} == {kv.shape[3] // 2}
    qkv = runner.params["layers_0" if "layers_0" in runner.params else "layers"]["self_attn"]
    assert not qkv["qkv_proj"]["kernel"].sharding.is_fully_replicated
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == reference


def test_the_pool_stays_within_the_memory_given():
    """Where JAX reports no device memory (the CPU) the per-device budget is kv_cache_memory_gb;
    on an accelerator it is kv_cache_memory_fraction of the memory free once the trainer's
    arrays and the params are placed (pages_that_fit), the same code below that number."""
    chips = jax.devices()[2:4]
    sizes = {}
    for gb in (0.0005, 0.001):
        llm = LLM(EngineConfig(**CONFIG, kv_cache_memory_gb=gb), devices=chips)
        config = llm.engine.runner.config
        cap = CONFIG["max_num_seqs"] * -(-CONFIG["max_model_len"] // config.page_size)
        assert config.num_pages < cap  # the budget, not the cap, sized it
        used = per_device_bytes(llm.engine.runner.kv.kv)
        assert set(used) == set(chips)
        budget = gb * 2**30
        page = max(used.values()) / config.num_pages
        for nbytes in used.values():
            assert budget - page < nbytes <= budget  # as many whole pages as fit
        sizes[gb] = config.num_pages
        del llm
    assert sizes[0.001] >= 2 * sizes[0.0005] - 1


def test_devices_and_mesh_are_exclusive():
    with pytest.raises(ValueError, match="either devices or a mesh"):
        LLM(
            EngineConfig(**CONFIG),
            devices=jax.devices()[:1],
            mesh=Mesh(np.asarray(jax.devices()[:1]), ("x",)),
        )
    with pytest.raises(ValueError, match="tensor_parallel=4"):
        LLM(EngineConfig(**CONFIG, tensor_parallel=4), devices=jax.devices()[:2])
