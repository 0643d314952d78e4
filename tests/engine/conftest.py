"""Shared engines for the engine tests: small bucket ladders so each compiles in seconds."""

from __future__ import annotations

import pytest

from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig

# 3 token buckets x 3 seq buckets: every test in a module shares these compiled shapes.
SMALL = dict(
    max_num_seqs=16,
    max_num_batched_tokens=64,
    min_token_bucket=16,
    seq_bucket_factor=4,
    show_progress=False,
)


# 4 rows and a 16-token budget: a handful of long requests queue, chunk and contend for pages.
TINY = dict(
    max_num_seqs=4,
    max_num_batched_tokens=16,
    min_token_bucket=8,
    seq_bucket_factor=4,
    show_progress=False,
)


def short_of_pages(model) -> Engine:
    """An engine of `model` with pages for ~2.5 of 4 long requests: preemptions happen."""
    return Engine(EngineConfig(num_pages=10, page_size=16, **TINY), model=model)


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
