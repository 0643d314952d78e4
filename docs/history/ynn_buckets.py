"""The probe behind removing the per-bucket 'YNN fusions off' option (docs/history/README.md).

Per token bucket, the decode step compiled with XLA:CPU's YNN fusions on (the default) and off
(`xla_cpu_experimental_ynn_fusion_type=""`), both in one process, timed interleaved, best of 7:
every sequence slot decoding at context 256, and a lone 5-token chunk. The option itself is gone
from the engine, so the two variants are jitted here from the runner's own step function.

    MODEL=smollm2-135m BUCKETS=8,16,32 PYTHONPATH=. python docs/history/ynn_buckets.py
"""

from __future__ import annotations

import functools
import os
import time

import jax

from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.models.step_batch import SeqChunk, pack_chunks
from jaxserve.runtime.sampling import SamplingBatch

CONTEXT = 256


def main() -> None:
    model = os.environ.get("MODEL")
    buckets = [int(b) for b in os.environ.get("BUCKETS", "8,16,32").split(",")]
    engine = Engine(EngineConfig(show_progress=False, **({"model": model} if model else {})))
    runner, cfg = engine.runner, engine.runner.config

    def batch(chunks, t):
        return pack_chunks(
            chunks,
            page_size=cfg.page_size,
            num_tokens=t,
            num_seqs=cfg.seq_bucket_for(t),
            pages_per_seq=cfg.pages_per_seq,
            num_pages=cfg.num_pages,
        )

    def decodes(n):
        return [SeqChunk([1], CONTEXT - 1, list(range(i * 20, i * 20 + 17))) for i in range(n)]

    jit = functools.partial(
        jax.jit, runner._step_words, static_argnums=(6,), donate_argnums=(1, 3, 4)
    )
    variants = {
        "on": runner._step,
        "off": jit(compiler_options={"xla_cpu_experimental_ynn_fusion_type": ""}),
    }

    def seconds(b, n=10):
        start = time.perf_counter()
        for _ in range(n):
            out = runner._dispatch(b, SamplingBatch.empty(len(b.kv_lens)))
        jax.block_until_ready(out.token_ids)
        return (time.perf_counter() - start) / n

    for t in buckets:
        cases = {"decodes": batch(decodes(min(t, cfg.seq_bucket_for(t))), t)}
        if t >= 8:
            cases["chunk5"] = batch([SeqChunk([1] * 5, CONTEXT, list(range(17)))], t)
        best = {(v, c): float("inf") for v in variants for c in cases}
        for step in variants.values():  # compile both first
            runner._step = step
            for b in cases.values():
                seconds(b, 2)
        for _ in range(7):
            for v, step in variants.items():
                runner._step = step
                for c, b in cases.items():
                    best[(v, c)] = min(best[(v, c)], seconds(b))
        print(
            f"bucket {t}: "
            + ", ".join(
                f"{c}: on {1e3 * best[('on', c)]:.2f} / off {1e3 * best[('off', c)]:.2f} ms "
                f"(off/on {best[('off', c)] / best[('on', c)]:.2f})"
                for c in cases
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
