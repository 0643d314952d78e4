# ruff: noqa: E402, E501, B023 (a probe, kept as it ran)
"""small's 30 layers of matmuls and its LM head through vLLM's CPU GEMM (oneDNN, weights packed
once), for the table in docs/benchmarks.md ("What is left is the matmuls"). Run with vLLM's venv
(`../shared/peers/setup_vllm.sh`); XLA's side is `matmul_layers.py` in this folder:

    ~/.cache/peers/vllm-venv/bin/python docs/history/matmul_onednn.py 1,4,16,64,256
"""

import sys
import time

import numpy as np
import torch

torch.set_num_threads(2)
from vllm import _custom_ops as ops

H, INTER, QKV, L, V = 576, 1536, 960, 30, 49152
rng = np.random.default_rng(0)


def w(*s):
    return torch.from_numpy(rng.standard_normal(s, np.float32) * 0.02)


# weights as torch Linear stores them: [N, K]
Ws = [dict(qkv=w(QKV, H), o=w(H, H), gu=w(2 * INTER, H), d=w(H, INTER)) for _ in range(L)]
emb = w(V, H)
hs = [{k: ops.create_onednn_mm(v.t(), 32) for k, v in lw.items()} for lw in Ws]
hh = ops.create_onednn_mm(emb.t(), 32)


def fwd(x):
    with torch.no_grad():
        for lw in hs:
            a = ops.onednn_mm(lw["qkv"], x, None)
            x = x + ops.onednn_mm(lw["o"], a[:, :H].contiguous(), None)
            g = ops.onednn_mm(lw["gu"], x, None)
            x = x + ops.onednn_mm(
                lw["d"], (torch.nn.functional.silu(g[:, :INTER]) * g[:, INTER:]).contiguous(), None
            )
        return x


def head(x):
    with torch.no_grad():
        return ops.onednn_mm(hh, x, None)


def bench(f, n=30):
    for _ in range(4):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return np.median(ts) * 1e3


for M in [int(m) for m in sys.argv[1].split(",")]:
    x = torch.from_numpy(rng.standard_normal((M, H), np.float32))
    print(
        f"M={M:4d} layers onednn {bench(lambda: fwd(x)):7.2f} ms | head onednn {bench(lambda: head(x)):6.2f} ms"
    )
