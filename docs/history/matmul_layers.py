# ruff: noqa: E402, E501, B023 (a probe, kept as it ran)
"""small's 30 layers of matmuls and its tied LM head through XLA:CPU, weights as arguments (too
large for the caches, as in the step), beside torch's F.linear, for the table in
docs/benchmarks.md ("What is left is the matmuls"); `matmul_onednn.py` is vLLM's own GEMM.
XLA_FLAGS select XLA's dot paths:

    python docs/history/matmul_layers.py 1,4,16,64,256
    XLA_FLAGS="--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_xnnpack=false" python ...
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

H, INTER, QKV, L, V = 576, 1536, 960, 30, 49152
rng = np.random.default_rng(0)


def w(*s):
    return rng.standard_normal(s, np.float32) * 0.02


Ws = [dict(qkv=w(H, QKV), o=w(H, H), gu=w(H, 2 * INTER), d=w(INTER, H)) for _ in range(L)]
emb = w(V, H)


def fwd(x, Ws, emb, head=True):
    for lw in Ws:
        a = x @ lw["qkv"]
        x = x + (a[:, :H]) @ lw["o"]
        g = x @ lw["gu"]
        x = x + (jax.nn.silu(g[:, :INTER]) * g[:, INTER:]) @ lw["d"]
    if head:
        return lax.dot_general(x, emb, (((1,), (1,)), ((), ())))
    return x


def bench(f, n=30):
    f()
    for _ in range(3):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return np.median(ts) * 1e3


jW = jax.tree.map(jnp.asarray, Ws)
jemb = jnp.asarray(emb)
jl = jax.jit(lambda x, W: fwd(x, W, None, False))
jh = jax.jit(lambda x, e: lax.dot_general(x, e, (((1,), (1,)), ((), ()))))
import torch

torch.set_num_threads(2)
tW = [{k: torch.from_numpy(np.ascontiguousarray(v.T)) for k, v in lw.items()} for lw in Ws]
temb = torch.from_numpy(emb)


def tfwd(x):
    with torch.no_grad():
        for lw in tW:
            a = torch.nn.functional.linear(x, lw["qkv"])
            x = x + torch.nn.functional.linear(a[:, :H], lw["o"])
            g = torch.nn.functional.linear(x, lw["gu"])
            x = x + torch.nn.functional.linear(
                torch.nn.functional.silu(g[:, :INTER]) * g[:, INTER:], lw["d"]
            )
        return x


def thead(x):
    with torch.no_grad():
        return torch.nn.functional.linear(x, temb)


Ms = (
    [int(m) for m in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 4, 8, 16, 32, 64, 128]
)
wbytes = sum(v.nbytes for lw in Ws for v in lw.values())
print(f"layer weights {wbytes / 1e6:.0f} MB, head {emb.nbytes / 1e6:.0f} MB")
for M in Ms:
    x = rng.standard_normal((M, H), np.float32)
    jx = jnp.asarray(x)
    tx = torch.from_numpy(x)
    a = bench(lambda: jl(jx, jW).block_until_ready())
    b = bench(lambda: tfwd(tx))
    c = bench(lambda: jh(jx, jemb).block_until_ready())
    d = bench(lambda: thead(tx))
    print(
        f"M={M:4d} layers xla {a:7.2f} ms ({wbytes / a / 1e6:5.1f} GB/s) torch {b:7.2f} ms | head xla {c:6.2f} torch {d:6.2f} ms"
    )
