# ruff: noqa: E501 (a probe, kept as it ran)
"""The CPU's matmul over int8 weights (issue 43): cpu_ffi.packed_matmul (float32 panels) against
packed_matmul_int8 weight-only ("w8") and W8A8 ("w8a8"), on smollm2-135m's layer shapes (K 576:
N 1728 ~ its qkv, 3072 its gate_up, 576 its o_proj) and llama3.2-1b's (K 2048, N 8192). Each
sample is one jitted call over L distinct layers' weights (a decode step streams every layer's
weights from memory: one matrix repeated would sit in the caches), so the weights are cold as in
a step; modes interleaved in one process, the median of `rounds` samples, per layer.

    PYTHONPATH=$PWD python docs/history/int8_matmul_probe.py [rounds] [rows,...]

As it ran on 2026-12-07 (2-core Zen 4 EPYC, AVX512-VNNI, shared with other agents: load 2.5
before and after; k_block 0; 11 rounds; microseconds per layer):

    shape              K     N  rows   f32 us    w8 us  w8a8 us   f32/w8 f32/w8a8
    smollm2 qkv        576  1728    1    174.0     49.1     53.8    3.55x    3.24x
    smollm2 qkv        576  1728   16    233.2    179.5    107.6    1.30x    2.17x
    smollm2 qkv        576  1728   64    741.3    669.8    326.7    1.11x    2.27x
    smollm2 qkv        576  1728  256   2611.5   2521.1    973.4    1.04x    2.68x
    smollm2 gate_up    576  3072    1    227.5     65.7     95.1    3.46x    2.39x
    smollm2 gate_up    576  3072   16    389.3    312.3    191.6    1.25x    2.03x
    smollm2 gate_up    576  3072   64   1151.3   1063.5    471.4    1.08x    2.44x
    smollm2 gate_up    576  3072  256   7625.4   6848.8   2516.4    1.11x    3.03x
    smollm2 o_proj     576   576    1     77.8     23.0     19.3    3.37x    4.03x
    smollm2 o_proj     576   576   16    153.2    120.6     76.8    1.27x    1.99x
    smollm2 o_proj     576   576   64    447.7    409.7    196.7    1.09x    2.28x
    smollm2 o_proj     576   576  256   1604.0   1526.0    519.7    1.05x    3.09x
    llama3.2-1b       2048  8192    1   2425.7    641.7    791.2    3.78x    3.07x
    llama3.2-1b       2048  8192   16   3513.6   2691.7   1640.5    1.31x    2.14x
    llama3.2-1b       2048  8192   64  10500.8   9669.1   4174.1    1.09x    2.52x
    llama3.2-1b       2048  8192  256  40258.9  38214.8  14946.2    1.05x    2.69x

An earlier run at load 7.1-7.2 (9 rounds) gave the same picture, slower throughout: rows 1
weight-only 2.7-5.9x, rows 16 1.0-1.3x, W8A8 1.7-3.8x. At one row both kernels stream their
weights at about the same 25 GB/s (llama's 64 MB of float32 in 2.4 ms, 16 MB of int8 in 0.64),
so int8 is the quarter of the bytes it reads: 3.4-3.8x. From 16 rows the multiply is the bound:
the weight-only tile is then near the cores' FMA throughput (llama at 16 rows: ~50 GMAC/s a core)
and widening the int8 weights costs about what their bytes save (1.0-1.3x); W8A8's vpdpbusd does
four multiply-adds a lane, 2-3x. Widening each panel to float32 once per 48-row item, into an
L2 scratch the tiles read, was tried and was slower than widening in registers (12-16 rows
0.8x of float32 against 1.1-1.2x), so it was left out.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import cpu_ffi

assert cpu_ffi.int8_matmul_available("int8")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 11
ROWS = [int(r) for r in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 16, 64, 256]
# (label, K, N, layers): 30 layers as smollm2-135m has; 4 of llama3.2-1b's (256 MB of float32).
SHAPES = [
    ("smollm2 qkv", 576, 1728, 30),
    ("smollm2 gate_up", 576, 3072, 30),
    ("smollm2 o_proj", 576, 576, 30),
    ("llama3.2-1b", 2048, 8192, 4),
]
rng = np.random.default_rng(0)


def layers(k, n, count):
    """`count` distinct weights [k, n], packed float32 and int8."""
    f32, w8, sc = [], [], []
    for _ in range(count):
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02)
        f32.append(cpu_ffi.pack_weight(w))
        q, s = cpu_ffi.pack_weight_int8(w)
        w8.append(q)
        sc.append(s)
    return f32, w8, sc


def all_layers(mm):
    return jax.jit(lambda x, *ws: [mm(x, *w) for w in zip(*ws, strict=True)])


calls = {
    "f32": all_layers(lambda x, wp: cpu_ffi.packed_matmul(x, wp)),
    "w8": all_layers(lambda x, wq, s: cpu_ffi.packed_matmul_int8(x, wq, s)),
    "w8a8": all_layers(lambda x, wq, s: cpu_ffi.packed_matmul_int8(x, wq, s, activations="int8")),
}
print(
    f"load before {os.getloadavg()}, k_block {cpu_ffi.matmul_k_block()}, {ROUNDS} rounds",
    flush=True,
)
print("shape              K     N  rows   f32 us    w8 us  w8a8 us   f32/w8 f32/w8a8", flush=True)
for label, k, n, count in SHAPES:
    f32, w8, sc = layers(k, n, count)
    args = {"f32": (f32,), "w8": (w8, sc), "w8a8": (w8, sc)}
    for m in ROWS:
        x = jnp.asarray(rng.standard_normal((m, k), np.float32))
        for name, f in calls.items():
            jax.block_until_ready(f(x, *args[name]))
        ts = {name: [] for name in calls}
        for _ in range(ROUNDS):
            for name, f in calls.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(x, *args[name]))
                ts[name].append((time.perf_counter() - t0) / count)
        med = {name: float(np.median(t)) * 1e6 for name, t in ts.items()}
        print(
            f"{label:16s} {k:5d} {n:5d} {m:4d} {med['f32']:8.1f} {med['w8']:8.1f} {med['w8a8']:8.1f}"
            f"   {med['f32'] / med['w8']:5.2f}x   {med['f32'] / med['w8a8']:5.2f}x",
            flush=True,
        )
    del f32, w8, sc
print(f"load after {os.getloadavg()}", flush=True)
