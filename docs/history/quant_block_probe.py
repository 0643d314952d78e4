"""What a block-scaled fp8 matmul (a pre-quantized `quant_method: fp8` checkpoint's 128x128
scales, QuantScheme.block) compiles to for a TPU, beside the per-column fp8 weight-only dot
(issue 43; docs/architecture.md, "Quantized weights").

    JAX_PLATFORMS=cpu PYTHONPATH=. python docs/history/quant_block_probe.py [v5e:1x1]

Llama-3.1-8B's gate_up ([4096, 28672] e4m3, bfloat16 activations) for 1 and 256 tokens,
compiled through libtpu's compile-only topology: the executable's temporaries (a widened
weight written to HBM would show as ~224 MiB here) and the cost analysis's FLOPs.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from jaxserve import target as targets
from jaxserve.models.quant import qdot
from jaxserve.quantization import QuantScheme

K, N, BLOCK = 4096, 28672, 128


def report(name: str, scheme: QuantScheme, x, q, s) -> None:
    """Prints one JSON row: the variant, its token count, temporaries (MiB) and GFLOPs."""
    fn = jax.jit(lambda x, q, s: qdot(x, q, s, scheme, jnp.bfloat16))
    compiled = fn.trace(x, q, s).lower().compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    row = dict(
        variant=name,
        tokens=x.shape[0],
        temp_MiB=round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 2),
        gflops=round(cost.get("flops", 0) / 1e9, 3),
    )
    print(json.dumps(row), flush=True)


def main() -> None:
    """Compiles both variants for the target named on the command line (v5e:1x1 by default)."""
    where = targets.resolve(sys.argv[1] if len(sys.argv) > 1 else "v5e:1x1")
    sharding = SingleDeviceSharding(where.devices[0])

    def shape(s, dt):
        return jax.ShapeDtypeStruct(s, dt, sharding=sharding)

    q = shape((K, N), jnp.float8_e4m3fn)
    for tokens in (1, 8, 256):
        x = shape((tokens, K), jnp.bfloat16)
        report(
            "fp8 weight-only, one scale a column",
            QuantScheme(weights="fp8"),
            x,
            q,
            shape((N,), jnp.float32),
        )
        report(
            "fp8 weight-only, 128-row block scales",
            QuantScheme(weights="fp8", block=BLOCK),
            x,
            q,
            shape((K // BLOCK, N), jnp.float32),
        )


if __name__ == "__main__":
    main()
