"""Shared engines for the engine tests: small bucket ladders so each compiles in seconds."""

from __future__ import annotations

import pytest

from jaxserve.engine import Engine
from jaxserve.engine_config import EngineConfig

# 3 token buckets x 3 seq buckets: every test in a module shares these compiled shapes.
SMALL = dict(
    max_num_seqs=16,
    max_num_batched_tokens=64,
    min_token_bucket=16,
    seq_bucket_factor=4,
    show_progress=False,
)


@pytest.fixture(scope="session")
def stories_engine() -> Engine:
    """The embedded stories260k model behind a small-bucket engine (compiled once per session)."""
    return Engine(EngineConfig(**SMALL))


def drain(engine: Engine, max_steps: int = 10_000) -> list:
    """Steps until the engine is idle; returns every output in order."""
    outputs = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        outputs += engine.step()
    raise AssertionError(f"the engine still had work after {max_steps} steps")
