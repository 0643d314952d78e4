"""GPU check of the ragged paged attention kernel: correctness natively, then speed.

    python -m pallas_kernels.gpu_check --out report.json [--batches 1,16,256] [--contexts 512,8192]

On a GPU it (1) runs the GPU kernel's tests from tests/kernels natively (no interpret mode, f32
matmuls at full precision), (2) times decode steps, batches 1..256 at contexts 512..8192, of the
kernel, the reference, and `jax.nn.dot_product_attention` over the same keys laid out densely
(what attention costs with no paging at all), checking the kernel's output against the
reference's at every point. The JSON report gives times, the bandwidth achieved on the keys and
values read, and that bandwidth as a share of the device's peak (table below): decode attention
reads every cached key and value once and does little arithmetic per byte, so bandwidth is its
roofline. On a machine without a GPU it prints why and exits with status 2, having run nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import gpu_kernel, reference, tuning

# Peak HBM bandwidth in bytes/s, from vendor data sheets, matched by substring of device_kind
# (longest key first, so "H100 PCIe" wins over "H100").
PEAK_BANDWIDTH = {
    "B200": 8.0e12,
    "H200": 4.8e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,  # SXM, HBM3
    "A100-SXM4-80GB": 2.039e12,
    "A100-PCIE-80GB": 1.935e12,
    "A100": 1.555e12,  # 40 GB
    "L40S": 0.864e12,
    "A10G": 0.6e12,
    "L4": 0.3e12,
}

# A Llama-3-8B layer's attention: 32 query heads over 8 KV heads of 128, bf16, pages of 16.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
DTYPE = jnp.bfloat16
REPO_ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = REPO_ROOT / "tests" / "kernels" / "test_ragged_paged_attention.py"


def peak_bandwidth(device_kind: str) -> float | None:
    for key in sorted(PEAK_BANDWIDTH, key=len, reverse=True):
        if key.lower() in device_kind.lower():
            return PEAK_BANDWIDTH[key]
    return None


def run_kernel_tests() -> dict:
    """The GPU kernel's tests, natively: pytest in a subprocess, its summary in the report."""
    if not KERNEL_TESTS.exists():
        return {"status": "skipped", "reason": f"{KERNEL_TESTS} not found (installed package?)"}
    env = dict(os.environ, JAXSERVE_GPU_NATIVE="1", JAX_DEFAULT_MATMUL_PRECISION="highest")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(KERNEL_TESTS),
        "-q",
        "-k",
        "gpu",
        "-p",
        "no:cacheprovider",
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-40:]
    return {"status": "passed" if proc.returncode == 0 else "failed", "output_tail": tail}


def decode_inputs(batch: int, context: int, seed: int = 0) -> tuple:
    """One decode token per sequence, each with `context` cached tokens in shuffled pages."""
    rng = np.random.default_rng(seed)
    pages_per_seq = context // PAGE_SIZE
    num_pages = batch * pages_per_seq
    page_tables = rng.permutation(num_pages).astype(np.int32).reshape(batch, pages_per_seq)
    key_k, key_v, key_q = jax.random.split(jax.random.key(seed), 3)
    shape = (1, num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return (
        jax.random.normal(key_q, (batch, NUM_HEADS, HEAD_DIM), DTYPE),
        jax.random.normal(key_k, shape, DTYPE),
        jax.random.normal(key_v, shape, DTYPE),
        jnp.int32(0),
        jnp.arange(batch + 1, dtype=jnp.int32),
        jnp.full((batch,), context, jnp.int32),
        jnp.asarray(page_tables),
        jnp.int32(batch),
    )


def dense_attention_fn(args: tuple):
    """jax.nn.dot_product_attention over the same keys gathered densely (gather not timed)."""
    q, k_pool, v_pool, _, _, _, page_tables, _ = args
    batch, pages_per_seq = page_tables.shape
    dense = (batch, pages_per_seq * PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k = k_pool[0, page_tables].reshape(dense)
    v = v_pool[0, page_tables].reshape(dense)
    q = q[:, None]  # [B, 1, H, D]
    for implementation in ("cudnn", "xla"):
        fn = jax.jit(
            lambda q, k, v, impl=implementation: jax.nn.dot_product_attention(
                q, k, v, scale=HEAD_DIM**-0.5, implementation=impl
            )
        )
        try:
            fn(q, k, v).block_until_ready()
            return implementation, fn, (q, k, v)
        except Exception:  # cudnn refuses some shapes (e.g. one query): try the next
            continue
    return None, None, None


def time_fn(fn, args: tuple, iters: int = 20, reps: int = 5) -> float:
    """Median seconds per call; calls are queued back to back so dispatch overlaps the GPU."""
    out = fn(*args)
    jax.block_until_ready(out)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return float(np.median(samples))


def bench_point(batch: int, context: int, peak: float | None, memory: int | None) -> dict:
    args = decode_inputs(batch, context)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * jnp.dtype(DTYPE).itemsize
    point: dict = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
    kernel = jax.jit(lambda *a: gpu_kernel.ragged_paged_attention(*a, sm_scale=HEAD_DIM**-0.5))
    ref = jax.jit(lambda *a: reference.ragged_paged_attention(*a, sm_scale=HEAD_DIM**-0.5))

    def record(name: str, fn, fn_args) -> None:
        try:
            seconds = time_fn(fn, fn_args)
        except Exception as e:  # out of memory on big points: keep the rest of the sweep
            point[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            return
        bandwidth = kv_bytes / seconds
        point[name] = {
            "us": round(seconds * 1e6, 2),
            "gb_per_s": round(bandwidth / 1e9, 1),
            "share_of_peak": round(bandwidth / peak, 3) if peak else None,
        }

    record("kernel", kernel, args)
    # The reference materialises keys and values per query row (and the dense copy doubles
    # them); skip where that would not fit comfortably.
    if memory is None or 3 * kv_bytes < memory // 2:
        record("reference", ref, args)
        got = np.asarray(kernel(*args), np.float32)
        want = np.asarray(ref(*args), np.float32)
        point["max_abs_error_vs_reference"] = float(np.abs(got - want).max())
        implementation, dense_fn, dense_args = dense_attention_fn(args)
        if dense_fn is not None:
            record(f"dot_product_attention_{implementation}", dense_fn, dense_args)
        del dense_args
    else:
        point["reference"] = {"skipped": "too large for device memory"}
    if "us" in point["kernel"] and "us" in point.get("reference", {}):
        point["speedup_vs_reference"] = round(point["reference"]["us"] / point["kernel"]["us"], 2)
    return point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON report")
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--contexts", default="512,1024,2048,4096,8192")
    parser.add_argument("--skip-tests", action="store_true", help="only time, do not run tests")
    args = parser.parse_args(argv)

    if jax.default_backend() != "gpu":
        print(
            f"gpu_check needs a GPU, but JAX runs on {jax.default_backend()!r} "
            f"({jax.devices()[0].device_kind}); nothing was run. On the CPU, the kernel tests run "
            "in interpret mode: pytest tests/kernels/",
            file=sys.stderr,
        )
        return 2

    device = jax.devices()[0]
    peak = peak_bandwidth(device.device_kind)
    memory = (device.memory_stats() or {}).get("bytes_limit")
    report: dict = {
        "device_kind": device.device_kind,
        "jax_version": jax.__version__,
        "peak_bandwidth_gb_per_s": peak / 1e9 if peak else None,
        "block_sizes": repr(tuning.gpu_block_sizes(device.device_kind)),
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "page_size": PAGE_SIZE,
            "dtype": jnp.dtype(DTYPE).name,
        },
    }
    if not args.skip_tests:
        report["tests"] = run_kernel_tests()
        print(f"kernel tests: {report['tests']['status']}", flush=True)
    points = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            point = bench_point(batch, context, peak, memory)
            points.append(point)
            print(json.dumps(point), flush=True)
            args.out.write_text(json.dumps(report | {"decode": points}, indent=2))
    report["decode"] = points
    args.out.write_text(json.dumps(report, indent=2))
    failed = report.get("tests", {}).get("status") == "failed"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
