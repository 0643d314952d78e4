"""Whether XLA:GPU copies an e4m3 kernel for its fp8 GEMM, by the kernel's layout (issue 43;
docs/architecture.md, "Quantized weights").

    JAX_PLATFORMS=cpu PYTHONPATH=.:$HOME/.cache/jaxserve/cuda-compile/jax-0.12.0.1 \
        /path/to/python3.13-jax0.12-venv/bin/python docs/history/quant_gpu_fp8_layout.py

One W8A8 fp8 matmul of Llama-3.1-8B's gate_up width ([4096, 28672]), compiled for the
compile-only H100, alone and as a 4-layer scan over a stacked kernel: "kn" stores the kernel
[in, out] as the model does, "nk" [out, in] (the contracting axis minor, as the fp8 GEMM wants),
"wo-bf16" is the weight-only dot for comparison. Reported: the executable's temporaries and the
count of e4m3 arrays it transposes or copies.
"""

from __future__ import annotations

import json
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from jaxserve import target as targets
from jaxserve.models.quant import quantize_activations

where = targets.resolve("h100")
sh = SingleDeviceSharding(where.devices[0])
K, N, L = 4096, 28672, 4


def sds(s, d):
    return jax.ShapeDtypeStruct(s, d, sharding=sh)


f8 = jnp.float8_e4m3fn


def kn(x, w, s):  # w [K, N]
    xq, xs = quantize_activations(x, "fp8")
    y = jax.lax.dot_general(xq, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * xs * s).astype(jnp.bfloat16)


def nk(x, w, s):  # w [N, K]
    xq, xs = quantize_activations(x, "fp8")
    y = jax.lax.dot_general(xq, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * xs * s).astype(jnp.bfloat16)


def wo(x, w, s):
    y = jax.lax.dot_general(
        x, w.astype(jnp.bfloat16), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return (y * s).astype(jnp.bfloat16)


def scan(f):
    def g(x, ws, s):
        def body(h, w):
            return f(h, w, s)[:, :K], None

        return jax.lax.scan(body, x, ws)[0]

    return g


for name, f, wshape in [("kn", kn, (K, N)), ("nk", nk, (N, K)), ("wo-bf16", wo, (K, N))]:
    for T in (1, 256):
        for stacked in (False, True):
            fn = scan(f) if stacked else f
            w = sds(((L,) if stacked else ()) + wshape, f8)
            c = (
                jax.jit(fn)
                .trace(sds((T, K), jnp.bfloat16), w, sds((N,), jnp.float32))
                .lower()
                .compile()
            )
            txt = c.as_text()
            ops = sorted(set(re.findall(r"custom_call_target=\"([^\"]+)\"", txt)))
            tr = len(re.findall(r"= f8e4m3fn\[[\d,]+\]\{[^}]*\} (?:transpose|copy)\(", txt))
            print(
                json.dumps(
                    dict(
                        layout=name,
                        T=T,
                        stacked=stacked,
                        temp_MiB=round(c.memory_analysis().temp_size_in_bytes / 2**20, 1),
                        f8_copies=tr,
                        calls=ops,
                    )
                )
            )
