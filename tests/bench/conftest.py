"""A tiny-ladder stories260k engine shared by the bench tests (4 buckets, ~10 s to compile)."""

from __future__ import annotations

import pytest

from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig

TINY = dict(max_num_seqs=4, max_num_batched_tokens=16, min_token_bucket=8, seq_bucket_factor=4)


@pytest.fixture(scope="session")
def tiny_engine() -> Engine:
    return Engine(EngineConfig(max_model_len=128, show_progress=False, **TINY))
