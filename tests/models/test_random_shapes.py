"""Named random-weight shapes: seeded determinism and parameter counts of the real shapes.

The big shapes are only traced (`abstract_params` uses `jax.eval_shape`); nothing of their size is
allocated. Their parameter counts are the published ones of the Hugging Face releases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoints
from checkpoints.config_json import abstract_params, stack_layers


def _leaves(params: dict) -> dict[str, np.ndarray]:
    """Leaves by path, in the stacked layout whichever layer loop the platform runs."""
    flat = jax.tree_util.tree_flatten_with_path(stack_layers(params))[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def test_same_seed_same_params_other_seed_other_params():
    a = checkpoints.load_model("llama-tiny", seed=0, dtype=jnp.float32)
    b = checkpoints.load_model("llama-tiny", seed=0, dtype=jnp.float32)
    c = checkpoints.load_model("llama-tiny", seed=1, dtype=jnp.float32)
    assert a.config == checkpoints.NAMED_SHAPES["llama-tiny"]
    assert a.tokenizer is None
    la, lb, lc = _leaves(a.params), _leaves(b.params), _leaves(c.params)
    assert la.keys() == lb.keys() == lc.keys()
    for name in la:
        np.testing.assert_array_equal(la[name], lb[name], err_msg=name)
        if "scale" in name or "bias" in name:  # norms are ones, biases zeros, whatever the seed
            np.testing.assert_array_equal(la[name], lc[name], err_msg=name)
        else:
            assert not np.any(la[name] == lc[name]), f"{name} did not change with the seed"
    emb = la["['embed_tokens']['embedding']"]
    assert emb.shape == (1024, 64)
    assert abs(emb.std() - 0.02) < 0.002  # N(0, 0.02), as Hugging Face initialises
    # The layers are drawn independently, not copies of one another.
    q = la["['layers']['self_attn']['qkv_proj']['kernel']"]
    assert q.shape[0] == 2 and not np.array_equal(q[0], q[1])


# Published counts: SmolLM2-135M 134,515,008; Llama-3.2-1B 1,235,814,400; Qwen3-0.6B 596,049,920
# (all with tied embeddings).
@pytest.mark.parametrize(
    ("name", "count"),
    [("smollm2-135m", 134_515_008), ("llama3.2-1b", 1_235_814_400), ("qwen3-0.6b", 596_049_920)],
)
def test_abstract_param_count(name, count):
    params = abstract_params(checkpoints.NAMED_SHAPES[name], jnp.bfloat16)
    leaves = jax.tree.leaves(params)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}
    assert sum(int(np.prod(leaf.shape)) for leaf in leaves) == count
    assert "lm_head" not in params  # tied


def test_llama31_8b_has_the_published_count_and_an_untied_head():
    """Llama-3.1-8B: 8,030,261,248 parameters, the head its own [4096, 128256] table."""
    params = abstract_params(checkpoints.NAMED_SHAPES["llama3.1-8b"], jnp.bfloat16)
    assert sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params)) == 8_030_261_248
    assert params["lm_head"]["kernel"].shape == (4096, 128256)
