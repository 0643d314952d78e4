"""Decode ms a step with an 8-bit KV pool, with and without its key transform (models/kv_keys.py),
on smollm2-135m (float32 weights), rounds interleaved in one process (docs/benchmarks.md,
"Quantized KV cache", stop 66).

    PYTHONPATH=. python docs/history/kv_keys_ab.py 3

quant_cpu_ab.py's loop over five engines: the float32 pool, int8 and e4m3 pools with the
calibrated transform, and the same without it (the builder's calibration replaced by None).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np

import jaxserve.runtime.builder as builder
from checkpoints import load_model
from jaxserve.engine.build import build_engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig

ENGINES = (
    ("none", "auto", True),
    ("int8", "int8", True),
    ("int8-raw", "int8", False),
    ("fp8", "fp8", True),
    ("fp8-raw", "fp8", False),
)


def main(rounds: int) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    ab = importlib.import_module("quant_cpu_ab")  # its loop and batches
    model = load_model("smollm2-135m", dtype="float32")
    calibrate = builder.calibrate_key_transform
    llms = {}
    for name, kv, transformed in ENGINES:
        builder.calibrate_key_transform = calibrate if transformed else (lambda *a: None)
        config = EngineConfig(
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=512,
            num_pages=16 * 8 + 8,
            kv_cache_dtype=kv,
            show_progress=False,
        )
        llms[name] = LLM(engine=build_engine(config, model=model))
        assert (llms[name].engine.runner.config.kv_keys is not None) == (
            transformed and kv != "auto"
        )
    builder.calibrate_key_transform = calibrate
    rng = np.random.default_rng(0)
    for name in llms:  # every bucket the rounds use, compiled
        for b in ab.BATCHES:
            ab.per_step_ms(llms[name], b, rng, 4)
    times = {(name, b): [] for name in llms for b in ab.BATCHES}
    for _ in range(rounds):
        for b in ab.BATCHES:
            for name in llms:
                times[(name, b)].append(ab.per_step_ms(llms[name], b, rng))
    for b in ab.BATCHES:
        for name in llms:
            t = times[(name, b)]
            print(f"batch {b:2d} {name:9s} best {min(t):6.2f} ms/step  median {np.median(t):6.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
