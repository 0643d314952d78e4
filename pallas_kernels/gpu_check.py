"""GPU check of the ragged paged attention kernels: correctness natively, then speed.

    python -m pallas_kernels.gpu_check --out report.json [--batches 1,16,256] [--contexts 512,8192]
    python -m pallas_kernels.gpu_check --out report.json --dry-run   # on the CPU, see below

On a GPU it (1) runs both GPU kernels' tests from tests/kernels natively (no interpret mode, f32
matmuls at full precision): the Triton kernel's (test_ragged_paged_attention.py -k gpu) and the
Mosaic GPU kernel's (test_mosaic_gpu_kernel.py), (2) times decode steps, batches 1..256 at contexts
512..8192, of both kernels, the reference, and `jax.nn.dot_product_attention` over the same keys
laid out densely (what attention costs with no paging at all), checking each kernel's output
against the reference's at every point. A kernel that fails to compile or run at a point is
recorded there with its error and the sweep goes on. The JSON report gives times, the bandwidth
achieved on the keys and values read, and that bandwidth as a share of the device's peak (table
below): decode attention reads every cached key and value once and does little arithmetic per
byte, so bandwidth is its roofline. Each point's `kernel` (and its `max_abs_error_vs_reference`,
`speedup_vs_reference`) is the kernel `attention_backend="pallas"` picks on this device
(`kernel_name`: Mosaic GPU from compute capability 9.0, else Triton); `kernels` holds both.

On a machine without a GPU it prints why and exits with status 2, having run nothing, unless
`--dry-run`: then both kernels run in interpret mode on a tiny shape (one point, one timed call
each), to check this script's paths (the report, error capture) on the CPU; its times mean
nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import (
    common,
    gpu_kernel,
    mosaic_gpu_kernel,
    reference,
    tuning,
)

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


@dataclasses.dataclass(frozen=True)
class Shape:
    """One layer's attention shape for the sweep."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: type


# A Llama-3-8B layer's attention: 32 query heads over 8 KV heads of 128, bf16, pages of 16.
LLAMA3_8B = Shape(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=jnp.bfloat16)
# The dry run's: as small as both kernels take (interpret mode is slow).
DRY = Shape(num_heads=4, num_kv_heads=1, head_dim=64, page_size=16, dtype=jnp.bfloat16)
REPO_ROOT = Path(__file__).resolve().parents[1]
# Each GPU kernel's tests: (file, pytest -k expression or None for the whole file).
KERNEL_TESTS = {
    "triton": (REPO_ROOT / "tests" / "kernels" / "test_ragged_paged_attention.py", "gpu"),
    "mosaic": (REPO_ROOT / "tests" / "kernels" / "test_mosaic_gpu_kernel.py", None),
}


def peak_bandwidth(device_kind: str) -> float | None:
    for key in sorted(PEAK_BANDWIDTH, key=len, reverse=True):
        if key.lower() in device_kind.lower():
            return PEAK_BANDWIDTH[key]
    return None


def _run_tests(path: Path, select: str | None) -> dict:
    """One test file natively: pytest in a subprocess, its summary in the report."""
    if not path.exists():
        return {"status": "skipped", "reason": f"{path} not found (installed package?)"}
    env = dict(os.environ, JAXSERVE_GPU_NATIVE="1", JAX_DEFAULT_MATMUL_PRECISION="highest")
    cmd = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider"]
    cmd += ["-k", select] if select else []
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-40:]
    return {"status": "passed" if proc.returncode == 0 else "failed", "output_tail": tail}


def run_kernel_tests() -> dict:
    """Both GPU kernels' tests, natively; `status` is failed if either suite failed."""
    suites = {name: _run_tests(path, select) for name, (path, select) in KERNEL_TESTS.items()}
    statuses = {suite["status"] for suite in suites.values()}
    status = "failed" if "failed" in statuses else "passed" if "passed" in statuses else "skipped"
    tail = [
        f"[{name}] {line}"
        for name, suite in suites.items()
        for line in suite.get("output_tail", [])
    ]
    return {"status": status, "output_tail": tail[-60:], "suites": suites}


def decode_inputs(batch: int, context: int, shape: Shape, seed: int = 0) -> tuple:
    """One decode token per sequence, each with `context` cached tokens in shuffled pages."""
    rng = np.random.default_rng(seed)
    pages_per_seq = context // shape.page_size
    num_pages = batch * pages_per_seq
    page_tables = rng.permutation(num_pages).astype(np.int32).reshape(batch, pages_per_seq)
    key_kv, key_q = jax.random.split(jax.random.key(seed), 2)
    # Keys and values side by side per head (common.fuse_kv), random either way.
    pool = (1, num_pages, shape.page_size, 2 * shape.num_kv_heads * shape.head_dim)
    return (
        jax.random.normal(key_q, (batch, shape.num_heads, shape.head_dim), shape.dtype),
        jax.random.normal(key_kv, pool, shape.dtype),
        jnp.int32(0),
        jnp.arange(batch + 1, dtype=jnp.int32),
        jnp.full((batch,), context, jnp.int32),
        jnp.asarray(page_tables),
        jnp.int32(batch),
    )


def dense_attention_fn(args: tuple, shape: Shape):
    """jax.nn.dot_product_attention over the same keys gathered densely (gather not timed)."""
    q, kv_pool, _, _, _, page_tables, _ = args
    batch, pages_per_seq = page_tables.shape
    dense = (batch, pages_per_seq * shape.page_size, shape.num_kv_heads, shape.head_dim)
    k, v = common.split_kv(kv_pool[0, page_tables], shape.num_kv_heads, shape.head_dim)
    k, v = k.reshape(dense), v.reshape(dense)
    q = q[:, None]  # [B, 1, H, D]
    for implementation in ("cudnn", "xla"):
        fn = jax.jit(
            lambda q, k, v, impl=implementation: jax.nn.dot_product_attention(
                q, k, v, scale=shape.head_dim**-0.5, implementation=impl
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


def _error(e: Exception) -> str:
    """A compile or run error for the report: its type, head and tail (Mosaic's are long)."""
    text = str(e)
    if len(text) > 700:
        text = f"{text[:500]} [...] {text[-200:]}"
    return f"{type(e).__name__}: {text}"


def kernels_to_time(dry_run: bool) -> dict:
    """Both GPU kernels by name, as (q, pool, ..., sm_scale=) functions; interpret mode if dry."""
    triton, mosaic = gpu_kernel.ragged_paged_attention, mosaic_gpu_kernel.ragged_paged_attention
    if dry_run:
        interpret = mosaic_gpu_kernel.interpret_params()
        return {
            "mosaic": functools.partial(mosaic, interpret=interpret),
            "triton": functools.partial(triton, interpret=True),
        }
    return {"mosaic": mosaic, "triton": triton}


def bench_point(
    batch: int,
    context: int,
    peak: float | None,
    memory: int | None,
    *,
    shape: Shape = LLAMA3_8B,
    kernels: dict | None = None,
    default: str = "mosaic",
    timing: dict | None = None,
) -> dict:
    """One (batch, context) point: every kernel, the reference and dense attention, timed."""
    args = decode_inputs(batch, context, shape)
    kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim
    kv_bytes *= jnp.dtype(shape.dtype).itemsize
    point: dict = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
    sm_scale = shape.head_dim**-0.5
    kernels = kernels if kernels is not None else kernels_to_time(dry_run=False)
    timing = timing or {}

    def record(fn, fn_args) -> dict:
        try:
            seconds = time_fn(fn, fn_args, **timing)
        except Exception as e:  # a compile error, or out of memory: keep the rest of the sweep
            return {"error": _error(e)}
        bandwidth = kv_bytes / seconds
        return {
            "us": round(seconds * 1e6, 2),
            "gb_per_s": round(bandwidth / 1e9, 1),
            "share_of_peak": round(bandwidth / peak, 3) if peak else None,
        }

    want = None
    # The reference materialises keys and values per query row (and the dense copy doubles
    # them); skip where that would not fit comfortably.
    if memory is None or 3 * kv_bytes < memory // 2:
        ref = jax.jit(lambda *a: reference.ragged_paged_attention(*a, sm_scale=sm_scale))
        point["reference"] = record(ref, args)
        if "us" in point["reference"]:
            want = np.asarray(ref(*args), np.float32)
        implementation, dense_fn, dense_args = dense_attention_fn(args, shape)
        if dense_fn is not None:
            point[f"dot_product_attention_{implementation}"] = record(dense_fn, dense_args)
        del dense_args
    else:
        point["reference"] = {"skipped": "too large for device memory"}

    point["kernels"] = {}
    for name, kernel in kernels.items():
        fn = jax.jit(functools.partial(kernel, sm_scale=sm_scale))
        entry = record(fn, args)
        if "us" in entry and want is not None:
            try:
                got = np.asarray(fn(*args), np.float32)
                entry["max_abs_error_vs_reference"] = float(np.abs(got - want).max())
            except Exception as e:
                entry["error"] = _error(e)
            entry["speedup_vs_reference"] = round(point["reference"]["us"] / entry["us"], 2)
        point["kernels"][name] = entry
    # The kernel `attention_backend="pallas"` runs on this device, under the report's old keys.
    chosen = point["kernels"].get(default, {})
    point["kernel_name"] = default
    point["kernel"] = {
        k: v for k, v in chosen.items() if k in ("us", "gb_per_s", "share_of_peak", "error")
    }
    for key in ("max_abs_error_vs_reference", "speedup_vs_reference"):
        if key in chosen:
            point[key] = chosen[key]
    return point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON report")
    parser.add_argument("--batches", default=None, help="default 1,4,16,64,256 (dry run: 1)")
    parser.add_argument("--contexts", default=None, help="default 512,...,8192 (dry run: 64)")
    parser.add_argument("--skip-tests", action="store_true", help="only time, do not run tests")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="on the CPU: both kernels in interpret mode, a tiny shape, no tests",
    )
    args = parser.parse_args(argv)

    if jax.default_backend() != "gpu" and not args.dry_run:
        print(
            f"gpu_check needs a GPU, but JAX runs on {jax.default_backend()!r} "
            f"({jax.devices()[0].device_kind}); nothing was run. On the CPU, the kernel tests run "
            "in interpret mode: pytest tests/kernels/ (and --dry-run checks this script).",
            file=sys.stderr,
        )
        return 2

    from pallas_kernels.ragged_paged_attention import kernel_choice

    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    shape = DRY if args.dry_run else LLAMA3_8B
    peak = None if args.dry_run else peak_bandwidth(device.device_kind)
    memory = (device.memory_stats() or {}).get("bytes_limit")
    report: dict = {
        "device_kind": device.device_kind,
        "compute_capability": capability,
        "jax_version": jax.__version__,
        "dry_run": args.dry_run,
        "peak_bandwidth_gb_per_s": peak / 1e9 if peak else None,
        "block_sizes": repr(tuning.gpu_block_sizes(device.device_kind)),
        "shape": {
            "num_heads": shape.num_heads,
            "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "page_size": shape.page_size,
            "dtype": jnp.dtype(shape.dtype).name,
        },
    }
    if not args.skip_tests and not args.dry_run:
        report["tests"] = run_kernel_tests()
        print(f"kernel tests: {report['tests']['status']}", flush=True)
    point_args = dict(
        shape=shape,
        kernels=kernels_to_time(args.dry_run),
        # The kernel jaxserve's `pallas` backend picks for this shape (the CPU has no
        # capability to choose by: triton).
        default="mosaic"
        if kernel_choice.choose_gpu_kernel(
            capability,
            shape.dtype,
            head_dim=shape.head_dim,
            page_size=shape.page_size,
            num_q_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
        )
        == kernel_choice.MOSAIC_GPU
        else "triton",
        timing=dict(iters=1, reps=1) if args.dry_run else None,
    )
    batches = args.batches or ("1" if args.dry_run else "1,4,16,64,256")
    contexts = args.contexts or ("64" if args.dry_run else "512,1024,2048,4096,8192")
    points = []
    for context in (int(c) for c in contexts.split(",")):
        for batch in (int(b) for b in batches.split(",")):
            point = bench_point(batch, context, peak, memory, **point_args)
            points.append(point)
            print(json.dumps(point), flush=True)
            args.out.write_text(json.dumps(report | {"decode": points}, indent=2))
    report["decode"] = points
    args.out.write_text(json.dumps(report, indent=2))
    failed = report.get("tests", {}).get("status") == "failed"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
