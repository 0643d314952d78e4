"""The engine under tensor parallel = 2: the engine tests' greedy parity with transformers and
zero compiles after warm-up, run unchanged on a split stories260k."""

from __future__ import annotations

import pytest

from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from tests.engine import test_engine as engine_tests
from tests.engine.conftest import SMALL


@pytest.fixture(scope="module")
def tp2_engine() -> Engine:
    # One token bucket (64) x three seq buckets: fewer compiles than SMALL's nine, same workload.
    return Engine(EngineConfig(**{**SMALL, "min_token_bucket": 64}, tensor_parallel=2))


def test_the_model_and_pool_are_split(tp2_engine):
    runner = tp2_engine.runner
    assert runner.sharding.tensor_parallel == 2 and runner.sharding.kv_shards == 2
    kv = runner.kv.kv  # [layers, pages, page_size, lanes]: lanes of 2 of the 4 KV heads each
    head_dim = tp2_engine.model.config.head_dim
    assert {s.data.shape[3] for s in kv.addressable_shards} == {2 * 2 * head_dim}
    assert len({s.device for s in kv.addressable_shards}) == 2


def test_greedy_matches_transformers_generate(tp2_engine):
    engine_tests.test_greedy_matches_transformers_generate(tp2_engine)


def test_mixed_workload_never_compiles_after_warmup(tp2_engine):
    engine_tests.test_mixed_workload_never_compiles_after_warmup(tp2_engine)
