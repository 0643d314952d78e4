"""Random-weight models of real shapes, for benchmarks (like vLLM's dummy load format).

Weights are drawn N(0, 0.02) as Hugging Face initialises these models, norms are ones and biases
zeros, deterministically from a seed, directly on the device: no file is read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.models.config import ModelConfig, MoeConfig, RopeConfig

NAMED_SHAPES: dict[str, ModelConfig] = {
    "llama-tiny": ModelConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=176,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        eos_token_ids=(2,),
        bos_token_id=1,
        architecture="llama",
    ),
    "qwen3-tiny": ModelConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=176,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1e6),
        qk_norm=True,
        tie_word_embeddings=True,
        eos_token_ids=(2,),
        bos_token_id=1,
        architecture="qwen3",
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=100000.0),
        tie_word_embeddings=True,
        eos_token_ids=(0,),
        bos_token_id=0,
        architecture="llama",
    ),
    "llama3.2-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope=RopeConfig(
            theta=500000.0,
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        tie_word_embeddings=True,
        eos_token_ids=(128001, 128008, 128009),
        bos_token_id=128000,
        architecture="llama",
    ),
    # Llama-3.1-8B's shape: 16 GB in bfloat16, more than a v5e chip holds; 8.5 GB with int8
    # decoder weights (`jaxserve compile --target v5e:1x1 --quantization int8`, issue 43).
    "llama3.1-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope=RopeConfig(
            theta=500000.0,
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        tie_word_embeddings=False,
        eos_token_ids=(128001, 128008, 128009),
        bos_token_id=128000,
        architecture="llama",
    ),
    "qwen3-0.6b": ModelConfig(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1000000.0),
        qk_norm=True,
        tie_word_embeddings=True,
        eos_token_ids=(151643, 151645),
        bos_token_id=None,
        architecture="qwen3",
    ),
}


# Mixtures of experts. qwen3-moe-tiny-dense has qwen3-moe-tiny's active parameters (a dense MLP as
# wide as its top_k experts together), the dense model to measure the experts against.
_QWEN3_MOE_TINY = ModelConfig(  # ../shared/peers' tiny, its MLP as 8 experts of a half each
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope=RopeConfig(theta=1e6),
    qk_norm=True,
    eos_token_ids=(2,),
    bos_token_id=1,
    architecture="qwen3_moe",
    moe=MoeConfig(num_experts=8, top_k=2, intermediate_size=384),
)
NAMED_SHAPES["qwen3-moe-tiny"] = _QWEN3_MOE_TINY
NAMED_SHAPES["qwen3-moe-tiny-dense"] = _QWEN3_MOE_TINY.replace(moe=None, architecture="qwen3")
NAMED_SHAPES["mixtral-tiny"] = ModelConfig(
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope=RopeConfig(theta=1e6),
    eos_token_ids=(2,),
    bos_token_id=1,
    architecture="mixtral",
    moe=MoeConfig(num_experts=8, top_k=2, intermediate_size=128),
)
# Qwen3-30B-A3B's shape (random weights): 128 experts of width 768, 8 a token, in 48 layers.
NAMED_SHAPES["qwen3-30b-a3b"] = ModelConfig(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope=RopeConfig(theta=1000000.0),
    qk_norm=True,
    eos_token_ids=(151643, 151645),
    bos_token_id=None,
    architecture="qwen3_moe",
    moe=MoeConfig(num_experts=128, top_k=8, intermediate_size=768),
)


# Gemma (issue 46). gemma3-1b is google/gemma-3-1b-pt's shape: 5 sliding layers (window 512,
# RoPE base 10k) to each global one (base 1M), the 262k vocabulary, one KV head of 256.
NAMED_SHAPES["gemma3-1b"] = ModelConfig(
    vocab_size=262144,
    hidden_size=1152,
    intermediate_size=6912,
    num_layers=26,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope=RopeConfig(theta=1000000.0),
    local_rope=RopeConfig(theta=10000.0),
    layer_types=tuple(
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)
    ),
    sliding_window=512,
    query_pre_attn_scalar=256.0,
    hidden_act="gelu_pytorch_tanh",
    gemma_norms=True,
    qk_norm=True,
    tie_word_embeddings=True,
    eos_token_ids=(1, 106),  # <eos>, <end_of_turn>
    bos_token_id=2,
    architecture="gemma3",
)
# google/gemma-2-2b's shape: sliding (4096) and global layers alternating, both RoPE base 10k,
# attention logits capped at 50 and final logits at 30.
NAMED_SHAPES["gemma2-2b"] = ModelConfig(
    vocab_size=256000,
    hidden_size=2304,
    intermediate_size=9216,
    num_layers=26,
    num_heads=8,
    num_kv_heads=4,
    head_dim=256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    rope=RopeConfig(theta=10000.0),
    layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(26)),
    sliding_window=4096,
    query_pre_attn_scalar=256.0,
    attn_logit_softcap=50.0,
    final_logit_softcap=30.0,
    hidden_act="gelu_pytorch_tanh",
    gemma_norms=True,
    tie_word_embeddings=True,
    eos_token_ids=(1,),
    bos_token_id=2,
    architecture="gemma2",
)


def random_params(abstract_params: dict, seed: int, shardings: dict | None = None) -> dict:
    """Fills a param tree of `jax.ShapeDtypeStruct`s with seeded random weights.

    With `shardings` (a like-shaped tree) each device draws only its own shard; the values do not
    depend on the sharding (JAX's partitionable threefry), so a split model equals the whole one.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    names = tuple(str(getattr(path[-1], "key", path[-1])) for path, _ in leaves)
    shapes = tuple((a.shape, jnp.dtype(a.dtype)) for _, a in leaves)
    if shardings is None:
        values = _draw(seed, names, shapes)
    else:
        out_shardings = treedef.flatten_up_to(shardings)
        draw = jax.jit(_draw_impl, static_argnums=(1, 2), out_shardings=out_shardings)
        values = draw(seed, names, shapes)
    return jax.tree_util.tree_unflatten(treedef, values)


def _draw_impl(seed, names, shapes):
    keys = jax.random.split(jax.random.key(seed), len(names))
    out = []
    for key, name, (shape, dtype) in zip(keys, names, shapes, strict=True):
        if name == "scale":
            out.append(jnp.ones(shape, dtype))
        elif name == "bias":
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
    return out


_draw = jax.jit(_draw_impl, static_argnums=(1, 2))
