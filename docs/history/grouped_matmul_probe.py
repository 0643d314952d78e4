"""A mixture-of-experts layer's grouped matmul on the CPU (issue 42): cpu_ffi.grouped_packed_matmul
against (a) a dense packed_matmul of the same rows against one expert, the ideal (the same
multiply-adds, one weight read), and (b) jax.lax.ragged_dot under jit, which XLA:CPU lowers to a
dense dot masked per group. Rows are top-2 routed tokens sorted by expert (random routing);
interleaved in one process, each sample the mean of `inner` calls, the median of `rounds`.

    PYTHONPATH=$PWD python docs/history/grouped_matmul_probe.py [rounds]

As it ran on 2026-12-06 (2-core Zen 4 EPYC shared with other agents, load 3.5-6.6 and rising to
13; k_block 0; 15 rounds; microseconds, the two runs one after the other):

    case     M    G    K    N  active  grouped        dense         ragged_dot       grouped/dense
    decode   32   8  256  256    8     82.5 / 88.8    70.6 / 69.7     602 / 829      1.17 / 1.27
    decode   32   8  128  256    7     56.4 / 56.8    43.9 / 54.8     293 / 466      1.28 / 1.04
    prefill 1024  8  256  256    8     2030 / 2488    1799 / 2125   17583 / 23093    1.13 / 1.17
    prefill 1024  8  128  256    8     1133 / 1065    1317 / 1292   10963 / 10726    0.86 / 0.82
    decode   32  64  256  256   25      161 / 200      103 / 75     13658 / 10713    1.57 / 2.68
    prefill 1024 64  256  256   64     4515 / 2607    2650 / 1784  384906 / 213092   1.70 / 1.46

ragged_dot took 5.2-10.1x the grouped call's time over 8 experts and 54-85x over 64 (its masked
dense dot does G times the work). Over 8 experts the grouped call is within 0.8-1.3x of the
ideal; over 64, its 25-64 active experts' weights (6.4-16 MB against one expert's 256 KB) are
what the ideal does not read.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import cpu_ffi

TOP_K = 2
# (label, tokens, experts, K, N): a decode step of 16 tokens and a prefill chunk of 512, against
# an expert's gate/up (K 256 -> N 2 * 128) and down (K 128 -> N 256); then 64 experts.
CASES = [
    ("decode", 16, 8, 256, 256),
    ("decode", 16, 8, 128, 256),
    ("prefill", 512, 8, 256, 256),
    ("prefill", 512, 8, 128, 256),
    ("decode", 16, 64, 256, 256),
    ("prefill", 512, 64, 256, 256),
]


def routed_sizes(rng, tokens, experts):
    """Rows per expert when each token picks TOP_K distinct experts at random."""
    picks = np.stack([rng.choice(experts, TOP_K, replace=False) for _ in range(tokens)])
    return np.bincount(picks.ravel(), minlength=experts).astype(np.int32)


def sample(fn, args, inner):
    fn(*args).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(inner):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - t0) / inner


def main(rounds):
    assert cpu_ffi.packed_matmul_available()
    rng = np.random.default_rng(0)
    grouped = jax.jit(cpu_ffi.grouped_packed_matmul)
    dense = jax.jit(cpu_ffi.packed_matmul)
    ragged = jax.jit(
        lambda x, w, s: jax.lax.ragged_dot(x, w, s, precision=jax.lax.Precision.HIGHEST)
    )
    print(f"load {os.getloadavg()[0]:.2f}, k_block {cpu_ffi.matmul_k_block()}, {rounds} rounds")
    print(
        "case     M     G    K    N  active   grouped us   dense us   ragged_dot us  "
        "grouped/dense  ragged/grouped"
    )
    for label, tokens, experts, k, n in CASES:
        m = tokens * TOP_K
        sizes = jnp.asarray(routed_sizes(rng, tokens, experts))
        x = jnp.asarray(rng.standard_normal((m, k), np.float32))
        w = jnp.asarray(rng.standard_normal((experts, k, n), np.float32) * 0.05)
        wp = cpu_ffi.pack_weight(w)
        want = np.asarray(ragged(x, w, sizes))
        np.testing.assert_allclose(np.asarray(grouped(x, wp, sizes)), want, rtol=1e-4, atol=1e-4)
        fns = {
            "grouped": (grouped, (x, wp, sizes)),
            "dense": (dense, (x, wp[0])),
            "ragged": (ragged, (x, w, sizes)),
        }
        inner = 200 if m < 100 else 10
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, (fn, args) in fns.items():
                times[name].append(sample(fn, args, inner))
        med = {name: 1e6 * float(np.median(ts)) for name, ts in times.items()}
        active = int((np.asarray(sizes) > 0).sum())
        print(
            f"{label:8s}{m:5d}{experts:5d}{k:5d}{n:5d}{active:6d}   {med['grouped']:10.1f} "
            f"{med['dense']:10.1f} {med['ragged']:14.1f} {med['grouped'] / med['dense']:13.2f}x "
            f"{med['ragged'] / med['grouped']:13.1f}x"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
