"""Is fp8's accuracy miss on stories260k the format or our code? (issue 43; docs/benchmarks.md)

    python docs/history/quant_fp8_torch_check.py

transformers' own PyTorch forward of stories260k, float32, against the same model with every
decoder Linear's weight round-tripped through e4m3 (per output channel, scale = max|w| / 448,
torch's float8_e4m3fn cast: round to nearest even) and, for comparison, through int8 (max|w| /
127, round half to even): the mean |log p_q - log p_f| per token over quant_accuracy.py's story.
No jaxserve code runs, so if the figure matches what jaxserve measures, the loss is the format's.
"""

from __future__ import annotations

import pathlib
import sys

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from quant_accuracy import TEXT

FOLDER = pathlib.Path(__file__).parents[2] / ".." / "shared" / "models" / "stories260k"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def round_trip(w: torch.Tensor, kind: str) -> torch.Tensor:  # w: f32[out, in]
    """w through `kind` per output row (torch's [out, in]: a row is one output column)."""
    qmax = 448.0 if kind == "fp8" else 127.0
    scale = w.abs().amax(dim=1, keepdim=True) / qmax
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    if kind == "fp8":
        q = (w / scale).clamp(-qmax, qmax).to(torch.float8_e4m3fn).to(torch.float32)
    else:
        q = torch.round(w / scale).clamp(-qmax, qmax)
    return q * scale


def logprobs(model, ids: torch.Tensor) -> torch.Tensor:  # ids: i64[1, n] -> f32[n - 1]
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]


def main() -> None:
    tok = AutoTokenizer.from_pretrained(FOLDER)
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    base = LlamaForCausalLM.from_pretrained(FOLDER, torch_dtype=torch.float32).eval()
    want = logprobs(base, ids)
    for kind in ("int8", "fp8"):
        model = LlamaForCausalLM.from_pretrained(FOLDER, torch_dtype=torch.float32).eval()
        for name, module in model.named_modules():
            if name.split(".")[-1] in LINEARS:
                module.weight.data = round_trip(module.weight.data, kind)
        got = logprobs(model, ids)
        diff = (got - want).abs().mean().item()
        print(f"{kind}: mean |dlogp| {diff:.4f} nats/token over {ids.shape[1] - 1} tokens")


if __name__ == "__main__":
    main()
