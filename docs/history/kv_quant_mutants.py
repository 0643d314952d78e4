# ruff: noqa: E501
"""Hand mutants of the 8-bit KV cache (issue 43, item 3) and the tests that must kill them.

    PYTHONPATH=. python docs/history/kv_quant_mutants.py [INDEX ...]

Each mutant replaces one exact string in one file (the scale indexing, the rounding, the clips,
the exponent's bits, the write, each kernel's exponent lanes, the copies of pages to the host
and of a forked page, the pool's sizing), runs the tests named beside it with -x, and puts the
file back. A mutant is killed when those tests fail. Results: docs/benchmarks.md, "Quantized KV
cache".
"""

import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = sys.executable
K = "tests/kernels/test_kv_quant.py"
E = "tests/engine/test_kv_quant_engine.py"
C = "pallas_kernels/ragged_paged_attention/common.py"
CC = "pallas_kernels/ragged_paged_attention/cpu_decode.cc"
T = "pallas_kernels/ragged_paged_attention/tpu_kernel.py"
MUTANTS = [
    (
        "rounding: floor for round-half-even",
        C,
        "        y = jnp.round(y)",
        "        y = jnp.floor(y)",
        [K, "-k", "quantize or write_kv"],
    ),
    (
        "clip of the scaled values removed",
        C,
        "y = jnp.clip(x * pow2(-e)[..., None], -qmax, qmax)",
        "y = x * pow2(-e)[..., None]",
        [K, "-k", "quantize"],
    ),
    (
        "exponent clip removed",
        C,
        "e = jnp.clip(e, SCALE_EXP_MIN, SCALE_EXP_MAX).astype(jnp.int32)",
        "e = e.astype(jnp.int32)",
        [K, "-k", "quantize"],
    ),
    (
        "pow2 off by one",
        C,
        "bits = (e.astype(jnp.int32) + 127) << 23",
        "bits = (e.astype(jnp.int32) + 126) << 23",
        [K, "-k", "quantize or layout"],
    ),
    (
        "exponent lanes read after the data, not at the block end",
        C,
        "exps = kv[..., kv.shape[-1] - 2 * num_kv_heads :].astype(jnp.float32)",
        "exps = kv[..., 2 * num_kv_heads * head_dim : 2 * num_kv_heads * (head_dim + 1)].astype(jnp.float32)",
        [K, "-k", "layout or reference_and_xla"],
    ),
    (
        "key and value exponents swapped on write",
        C,
        "exps = jnp.stack([ek, ev], axis=-1)",
        "exps = jnp.stack([ev, ek], axis=-1)",
        [K, "-k", "layout or reference_and_xla"],
    ),
    (
        "write_kv casts instead of quantizing",
        "jaxserve/models/attention.py",
        "rows = common.fuse_kv(k, v, lanes, shards, kv_pool.dtype)",
        "rows = common.fuse_kv(k, v, lanes, shards).astype(kv_pool.dtype)",
        [K, "-k", "write_kv"],
    ),
    (
        "C++: values scaled by the key exponent",
        CC,
        "static_cast<int>(t.value[row[e_off + 1]])",
        "static_cast<int>(t.value[row[e_off]])",
        [K, "-k", "cpu_decode"],
    ),
    (
        "C++: exponent lane of head h at + h, not + 2h",
        CC,
        "const int64_t e_off = s.lanes - 2 * s.num_kv_heads + 2 * kv_head;",
        "const int64_t e_off = s.lanes - 2 * s.num_kv_heads + kv_head;",
        [K, "-k", "cpu_decode"],
    ),
    (
        "C++: e4m3 subnormals mis-decoded",
        CC,
        "x = std::ldexp(static_cast<float>(man), -9);",
        "x = std::ldexp(static_cast<float>(man), -6);",
        [K, "-k", "cpu_decode"],
    ),
    (
        "TPU: exponent of head h at + h",
        T,
        "first = width - 2 * block_heads + 2 * h",
        "first = width - 2 * block_heads + h",
        [K, "-k", "tpu"],
    ),
    (
        "TPU: key and value factors swapped",
        T,
        "factor = jnp.where(half, scale(first), scale(first + 1))",
        "factor = jnp.where(half, scale(first + 1), scale(first))",
        [K, "-k", "tpu"],
    ),
    (
        "host tier / swap: the scale lanes not landed on the host",
        "jaxserve/runtime/kv_transfer.py",
        "host[:, host_pages] = np.asarray(a)[:, :n]",
        "host[:, host_pages, :, :-8] = np.asarray(a)[:, :n, :, :-8]",
        [E, "-k", "swap or host_tier"],
    ),
    (
        "fork: the scale lanes not copied",
        "jaxserve/runtime/kv_transfer.py",
        'lambda leaf: leaf.at[:, dst].set(jnp.take(leaf, src, axis=1), mode="drop"), pool',
        'lambda leaf: leaf.at[:, dst, :, :-8].set(jnp.take(leaf, src, axis=1)[..., :-8], mode="drop"), pool',
        [E, "-k", "prefix"],
    ),
    (
        "pool sized from the model dtype's pages",
        "jaxserve/runtime/builder.py",
        "aot.pool_page_bytes(model.config, config.page_size, kv_dtype, sharding)",
        "aot.pool_page_bytes(model.config, config.page_size, model.dtype, sharding)",
        [E, "-k", "sized"],
    ),
    (
        "Triton: exponent of head h at + h",
        "pallas_kernels/ragged_paged_attention/gpu_kernel.py",
        "e_lane = kv_ref.shape[3] - 2 * num_kv_heads + 2 * h",
        "e_lane = kv_ref.shape[3] - 2 * num_kv_heads + h",
        [K, "-k", "triton"],
    ),
    (
        "Triton: masked value exponents not zeroed",
        "pallas_kernels/ragged_paged_attention/gpu_kernel.py",
        "ev = plgpu.load(kv_ref.at[at_v], mask=seen, other=zero)",
        "ev = plgpu.load(kv_ref.at[at_v], mask=seen)",
        [K, "-k", "triton"],
    ),
]


def run(mutants, only=()) -> int:
    """Applies each mutant of `mutants` (all, or the indices in `only`) in turn: its tests run
    with -x against the changed file, which is then put back. Prints a line each; returns how
    many were killed (their tests failed; a run that collected no test kills nothing)."""
    killed = 0
    for i, (name, path, old, new, tests) in enumerate(mutants):
        if only and i not in only:
            continue
        f = ROOT / path
        src = f.read_text()
        assert src.count(old) == 1, (name, src.count(old))
        f.write_text(src.replace(old, new))
        t = time.time()
        try:
            r = subprocess.run(
                [PY, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                cwd=ROOT,
                env={
                    "PYTHONPATH": str(ROOT),
                    "PATH": "/usr/bin:/bin",
                    "HOME": str(pathlib.Path.home()),
                },
                capture_output=True,
                text=True,
                timeout=1200,
            )
            rc = r.returncode
            tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-300:]
        finally:
            f.write_text(src)
        status = {0: "SURVIVED", 5: "NO TESTS"}.get(rc, "KILLED")
        killed += status == "KILLED"
        print(f"{i:2d} {status:8s} {time.time() - t:6.0f}s  {name}  [{tail}]", flush=True)
    print(f"killed {killed}")
    return killed


if __name__ == "__main__":
    run(MUTANTS, {int(a) for a in sys.argv[1:]})
