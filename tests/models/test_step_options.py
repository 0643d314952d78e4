"""Per-bucket XLA options of the step: which buckets get them, and that they change no result."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints import NAMED_SHAPES
from jaxserve.models.kv_pool import init_kv_pages
from jaxserve.models.llama import step_compiler_options
from jaxserve.models.loaded import abstract_params, model_for
from jaxserve.models.step_batch import SeqChunk, pack_chunks


def test_only_cpu_buckets_of_8_to_32_tokens_turn_ynn_fusions_off():
    off = {"xla_cpu_experimental_ynn_fusion_type": ""}
    assert [n for n in (1, 2, 4, 8, 16, 32, 64, 128) if step_compiler_options(n, "cpu")] == [
        8,
        16,
        32,
    ]
    assert step_compiler_options(16, "cpu") == off
    assert step_compiler_options(16, "gpu") == {} and step_compiler_options(16, "tpu") == {}


def test_a_step_compiled_without_ynn_fusions_gives_the_same_hidden_states():
    config = NAMED_SHAPES["llama-tiny"]
    module = model_for(config, jnp.float32)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda a: jnp.asarray(rng.standard_normal(a.shape) * 0.1, a.dtype),
        abstract_params(config, jnp.float32, "auto"),
    )
    kv = init_kv_pages(config, num_pages=8, page_size=4, dtype=jnp.float32)
    # A 16-token bucket: a prefill chunk of 11 tokens beside a decode row at context 6.
    chunks = [SeqChunk(list(range(3, 14)), 0, [1, 2, 3]), SeqChunk([7], 5, [4, 5])]
    batch = pack_chunks(
        chunks, page_size=4, num_tokens=16, num_seqs=16, pages_per_seq=4, num_pages=8
    )

    def forward(params, kv, batch):
        hidden, _ = module.apply({"params": params}, kv, batch)
        return hidden

    options = step_compiler_options(16, "cpu")
    default = jax.jit(forward)(params, kv, batch)
    off = jax.jit(forward, compiler_options=options)(params, kv, batch)
    assert np.all(np.isfinite(default[:12]))
    np.testing.assert_allclose(off[:12], default[:12], rtol=1e-5, atol=1e-5)
