"""Decode ms per step at batch 1 and 16 on smollm2-135m, float32 against the int8 schemes, in one
process, rounds interleaved (issue 43; docs/benchmarks.md, "Quantized weights").

    PYTHONPATH=. python docs/history/quant_cpu_ab.py none,int8,int8-w8a8 3
    PYTHONPATH=. python docs/history/quant_cpu_ab.py none,kv-int8,kv-fp8 2   # the KV cache

Three engines over the same random weights, each quantized at load as named; each round
generates 48 greedy tokens from 16-token random prompts at batch 1, then 16, on every engine in
turn. Reported: the best and the median of the rounds, and the speed-up of each over the first.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from checkpoints import load_model
from jaxserve.engine.build import build_engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams

BATCHES = (1, 16)
TOKENS = 48


def per_step_ms(llm: LLM, batch: int, rng, tokens: int = TOKENS) -> float:
    """Wall ms per generated token of one greedy batch (16-token prompts: decode dominates)."""
    prompts = [rng.integers(3, 49000, size=16).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params)
    return (time.perf_counter() - start) / tokens * 1e3


def main(schemes: list[str], rounds: int) -> None:
    model = load_model("smollm2-135m", dtype="float32")
    rng = np.random.default_rng(0)
    llms = {}
    for q in schemes:
        config = EngineConfig(
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=512,
            num_pages=16 * 8 + 8,
            # "kv-int8" / "kv-fp8": float weights, the KV cache in 8 bits (--kv-cache-dtype)
            quantization="none" if q.startswith("kv-") else q,
            kv_cache_dtype=q.removeprefix("kv-") if q.startswith("kv-") else "auto",
            show_progress=False,
        )
        llms[q] = LLM(engine=build_engine(config, model=model))
    for q in schemes:  # every bucket the rounds use, compiled
        for b in BATCHES:
            per_step_ms(llms[q], b, rng, 4)
    times = {(q, b): [] for q in schemes for b in BATCHES}
    for _ in range(rounds):
        for b in BATCHES:
            for q in schemes:
                times[(q, b)].append(per_step_ms(llms[q], b, rng))
    for b in BATCHES:
        base = min(times[(schemes[0], b)])
        for q in schemes:
            best, median = min(times[(q, b)]), np.median(times[(q, b)])
            print(
                f"batch {b:2d} {q:10s} best {best:6.2f} ms/step  median {median:6.2f}  "
                f"speed-up over {schemes[0]} {base / best:.2f}x"
            )


if __name__ == "__main__":
    main(sys.argv[1].split(","), int(sys.argv[2]) if len(sys.argv) > 2 else 3)
