"""The block-scaled fp8 dot (QuantScheme.block, pre-quantized `quant_method: fp8` checkpoints)
compiled for a TPU through libtpu's compile-only topology: no weight-sized temporary at any
row count (a one-row dot widened the whole weight until the dot padded its rows to 8), a
partial last block included (docs/architecture.md, "Quantized weights"; the 8B-sized
measurement is docs/history/quant_block_probe.py). Nothing runs; skipped without libtpu."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from jaxserve import target as targets
from jaxserve.models.quant import qdot
from jaxserve.quantization import QuantScheme

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='needs libtpu for TPU targets: pip install -e ".[tpu]"',
)
N = 28672  # Llama-3.1-8B's gate_up: the size at which a one-row dot widened the weight
BLOCK = QuantScheme(weights="fp8", block=128)


@pytest.mark.parametrize("rows", [1, 8, 256])
@pytest.mark.parametrize("k", [4096, 4096 + 64])  # whole blocks; a partial last block
def test_the_block_dot_writes_no_widened_weight_on_v5e(rows, k):
    where = targets.resolve("v5e:1x1")
    sharding = SingleDeviceSharding(where.devices[0])

    def shape(s, dtype):
        return jax.ShapeDtypeStruct(s, dtype, sharding=sharding)

    args = (
        shape((rows, k), jnp.bfloat16),
        shape((k, N), jnp.float8_e4m3fn),
        shape((-(-k // 128), N), jnp.float32),
    )
    with targets.use(where):
        fn = jax.jit(lambda x, q, s: qdot(x, q, s, BLOCK, jnp.bfloat16))
        compiled = fn.trace(*args).lower().compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    # The e4m3 weight is k * N bytes; any widened copy of it at least twice that. What may
    # remain is activation-sized: a partial block's f32 product [rows, N] (29 MiB at 256 rows).
    assert temp < k * N, temp
