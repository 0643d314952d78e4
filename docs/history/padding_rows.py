# ruff: noqa: E501 (a probe, kept as it ran)
"""small's 30 layers of packed matmuls at a bucket's row count, every row computed against only
the real rows (`packed_matmul`'s `valid`), interleaved in one process (median of 9 rounds).
Behind docs/benchmarks.md, "2026-12-05 and 06" (change 3 of the four).

    python docs/history/padding_rows.py 64:49,32:24,16:12,8:6,256:256
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import cpu_ffi

H, INTER, QKV, L = 576, 1536, 960, 30
rng = np.random.default_rng(0)
P = [
    {
        k: cpu_ffi.pack_weight(jnp.asarray(rng.standard_normal(s, np.float32) * 0.02))
        for k, s in dict(qkv=(H, QKV), o=(H, H), gu=(H, 2 * INTER), d=(INTER, H)).items()
    }
    for _ in range(L)
]


@jax.jit
def layers(x, P, valid):
    for lw in P:
        a = cpu_ffi.packed_matmul(x, lw["qkv"], valid)
        x = x + cpu_ffi.packed_matmul(a[:, :H], lw["o"], valid)
        g = cpu_ffi.packed_matmul(x, lw["gu"], valid)
        x = x + cpu_ffi.packed_matmul(jax.nn.silu(g[:, :INTER]) * g[:, INTER:], lw["d"], valid)
    return x


for spec in sys.argv[1].split(","):
    m, real = map(int, spec.split(":"))
    x = jnp.asarray(rng.standard_normal((m, H), np.float32))
    runs = {"all rows": jnp.int32(m), "real rows": jnp.int32(real)}
    for v in runs.values():
        layers(x, P, v).block_until_ready()
    times = {k: [] for k in runs}
    for _ in range(9):
        for k, v in runs.items():
            t = time.perf_counter()
            layers(x, P, v).block_until_ready()
            times[k].append(time.perf_counter() - t)
    a, b = (statistics.median(times[k]) * 1e3 for k in runs)
    print(
        f"{m:4d} rows, {real:4d} real: all {a:7.1f} ms, real only {b:7.1f} ms, {b / a:.2f}x",
        flush=True,
    )
