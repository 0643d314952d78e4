"""The sharding rules, the mesh, the KV budget and the multi-host message format, without
compiling a model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from checkpoints import NAMED_SHAPES
from checkpoints.config_json import abstract_params, unstack_layers
from jaxserve.engine_config import EngineConfig
from jaxserve.models.kv_pool import pages_that_fit
from jaxserve.models.sharding import (
    KV_AXIS,
    MODEL,
    ShardingPlan,
    kv_split,
    make_mesh,
    parse_mesh_shape,
)
from jaxserve.models.step_batch import SeqChunk, pack_chunks
from jaxserve.runtime.multihost import StepLink
from jaxserve.runtime.sampling import SamplingBatch

LLAMA = NAMED_SHAPES["llama-tiny"].replace(
    num_heads=8, num_kv_heads=4, qkv_bias=True, o_bias=True, mlp_bias=True
)


@pytest.mark.parametrize(
    ("tp", "kv_heads", "split"),
    [(1, 4, 1), (2, 4, 2), (4, 4, 4), (4, 8, 4), (4, 2, 2), (8, 1, 1), (4, 6, 1), (2, 6, 2)],
)
def test_kv_split(tp, kv_heads, split):
    assert kv_split(tp, kv_heads) == split


def _specs(config, tp: int) -> dict[str, P]:
    plan = ShardingPlan.create(make_mesh(tp), config)
    flat = jax.tree_util.tree_flatten_with_path(plan.params(abstract_params(config, jnp.float32)))
    return {"/".join(k.key for k in kp): s.spec for kp, s in flat[0]}


def test_megatron_split_of_every_param():
    specs = _specs(LLAMA, 4)
    row = P(None, MODEL, None)
    assert specs == {
        "embed_tokens/embedding": P(MODEL, None),
        "lm_head/kernel": P(None, MODEL),
        "norm/scale": P(),
        "layers/input_layernorm/scale": P(),
        "layers/post_attention_layernorm/scale": P(),
        # [layers, hidden, kv heads, group + 2, head_dim]: whole KV heads with their q groups.
        "layers/self_attn/qkv_proj/kernel": P(None, None, KV_AXIS, None, None),
        "layers/self_attn/qkv_proj/bias": P(None, KV_AXIS, None, None),
        "layers/self_attn/o_proj/kernel": row,
        "layers/self_attn/o_proj/bias": P(),
        # [layers, hidden, 2, intermediate]: gate and up split alike, by intermediate column.
        "layers/mlp/gate_up_proj/kernel": P(None, None, None, MODEL),
        "layers/mlp/gate_up_proj/bias": P(None, None, MODEL),
        "layers/mlp/down_proj/kernel": row,
        "layers/mlp/down_proj/bias": P(),
    }
    assert set(_specs(LLAMA, 1).values()) == {P()}


def test_unrolled_layers_split_like_stacked_ones():
    """One layer of the unrolled layout ("layers_1/...") is split like the stacked param, less
    its leading layer axis."""
    plan = ShardingPlan.create(make_mesh(4), LLAMA)
    stacked = _specs(LLAMA, 4)
    unrolled = plan.params(unstack_layers(abstract_params(LLAMA, jnp.float32)))
    flat = jax.tree_util.tree_flatten_with_path(unrolled)[0]
    got = {"/".join(k.key for k in kp): s.spec for kp, s in flat}
    per_layer = sum(name.startswith("layers/") for name in stacked)
    assert len(got) == len(stacked) + (LLAMA.num_layers - 1) * per_layer
    for name, spec in got.items():
        if name.startswith("layers_"):
            assert spec == P(*stacked["layers/" + name.split("/", 1)[1]][1:]), name


def test_every_named_shape_has_a_rule_for_every_param():
    for config in NAMED_SHAPES.values():  # qwen3: q/k norms; tied embeddings; odd head counts
        assert _specs(config, 4)


def test_sizes_that_do_not_divide_are_replicated():
    odd = LLAMA.replace(vocab_size=1001, intermediate_size=170, num_heads=6, num_kv_heads=6)
    specs = _specs(odd, 4)
    for name in ("embed_tokens/embedding", "lm_head/kernel", "layers/mlp/down_proj/kernel"):
        assert specs[name] == P(), name
    assert specs["layers/self_attn/qkv_proj/kernel"] == P()
    plan = ShardingPlan.create(make_mesh(4), odd)
    assert plan.kv_shards == 1 and not plan.attention_is_local


def test_an_unknown_param_fails_loudly():
    plan = ShardingPlan.create(make_mesh(2), LLAMA)
    with pytest.raises(ValueError, match="No sharding rule for param 'layers/mlp/new_proj/kernel'"):
        plan.param_spec("layers/mlp/new_proj/kernel", 3)


def test_mesh_shapes_and_their_errors():
    assert make_mesh(4).devices.shape == (1, 4)
    assert make_mesh(mesh_shape=(1, 2)).devices.shape == (1, 2)
    assert parse_mesh_shape("1x4") == parse_mesh_shape("1,4") == (1, 4)
    with pytest.raises(ValueError, match="DATAxMODEL"):
        parse_mesh_shape("4")
    with pytest.raises(ValueError, match="needs 8 devices but JAX sees 4"):
        make_mesh(8)
    with pytest.raises(ValueError, match="data axis of 2 is not supported"):
        make_mesh(mesh_shape=(2, 2))
    with pytest.raises(ValueError, match="tensor_parallel=0 must be >= 1"):
        EngineConfig(tensor_parallel=0)
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction=1\.5"):
        EngineConfig(kv_cache_memory_fraction=1.5)


@dataclasses.dataclass
class _FakeDevice:
    stats: dict | None
    process_index: int = 0

    def memory_stats(self):
        return self.stats


def test_kv_budget_from_free_memory_or_the_fallback():
    gib = 2**30
    devices = [
        _FakeDevice({"bytes_limit": 10 * gib, "bytes_in_use": 2 * gib}),
        _FakeDevice({"bytes_limit": 10 * gib, "bytes_in_use": 4 * gib}),  # the tightest
    ]
    # 90% of the least free memory (6 GiB), in pages of 1 MiB per device.
    assert pages_that_fit(2**20, devices, fraction=0.9, fallback_gb=1.0) == int(0.9 * 6 * 1024)
    cpu = [_FakeDevice(None), _FakeDevice(None)]
    assert pages_that_fit(2**20, cpu, fraction=0.9, fallback_gb=0.5) == 512
    assert pages_that_fit(2**20, jax.devices(), fraction=0.9, fallback_gb=0.25) == 256  # CPU


class _FakeStore:
    """jax.distributed's key-value store, in one process: what StepLink calls of it."""

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def key_value_set_bytes(self, key: str, value: bytes, allow_overwrite: bool = False):
        assert allow_overwrite or key not in self.values, key
        self.values[key] = value

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        if key not in self.values:  # not a timeout, which StepLink waits out: fail at once
            raise RuntimeError(f"No message {key} in the fake store.")
        return self.values[key]

    def key_value_delete(self, key: str):
        self.values.pop(key, None)


def test_step_link_message_round_trip(monkeypatch):
    """What process 0 sends is what a follower decodes, every field and dtype, in any bucket;
    old messages leave the store as new ones come."""
    store = _FakeStore()
    monkeypatch.setattr(StepLink, "_store", staticmethod(lambda: store))
    leader = StepLink(page_size=4, pages_per_seq=3, num_pages=10, max_tokens=16, max_seqs=4)
    follower = StepLink(page_size=4, pages_per_seq=3, num_pages=10, max_tokens=16, max_seqs=4)
    follower._prefix = leader._prefix  # the same link in another process
    batch = pack_chunks(
        [SeqChunk([5, 6, 7], 0, [2]), SeqChunk([9], 4, [3, 7])],
        page_size=4,
        num_tokens=8,
        num_seqs=2,
        pages_per_seq=3,
        num_pages=10,
    )
    sampling = dataclasses.replace(
        SamplingBatch.empty(2),
        temperature=np.array([0.0, 0.7], np.float32),
        seeds=np.array([1, 2**32 - 1], np.uint32),
        want_top_logprobs=np.bool_(True),
    )
    for _ in range(StepLink.KEEP + 2):
        leader.send(batch, sampling)
        got_batch, got_sampling = follower.receive()
        for want, got in zip(
            jax.tree.leaves((batch, sampling)),
            jax.tree.leaves((got_batch, got_sampling)),
            strict=True,
        ):
            want, got = np.asarray(want), np.asarray(got)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
    assert len(store.values) == StepLink.KEEP
    leader.stop()
    assert follower.receive() is None  # the stop message ends a follower's loop
