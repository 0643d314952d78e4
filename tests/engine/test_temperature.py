"""Temperature itself: seeded draws from fixed logits follow softmax(logits / T).

Every other sampling test runs at T=1 or compares two paths that would both be wrong together;
here 4,000 rows, each with its own seed, sample once from the same logits, and every token's
count must fall within binomial bounds of N * softmax(logits / T). At T=0.5 and T=2 the bounds
(five standard deviations) are far narrower than the gap to softmax(logits), so a sampler that
ignored T (or applied it twice) fails. Both the whole-vocabulary draw (plain temperature) and
the candidate draw (a top-k that keeps everything) are checked.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.runtime.sampling import SamplingBatch, sample

N = 4000
# 16 tokens, distinct logits with a clear maximum, in a shuffled order (the argmax is not row 0).
LOGITS = np.array(
    [0.3, 2.1, -1.0, 1.2, 0.0, 2.5, -0.5, 1.8, 0.9, -2.0, 1.5, 0.6, -0.2, 2.2, 0.1, 1.0],
    np.float32,
)  # f32[16]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@jax.jit
def _sample(logits, params):
    return sample(logits, params).token_ids


def _draw(temperature: float, top_k: int = 0) -> np.ndarray:
    """Token counts (i64[16]) of N rows drawn at `temperature`, seeds 0..N-1."""
    params = dataclasses.replace(
        SamplingBatch.empty(N),
        temperature=np.full(N, temperature, np.float32),
        top_k=np.full(N, top_k, np.int32),
        seeds=np.arange(N, dtype=np.uint32),
        positions=np.full(N, 7, np.int32),
    )
    tokens = np.asarray(_sample(np.tile(LOGITS, (N, 1)), params))
    return np.bincount(tokens, minlength=len(LOGITS))


@pytest.mark.parametrize("top_k", [0, len(LOGITS)], ids=["whole-vocab", "candidates"])
@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_draws_follow_softmax_of_logits_over_temperature(temperature, top_k):
    counts = _draw(temperature, top_k)
    p = _softmax(LOGITS / temperature)
    bound = 5 * np.sqrt(N * p * (1 - p)) + 1
    assert np.all(np.abs(counts - N * p) <= bound), (counts, np.round(N * p))
    # The bounds are tight enough to tell this temperature from T=1.
    p1 = _softmax(LOGITS)
    assert np.any(np.abs(N * p1 - N * p) > 2 * bound)


@pytest.mark.parametrize("top_k", [0, len(LOGITS)], ids=["whole-vocab", "candidates"])
def test_tiny_temperature_always_gives_the_argmax(top_k):
    counts = _draw(1e-3, top_k)
    assert counts[np.argmax(LOGITS)] == N, counts
