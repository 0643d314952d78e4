"""The one-row decode step of smollm2-135m, timed and profiled: what found the tied-head defect.

Behind docs/benchmarks.md, "JAX 0.12 against 0.10" (12th session). Run from the repository
root under each Python to compare JAX versions, or against a worktree of an older commit to
compare trees (`PYTHONPATH=<tree>`):

    JAX_PLATFORMS=cpu PYTHONPATH=. python docs/history/one_row_decode.py
    JAX_PLATFORMS=cpu PYTHONPATH=. PROFILE=1 python docs/history/one_row_decode.py

It times the 1-token bucket's step at context 256 (greedy and at temperature 0.8) and, beside
it, the parts it was first suspected of: 30 layers' matmuls, the LM head, top-k over the
vocabulary. With PROFILE=1 it also traces ten steps with `jax.profiler` and prints XLA:CPU's
thunks summed by name (the step's own ops; a fusion that stands out is the one to read in
the compiled HLO, `XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text`).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import statistics
import tempfile
import time

import jax
import numpy as np

from checkpoints import load_model
from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.models.step_batch import SeqChunk, pack_chunks
from jaxserve.runtime.sampling import SamplingBatch

CONTEXT = 256


def main() -> None:
    print("jax", jax.__version__)
    engine = Engine(
        EngineConfig(show_progress=False, max_num_seqs=4, precompile=False),
        model=load_model("smollm2-135m"),
    )
    runner, rc = engine.runner, engine.runner.config
    pages = -(-(CONTEXT + 16) // rc.page_size)
    num_seqs = rc.seq_bucket_for(1)
    batch = pack_chunks(
        [SeqChunk([5], CONTEXT, list(range(pages)))],
        page_size=rc.page_size,
        num_tokens=1,
        num_seqs=num_seqs,
        pages_per_seq=rc.pages_per_seq,
        num_pages=rc.num_pages,
    )
    greedy = SamplingBatch.empty(num_seqs)
    sampled = dataclasses.replace(greedy, temperature=np.full(num_seqs, 0.8, np.float32))
    key = jax.random.key(0)
    x = jax.random.normal(key, (1, 576))
    w_up = jax.random.normal(key, (576, 1536))
    w_down = jax.random.normal(key, (1536, 576))
    w_qkv = jax.random.normal(key, (576, 576 + 2 * 192))
    emb = jax.random.normal(key, (49152, 576))

    def layers(x):
        for _ in range(30):
            h = x @ w_qkv
            x = x + (jax.nn.silu(x @ w_up) * (x @ w_up)) @ w_down + h[:, :576]
        return x

    logits = jax.random.normal(key, (num_seqs, 49152))
    f_layers = jax.jit(layers)
    f_head = jax.jit(lambda x, e: x @ e.T)
    f_top = jax.jit(lambda v: jax.lax.top_k(v, 128))
    parts = {
        "step, greedy": lambda: runner.execute(batch, greedy).token_ids,
        "step, t=0.8": lambda: runner.execute(batch, sampled).token_ids,
        "30 layers' matmuls": lambda: f_layers(x),
        "LM head, x @ emb.T": lambda: f_head(x, emb),
        "top_k 128 of 49152": lambda: f_top(logits),
    }
    times = {name: [] for name in parts}
    items = list(parts.items())
    for fn in parts.values():
        jax.block_until_ready(fn())
    for i in range(8):  # each first in turn
        for name, fn in items[i % len(items) :] + items[: i % len(items)]:
            start = time.perf_counter()
            for _ in range(10):
                out = fn()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / 10 * 1e3)
    for name, values in times.items():
        print(f"{name}: {statistics.median(values):.2f} ms")
    if os.environ.get("PROFILE"):
        profile(lambda: runner.execute(batch, greedy).token_ids)


def profile(step) -> None:
    """Ten steps under jax.profiler; XLA:CPU's thunks summed by name, per step."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        for _ in range(10):
            jax.block_until_ready(step())
        jax.profiler.stop_trace()
        data = ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
        total, count = collections.Counter(), collections.Counter()
        for plane in data.planes:
            for line in plane.lines:
                if "XLA" not in line.name and "Eigen" not in line.name:
                    continue
                for event in line.events:
                    if event.name.startswith("ThunkExecutor"):
                        continue
                    total[event.name] += event.duration_ns
                    count[re.sub(r"\.\d+$", "", event.name)] += 1
    print(f"thunks, summed: {sum(total.values()) / 1e7:.1f} ms a step; the largest:")
    for name, ns in total.most_common(12):
        print(f"  {ns / 1e7:8.2f} ms  {name}")


if __name__ == "__main__":
    main()
