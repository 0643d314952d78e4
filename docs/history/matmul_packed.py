# ruff: noqa: E501, B023 (a probe, kept as it ran)
"""small's 30 layers of matmuls and its tied LM head: XLA's dot against cpu_matmul.cc over packed
weights, interleaved in one process (median of 7 for the layers, 15 for the head). Behind
docs/benchmarks.md, "2026-12-04, later: weights packed once".

    python docs/history/matmul_packed.py 1,4,16,64,256,512
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import cpu_ffi

assert cpu_ffi.packed_matmul_available()
H, INTER, QKV, L, V = 576, 1536, 960, 30, 49152
rng = np.random.default_rng(0)


def w(*s):
    return jnp.asarray(rng.standard_normal(s, np.float32) * 0.02)


Ws = [dict(qkv=w(H, QKV), o=w(H, H), gu=w(H, 2 * INTER), d=w(INTER, H)) for _ in range(L)]
Ps = [{k: cpu_ffi.pack_weight(v) for k, v in lw.items()} for lw in Ws]
emb = w(V, H)
embp = cpu_ffi.pack_weight(emb.T)
hp = jax.lax.Precision.HIGHEST


def fwd(x, Ws, mm):
    for lw in Ws:
        a = mm(x, lw["qkv"])
        x = x + mm(a[:, :H], lw["o"])
        g = mm(x, lw["gu"])
        x = x + mm(jax.nn.silu(g[:, :INTER]) * g[:, INTER:], lw["d"])
    return x


layers = {
    "xla": (jax.jit(lambda x, W: fwd(x, W, lambda a, b: jnp.dot(a, b, precision=hp))), Ws),
    "packed": (jax.jit(lambda x, W: fwd(x, W, cpu_ffi.packed_matmul)), Ps),
}
head = {
    "xla": (
        jax.jit(lambda x, e: jax.lax.dot_general(x, e, (((1,), (1,)), ((), ())), precision=hp)),
        emb,
    ),
    "packed": (jax.jit(cpu_ffi.packed_matmul), embp),
}


def timed(fns, x, rounds):
    outs = {name: f(x, W).block_until_ready() for name, (f, W) in fns.items()}
    ts = {name: [] for name in fns}
    for _ in range(rounds):
        for name, (f, W) in fns.items():
            t0 = time.perf_counter()
            f(x, W).block_until_ready()
            ts[name].append(time.perf_counter() - t0)
    diff = float(jnp.abs(outs["xla"] - outs["packed"]).max())
    return {name: float(np.median(t)) * 1e3 for name, t in ts.items()}, diff


for M in map(int, sys.argv[1].split(",")):
    x = jnp.asarray(rng.standard_normal((M, H), np.float32) * 0.1)
    lt, ld = timed(layers, x, 7)
    ht, hd = timed(head, x, 15)
    print(
        f"M={M:4d} layers xla {lt['xla']:7.2f} packed {lt['packed']:7.2f} ms ({lt['xla'] / lt['packed']:.2f}x, max diff {ld:.1e})"
        f" | head xla {ht['xla']:6.2f} packed {ht['packed']:6.2f} ms ({ht['xla'] / ht['packed']:.2f}x)",
        flush=True,
    )
