"""Which key transform an 8-bit KV pool should apply, simulated on stories260k (issue 43;
docs/benchmarks.md, "Quantized KV cache", stop 66; the design: jaxserve/models/kv_keys.py).

    PYTHONPATH=.:docs/history python docs/history/kv_keys_sim.py

transformers' own float32 forward of the embedded model (eager attention), with the keys and
values of every layer rounded as an 8-bit pool would round them (quantize, dequantize) after
RoPE, optionally centred / smoothed / rotated first (queries to match, so the attention weights
are unchanged): the mean |log p_q - log p_f| per token over quant_accuracy.py's 240-token
story. The centre and spreads come from a different story (CALIBRATION below), not the one
scored. The served configuration ("none", power-of-two scales) reproduces the engine's figures.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers
from quant_accuracy import TEXT
from transformers.models.llama import modeling_llama

from checkpoints import DEFAULT_MODEL_DIR
from jaxserve.models.kv_keys import hadamard

CALIBRATION = (
    "The little dog ran in the garden. He found a stick and brought it to his friend, a girl "
    "named Sue. Sue threw the stick far away and the dog ran to get it. They played all morning. "
    "Then it began to rain, so they went inside and sat by the fire. Sue gave the dog a bone and "
    "he was very happy. When the rain stopped, the sun came out and they saw a rainbow in the sky."
)
QMAX = {"int8": 127.0, "fp8": 448.0}


def rounded(x: torch.Tensor, fmt: str, pow2: bool) -> torch.Tensor:
    """x [..., D] through an 8-bit row: one scale per row (a power of two, or max / QMAX)."""
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    scale = amax / QMAX[fmt]
    if pow2:
        scale = 2.0 ** torch.ceil(torch.log2(scale))
    y = x / scale
    y = torch.round(y).clamp(-127, 127) if fmt == "int8" else y.to(torch.float8_e4m3fn).float()
    return y * scale


class Sim:
    """The model with its attention patched: `mode` says how keys and values are rounded."""

    def __init__(self):
        self.tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            DEFAULT_MODEL_DIR, dtype=torch.float32, attn_implementation="eager"
        )
        self.ids = torch.tensor([self.tok.encode(TEXT)])
        self.mode, self.keys = None, []
        self.orig = modeling_llama.eager_attention_forward
        modeling_llama.eager_attention_forward = self.attention
        self.base = self.logprobs()

    def attention(self, module, query, key, value, mask, scaling, dropout=0.0, **kw):
        m, layer = self.mode, module.layer_idx
        if m is None:
            self.keys.append(key[0].detach().clone())  # [Hkv, T, D]
        else:
            if m.get("center") is not None:
                key = key - m["center"][layer][None]
            if m.get("smooth") is not None:
                s = m["smooth"][layer][None]  # [1, Hkv, 1, D]
                key, query = key / s, query * s.repeat_interleave(query.shape[1] // s.shape[1], 1)
            if m.get("rotate"):
                h = torch.tensor(hadamard(key.shape[-1]))
                key, query = key @ h, query @ h
            key = rounded(key, m["fmt"], m["pow2"])
            value = rounded(value, m["fmt"], m["pow2"])
        return self.orig(module, query, key, value, mask, scaling, dropout, **kw)

    def logprobs(self, ids=None) -> np.ndarray:
        ids = self.ids if ids is None else ids
        with torch.no_grad():
            lp = torch.log_softmax(self.model(ids).logits[0, :-1].double(), -1)
        return lp.gather(-1, ids[0, 1:, None])[:, 0].numpy()

    def calibrate(self, text: str, alpha: float):
        """Per layer: the keys' mean [Hkv, 1, D] and their spread^alpha (geometric mean 1)."""
        self.mode, self.keys = None, []
        self.logprobs(torch.tensor([self.tok.encode(text)]))
        center = [k.mean(1, keepdim=True) for k in self.keys]
        smooth = []
        for k, c in zip(self.keys, center, strict=True):
            s = (k - c).std(1, keepdim=True) ** alpha
            smooth.append(s / torch.exp(torch.log(s).mean(-1, keepdim=True)))
        return center, smooth

    def error(self, **mode) -> float:
        self.mode = mode
        try:
            return float(np.abs(self.logprobs() - self.base).mean())
        finally:
            self.mode = None


def main() -> None:
    sim = Sim()
    center, _ = sim.calibrate(CALIBRATION, 1.0)
    _, smooth_half = sim.calibrate(CALIBRATION, 0.5)
    _, smooth_one = sim.calibrate(CALIBRATION, 1.0)
    rows = [
        ("as served before (power-of-two scales)", {}),
        ("Hadamard rotation only", {"rotate": True}),
        ("exact float scales", {"pow2": False}),
        ("Hadamard and exact float scales", {"rotate": True, "pow2": False}),
        ("centred", {"center": center}),
        ("centred, rotated", {"center": center, "rotate": True}),
        ("centred, smoothed (alpha 0.5)", {"center": center, "smooth": smooth_half}),
        (
            "centred, smoothed (alpha 1), rotated",
            {"center": center, "smooth": smooth_one, "rotate": True},
        ),
        ("centred, exact float scales", {"center": center, "pow2": False}),
    ]
    print(f"float NLL {-sim.base.mean():.4f} nats/token over {len(sim.base)} tokens")
    for label, mode in rows:
        got = [
            sim.error(
                fmt=f, pow2=mode.get("pow2", True), **{k: v for k, v in mode.items() if k != "pow2"}
            )
            for f in ("int8", "fp8")
        ]
        print(f"| {label} | {got[0]:.4f} | {got[1]:.4f} |")


if __name__ == "__main__":
    main()
