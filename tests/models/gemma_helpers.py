"""Tiny random Gemma 2 and Gemma 3 models in transformers, for the Gemma tests (issue 46).

Both have windows (6) shorter than the test prompts, local and global layers mixed, query
scaling by a `query_pre_attn_scalar` that is not head_dim, and every weight redrawn so that a
dropped or mis-mapped tensor shows: the Gemma norms' w (applied as 1 + w) too. Gemma 2 caps
attention logits at 3 and final logits at 5, small enough that a missing cap moves the logits
by far more than the tolerance. Gemma 3 has q/k norms, RoPE base 100 on its local layers and
1e6 with linear scaling (factor 2) on its global ones, and no caps, so it runs the CPU's fused
attention call where that is built (head_dim 32), while Gemma 2's capped layers take the jnp path.
"""

from __future__ import annotations

import transformers

from tests.torch_reference import require_torch

GEMMA_FAMILIES = ("gemma2", "gemma3")

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    sliding_window=6,
    query_pre_attn_scalar=24,
    hidden_activation="gelu_pytorch_tanh",
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=True,
)
_FAMILY = {
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            layer_types=["sliding_attention", "full_attention"] * 2,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            rope_parameters={
                "sliding_attention": dict(rope_type="default", rope_theta=100.0),
                "full_attention": dict(rope_type="linear", rope_theta=1e6, factor=2.0),
            },
        ),
    ),
}


def build_gemma(family: str, *, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A tiny float32 transformers Gemma of `family` ("gemma2" | "gemma3"), eager attention,
    with every parameter randomly redrawn."""
    torch = require_torch()
    config_cls, model_cls, switches = _FAMILY[family]
    config = config_cls(**{**_COMMON, **switches, **overrides})
    config._attn_implementation = "eager"
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(0.3 * noise)  # Gemma applies 1 + w: w = 0 would hide a dropped norm
            elif name.endswith("embed_tokens.weight"):
                p.copy_(0.05 * noise)
            else:
                p.copy_(1.5 * noise * p.shape[-1] ** -0.5)
    return model
