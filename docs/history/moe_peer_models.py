"""Hugging Face folders of a tiny Qwen3-MoE and its dense twin, for ../shared/peers (issue 42).

    python docs/history/moe_peer_models.py [--out ~/.cache/peers/models]

Writes <out>/moe-tiny (Qwen3MoeForCausalLM: jaxserve's qwen3-moe-tiny shape, 8 experts of width
384, 2 a token) and <out>/moe-dense (Qwen3ForCausalLM of the same shape with one MLP of width
768: the same active parameters a token), random weights N(0, 0.02) seeded, with the peers'
word-level tokenizer copied from <out>/tiny (make_models.py), so vLLM's CPU backend and jaxserve
serve the same folders in `run_vllm_side.sh` (SIZES="moe-tiny moe-dense").
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=1e6),
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
TOKENIZER = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
)


def main() -> None:
    import torch
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache/peers/models")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name, config in (
        (
            "moe-tiny",
            transformers.Qwen3MoeConfig(
                **SHAPE,
                intermediate_size=768,
                moe_intermediate_size=384,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=True,
            ),
        ),
        ("moe-dense", transformers.Qwen3Config(**SHAPE, intermediate_size=768)),
    ):
        torch.manual_seed(args.seed)
        config.initializer_range = 0.02
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
        folder = args.out / name
        model.save_pretrained(folder, safe_serialization=True)
        for file in TOKENIZER:
            if (args.out / "tiny" / file).exists():
                shutil.copy(args.out / "tiny" / file, folder / file)
        print(f"wrote {folder} ({sum(p.numel() for p in model.parameters()):,} parameters)")


if __name__ == "__main__":
    main()
