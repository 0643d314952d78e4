"""The stories260k model gives the same greedy tokens with the TPU kernel (interpret mode) as with
the reference, over prefill chunks, a mixed step and decode steps, from a pool that starts as NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoints
from jaxserve.models.attention import get_attention_fn
from jaxserve.models.kv_pool import KVPages, kv_lanes
from jaxserve.models.step_batch import SeqChunk, pack_chunks

PAGE_SIZE = 4
NUM_PAGES = 24
PAGES_PER_SEQ = 8  # 32 tokens per sequence at most
NUM_TOKENS, NUM_SEQS = 16, 2  # one bucket: the step compiles once per backend
NUM_STEPS = 20

PROMPTS = ([1, 403, 29, 88, 7], [1, 45, 300, 12, 9, 77, 3])
# Scattered, interleaved pages, so a kernel reading in page order instead of through the table
# fails.
PAGE_TABLES = ([9, 3, 14, 5, 20, 1, 11, 7], [2, 17, 8, 12, 4, 19, 6, 15])
FIRST_CHUNK = 4  # the second prompt is prefilled in two chunks, the second mixed with a decode


@pytest.fixture(scope="module")
def stories():
    return checkpoints.load_model()


def generate(stories, backend: str) -> tuple[list[list[int]], np.ndarray]:
    """Greedy tokens of both prompts and the last step's logits, scheduled by hand."""
    module = checkpoints.model_for(stories.config, stories.dtype, attention_backend=backend)

    @jax.jit
    def step(params, kv, batch):
        hidden, kv = module.apply({"params": params}, kv, batch)
        logits = module.apply({"params": params}, hidden[batch.logits_indices], method="logits")
        return jnp.argmax(logits, axis=-1), logits, kv

    c = stories.config
    shape = (c.num_layers, NUM_PAGES, PAGE_SIZE, kv_lanes(c))
    # NaN, not zeros: a slot read before it is written poisons the tokens.
    kv = KVPages(kv=jnp.full(shape, jnp.nan, stories.dtype))
    seqs = [list(p) for p in PROMPTS]
    done = [0, 0]  # tokens of each sequence already in the cache
    generated: list[list[int]] = [[], []]
    for i in range(NUM_STEPS):
        chunks, emits = [], []
        for s in range(2):
            end = len(seqs[s])
            if s == 1 and i == 0:
                end = FIRST_CHUNK
            chunks.append(SeqChunk(seqs[s][done[s] : end], done[s], PAGE_TABLES[s]))
            emits.append(end == len(seqs[s]))
            done[s] = end
        batch = pack_chunks(
            chunks,
            page_size=PAGE_SIZE,
            num_tokens=NUM_TOKENS,
            num_seqs=NUM_SEQS,
            pages_per_seq=PAGES_PER_SEQ,
            num_pages=NUM_PAGES,
        )
        tokens, logits, kv = step(stories.params, kv, batch)
        for s in range(2):
            if emits[s]:
                seqs[s].append(int(tokens[s]))
                generated[s].append(int(tokens[s]))
    return generated, np.asarray(logits)


def test_tpu_kernel_gives_the_reference_tokens(stories):
    want_tokens, want_logits = generate(stories, "reference")
    got_tokens, got_logits = generate(stories, "pallas_tpu_interpret")
    assert len(want_tokens[0]) == NUM_STEPS and len(want_tokens[1]) == NUM_STEPS - 1
    assert len(set(want_tokens[0])) > 1  # a real continuation, not one token repeated
    assert got_tokens == want_tokens
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-4, rtol=1e-4)


def test_backend_dispatch_on_the_cpu():
    from pallas_kernels.ragged_paged_attention import reference, xla_blocked

    assert jax.default_backend() == "cpu"
    assert get_attention_fn("auto") is xla_blocked.ragged_paged_attention
    assert get_attention_fn("reference") is reference.ragged_paged_attention
    for backend in ("pallas", "pallas_tpu", "pallas_gpu"):
        with pytest.raises(ValueError, match="interpret"):
            get_attention_fn(backend)
    with pytest.raises(ValueError, match="not one of"):
        get_attention_fn("flash")
    assert callable(get_attention_fn("pallas_gpu_interpret"))


def test_auto_is_the_xla_attention_on_a_gpu_until_a_gpu_kernel_has_run_on_one():
    """Issue 29, item 14: no GPU kernel has executed on a GPU, so `auto` there must not pick one;
    `pallas` opts in. A TPU target still gets its kernel, for its own chip."""
    from jaxserve import target
    from jaxserve.models.attention import resolve_backend
    from pallas_kernels.ragged_paged_attention import xla_blocked

    h200 = target.Target(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0")
    with target.use(h200):
        assert resolve_backend("auto") == "xla"
        assert get_attention_fn("auto") is xla_blocked.ragged_paged_attention
        assert resolve_backend("pallas") == "pallas_gpu"
    with target.use(target.Target(platform="tpu", device_kind="TPU v5 lite")):
        assert resolve_backend("auto") == "pallas_tpu"
        assert get_attention_fn("auto").keywords["chip"] == "TPU v5 lite"
