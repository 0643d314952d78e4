"""What one quantized matmul compiles to for a TPU: jaxserve's QuantDense math against qwix's PTQ
(issue 43; docs/architecture.md, "Quantized weights").

    pip install qwix   # not a dependency of jaxserve: this probe alone imports it
    JAX_PLATFORMS=cpu PYTHONPATH=. python docs/history/quant_qwix_probe.py [v5e:1x1]

One layer of Llama-3.1-8B's widest matmul (gate_up: [4096, 28672], bfloat16 activations),
compiled through libtpu's compile-only topology for 1 and 256 tokens, five ways: the bf16
weight; ours weight-only (`x @ q.astype(bf16)`, the f32 scale on the output columns after the
dot); the same weight dequantized before the dot by hand; qwix's PtqProvider with an int8
weight (weight-only); ours and qwix's W8A8 (per-token int8 activations). For each: the
executable's temporaries (a dequantized weight written to HBM would show here), the cost
analysis's FLOPs (the elementwise work XLA counts besides the matmul) and, where the matmul is
a convolution on the MXU, the dtype of its weight operand: s8 means the MXU reads the int8
weight itself, bf16 that a fused elementwise pass dequantizes every weight element first.
"""

from __future__ import annotations

import json
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from jaxserve import target as targets
from jaxserve.models.quant import qdot
from jaxserve.quantization import QuantScheme

K, N = 4096, 28672
BF16 = jnp.bfloat16
DIMS = (((1,), (0,)), ((), ()))


def bf16_dot(x, w):
    return jax.lax.dot_general(x, w, DIMS, preferred_element_type=jnp.float32).astype(BF16)


def ours(scheme):
    return lambda x, q, s: qdot(x, q, s, scheme, BF16)


def dequantized_before(x, q, s):
    w = (q.astype(jnp.float32) * s).astype(BF16)
    return jax.lax.dot_general(x, w, DIMS, preferred_element_type=jnp.float32).astype(BF16)


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.DenseGeneral(N, use_bias=False, dtype=BF16, param_dtype=BF16, name="proj")(x)


def qwix_layer(act_qtype, sharding):
    import qwix

    rules = [qwix.QtRule(module_path=".*", weight_qtype=jnp.int8, act_qtype=act_qtype)]
    model = qwix.quantize_model(Layer(), qwix.PtqProvider(rules))
    shapes = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, K), BF16))
    params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), shapes["params"]
    )
    return (lambda x, p: model.apply({"params": p}, x)), params


def mxu_weight_dtype(hlo: str) -> str:
    """The dtype of the weight operand of the program's convolution (the MXU's matmul)."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    for line in hlo.splitlines():
        m = re.search(r"convolution\(%([\w.\-]+), %([\w.\-]+)\)", line)
        if m:
            return types.get(m.group(2), "?")
    return "none (a reduce on the VPU)"


def report(name: str, fn, *args) -> dict:
    compiled = jax.jit(fn).trace(*args).lower().compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    row = dict(
        variant=name,
        tokens=args[0].shape[0],
        temp_MiB=round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 2),
        gflops=round(cost.get("flops", 0) / 1e9, 3),
        mxu_weight=mxu_weight_dtype(compiled.as_text()),
    )
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    where = targets.resolve(sys.argv[1] if len(sys.argv) > 1 else "v5e:1x1")
    sharding = SingleDeviceSharding(where.devices[0])

    def shape(s, dt):
        return jax.ShapeDtypeStruct(s, dt, sharding=sharding)

    q, s = shape((K, N), jnp.int8), shape((N,), jnp.float32)
    for tokens in (1, 256):
        x = shape((tokens, K), BF16)
        report("bf16 weight", bf16_dot, x, shape((K, N), BF16))
        report(
            "ours, weight-only (scale after the dot)", ours(QuantScheme(weights="int8")), x, q, s
        )
        report("dequantized before the dot, by hand", dequantized_before, x, q, s)
        fn, params = qwix_layer(None, sharding)
        report("qwix PtqProvider, weight-only int8", fn, x, params)
        w8a8 = QuantScheme(weights="int8", activations="int8")
        report("ours, W8A8 int8", ours(w8a8), x, q, s)
        fn, params = qwix_layer(jnp.int8, sharding)
        report("qwix PtqProvider, W8A8 int8", fn, x, params)


if __name__ == "__main__":
    main()
