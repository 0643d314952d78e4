"""Decode steps of a model at 1, 2, 4 and 8 rows, and the LM head's product at those rows.

Behind docs/benchmarks.md, "Model step on `small`" (13th session): jaxserve's decode at 2-8
rows trails llama.cpp's on the CPU while one row and 16-64 rows do not. The step points use
the engine as `../shared/peers/step_probe.py` does (prompts of 128 random ids, 32 decode steps
timed as a run of 33 tokens less a run of 1); the head points time `dot_general` of M rows
against a 49,152 x 576 table alone, which shows XLA:CPU's one-row matrix-vector kernel against
its matrix-matrix kernel at a few rows. Run from the repository root, with llama.cpp's
`llama-batched-bench -npl 1,2,4,8` straight after for its side:

    JAX_PLATFORMS=cpu PYTHONPATH=. python docs/history/small_batch_decode.py \
        ~/.cache/peers/models/small
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import numpy as np

from jaxserve.engine import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams

BATCHES = (1, 2, 4, 8)


def decode_steps(model: str, rounds: int = 2) -> None:
    """Milliseconds a decode step at each batch size, `rounds` times in turn."""
    engine = Engine(
        EngineConfig(
            model=model,
            dtype="float32",
            max_num_seqs=64,
            max_num_batched_tokens=512,
            max_model_len=1024,
            show_progress=False,
        )
    )
    rng = np.random.default_rng(0)

    def run(prompts: int, tokens: int) -> float:
        start = time.perf_counter()
        for _ in range(prompts):
            ids = [int(i) for i in rng.integers(10, 1000, 128)]
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
            engine.add_request(ids, params)
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    run(1, 4)  # warm
    for _ in range(rounds):
        for b in BATCHES:
            prefill = run(b, 1)
            both = run(b, 33)
            print(f"decode, batch {b}: {(both - prefill) / 32 * 1e3:.1f} ms a step", flush=True)


def head_products() -> None:
    """Milliseconds of the tied LM head's product (f32[M, 576] against f32[49152, 576])."""
    key = jax.random.key(0)
    table = jax.random.normal(key, (49152, 576))
    head = jax.jit(lambda x, e: jax.lax.dot_general(x, e, (((1,), (1,)), ((), ()))))
    for m in BATCHES:
        x = jax.random.normal(key, (m, 576))
        jax.block_until_ready(head(x, table))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(10):
                out = head(x, table)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - start) / 10 * 1e3)
        print(f"LM head, {m} rows: {statistics.median(times):.2f} ms", flush=True)


if __name__ == "__main__":
    decode_steps(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m")
    head_products()
