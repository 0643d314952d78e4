"""Hand mutants of the 8-bit pool's key transform (models/kv_keys.py, runtime/key_calibration.py
and where the model and the builder apply it; issue 43) and the tests that must kill them.

    PYTHONPATH=. python docs/history/kv_keys_mutants.py [INDEX ...]

Run by kv_quant_mutants.run (one exact string replaced, the named tests with -x, the file put
back). The scale-out tests run in a session of their own (4 host devices).
Results: docs/benchmarks.md, "Quantized KV cache", stop 66.
"""

import sys

from kv_quant_mutants import run

KK = "jaxserve/models/kv_keys.py"
KC = "jaxserve/runtime/key_calibration.py"
M = "tests/models/test_kv_keys.py"
E = [
    "tests/engine/test_kv_quant_engine.py::test_each_kv_dtype_serves_near_the_float_cache_without_a_compile"
]
S = "tests/scaleout/test_kv_quant_tp.py"
MUTANTS = [
    (
        "centre not subtracted",
        KK,
        "k32 = (k.astype(jnp.float32) - b) * inv",
        "k32 = k.astype(jnp.float32) * inv",
        [M, *E],
    ),
    (
        "query not multiplied by s",
        KK,
        "heads // kv_heads, d) * s[:, None]",
        "heads // kv_heads, d)",
        [M],
    ),
    (
        "keys divided by s, not multiplied by 1 / s",
        KK,
        "inv = jnp.asarray((1.0 / self.scale)",
        "inv = jnp.asarray((self.scale)",
        [M],
    ),
    (
        "query not rotated",
        KK,
        '            q32 = jnp.einsum("thgd,de->thge", q32, h, precision=hi)\n',
        "",
        [M],
    ),
    (
        "centre always zero",
        KK,
        "center = np.zeros_like(keys[:, 0]) if soft_capped else keys.mean(axis=1)",
        "center = np.zeros_like(keys[:, 0])",
        [M, *E],
    ),
    (
        "smoothing inverted",
        KK,
        "s = spread ** SMOOTHING.get(dtype.name, 1.0)",
        "s = spread ** -SMOOTHING.get(dtype.name, 1.0)",
        [M, *E],
    ),
    (
        "e4m3 rotated too",
        KK,
        "return jnp.dtype(kv_dtype) == jnp.int8 and head_dim >= 2",
        "return head_dim >= 2",
        [M],
    ),
    (
        "Hadamard not normalised",
        KK,
        "return (h / np.sqrt(n)).astype(np.float32)",
        "return h.astype(np.float32)",
        [M],
    ),
    ("centre not snapped", KK, "        center = np.round(center / step) * step\n", "", [S]),
    (
        "hash of the centre only",
        KK,
        "self.center.tobytes() + self.scale.tobytes()",
        "self.center.tobytes()",
        [M],
    ),
    (
        "every layer with layer 0's transform",
        "jaxserve/models/llama.py",
        "index = true_layer if self.layer_index is None else self.layer_index",
        "index = 0",
        E,
    ),
    (
        "the builder calibrates nothing",
        "jaxserve/runtime/builder.py",
        "kv_keys = calibrate_key_transform(model, kv_dtype, max_model_len, sharding.replicated)",
        "kv_keys = None",
        E,
    ),
    (
        "calibrated on the values",
        KC,
        "k, _ = common.split_kv(kv.kv, c.num_kv_heads, c.head_dim, jnp.float32)",
        "_, k = common.split_kv(kv.kv, c.num_kv_heads, c.head_dim, jnp.float32)",
        [M, *E],
    ),
    (
        "calibrated on 8 tokens",
        KC,
        "n = max(2, min(CALIBRATION_TOKENS, max_len))",
        "n = 8",
        [M, *E],
    ),
    (
        "soft cap ignored (centred anyway)",
        KC,
        "capped = model.config.attn_logit_softcap is not None",
        "capped = False",
        [M, "-k", "soft_capped"],
    ),
]

if __name__ == "__main__":
    run(MUTANTS, {int(a) for a in sys.argv[1:]})
