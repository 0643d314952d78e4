# ruff: noqa: E501, B023 (a probe, kept as it ran)
"""small's 30 layers of packed matmuls with each k blocking of cpu_matmul.cc, interleaved in one
process (median of the rounds): 64-k blocks with the next block prefetched against whole-K tiles.
Behind docs/benchmarks.md, "2026-12-05 and 06" and cpu_ffi.matmul_k_block's choice per CPU.

    python docs/history/matmul_k_block.py 1,4,16,64,256 [rounds] [k_blocks, default 64,0]
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import cpu_ffi

assert cpu_ffi.packed_matmul_available()
H, INTER, QKV, L = 576, 1536, 960, 30
rng = np.random.default_rng(0)
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 9
KBS = [int(k) for k in (sys.argv[3] if len(sys.argv) > 3 else "64,0").split(",")]


def w(*s):
    return cpu_ffi.pack_weight(jnp.asarray(rng.standard_normal(s, np.float32) * 0.02))


Ps = [dict(qkv=w(H, QKV), o=w(H, H), gu=w(H, 2 * INTER), d=w(INTER, H)) for _ in range(L)]


def fwd(x, Ws, kb):
    mm = lambda a, b: cpu_ffi.packed_matmul(a, b, k_block=kb)
    for lw in Ws:
        a = mm(x, lw["qkv"])
        x = x + mm(a[:, :H], lw["o"])
        g = mm(x, lw["gu"])
        x = x + mm(jax.nn.silu(g[:, :INTER]) * g[:, INTER:], lw["d"])
    return x


fns = {kb: jax.jit(lambda x, W, kb=kb: fwd(x, W, kb)) for kb in KBS}
print(
    f"CPU vendor {cpu_ffi._cpu_vendor()!r}, this CPU's choice k_block={cpu_ffi.matmul_k_block()}",
    flush=True,
)
for M in map(int, sys.argv[1].split(",")):
    x = jnp.asarray(rng.standard_normal((M, H), np.float32) * 0.1)
    outs = {kb: np.asarray(f(x, Ps)) for kb, f in fns.items()}
    same = all(np.array_equal(outs[KBS[0]], o) for o in outs.values())
    ts = {kb: [] for kb in KBS}
    for _ in range(ROUNDS):
        for kb, f in fns.items():
            t0 = time.perf_counter()
            f(x, Ps).block_until_ready()
            ts[kb].append(time.perf_counter() - t0)
    med = {kb: float(np.median(t)) * 1e3 for kb, t in ts.items()}
    cells = "  ".join(f"k_block={kb}: {med[kb]:7.2f} ms" for kb in KBS)
    print(f"rows {M:4d}  {cells}  (same bits: {same})", flush=True)
