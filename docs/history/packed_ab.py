# ruff: noqa: E501 (a probe, kept as it ran)
"""The step with packed CPU weights (cpu_matmul.cc) against XLA's dot, interleaved in one process.

Behind docs/benchmarks.md, "2026-12-04: weights packed once". Two engines over the same model,
one built with $JAXSERVE_CPU_PACKED_WEIGHTS=0; each composition's step alternates between them
(ROUNDS rounds, median), so the machine's drift hits both alike.

    python docs/history/packed_ab.py ~/.cache/peers/models/small decode:1,decode:16,decode:64,prefill:256
"""

import os
import statistics
import sys
import time

import jax
import numpy as np

from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.models.step_batch import SeqChunk, pack_chunks
from jaxserve.runtime.sampling import SamplingBatch

model, points = sys.argv[1], sys.argv[2].split(",")
ROUNDS = int(os.environ.get("ROUNDS", "10"))


def engine(packed: str) -> Engine:
    os.environ["JAXSERVE_CPU_PACKED_WEIGHTS"] = packed
    config = EngineConfig(
        model=model,
        show_progress=False,
        max_num_seqs=64,
        max_model_len=1024,
        precompile=False,
        num_pages=1100,
    )
    return Engine(config)


engines = {"packed": engine("1"), "xla": engine("0")}
assert (
    engines["packed"].runner.module.packed_weights
    and not engines["xla"].runner.module.packed_weights
)


def batch_of(rc, kind: str, T: int):
    rng = np.random.default_rng(0)
    chunks, page = [], 0
    if kind == "decode":
        for _ in range(T):
            ctx = int(rng.integers(100, 200))
            n = -(-(ctx + 1) // rc.page_size)
            chunks.append(SeqChunk([5], ctx, list(range(page, page + n))))
            page += n
    else:
        for _ in range(T // 64):
            n = -(-64 // rc.page_size)
            chunks.append(SeqChunk(list(range(10, 74)), 0, list(range(page, page + n))))
            page += n
    S = rc.seq_bucket_for(T)
    batch = pack_chunks(
        chunks,
        page_size=rc.page_size,
        num_tokens=T,
        num_seqs=S,
        pages_per_seq=rc.pages_per_seq,
        num_pages=rc.num_pages,
    )
    return batch, SamplingBatch.empty(S)


for point in points:
    kind, T = point.split(":")[0], int(point.split(":")[1])
    steps = {}
    for name, e in engines.items():
        batch, samp = batch_of(e.runner.config, kind, T)
        steps[name] = (lambda r, b, s: lambda: r.execute(b, s).token_ids)(e.runner, batch, samp)
        jax.block_until_ready(steps[name]())
    same = bool((np.asarray(steps["packed"]()) == np.asarray(steps["xla"]())).all())
    ts = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, fn in steps.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            ts[name].append(time.perf_counter() - t)
    p, x = statistics.median(ts["packed"]) * 1e3, statistics.median(ts["xla"]) * 1e3
    print(
        f"{kind:7s} T={T:4d}: packed {p:7.1f} ms  xla {x:7.1f} ms  xla/packed {x / p:.2f}  same tokens {same}",
        flush=True,
    )
