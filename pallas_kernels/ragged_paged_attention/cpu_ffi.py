"""The CPU's native attention (cpu_decode.cc) and matmul (cpu_matmul.cc) as XLA FFI calls:
built once into one library, then cached.

XLA:CPU has no Pallas compiler, and the jnp loops (xla_blocked._decode, _prefill_tiles) spend
most of their time gathering each key block out of the pool and transposing it for the matmuls,
and in the loops' own per-trip overhead. The C++ calls read the keys and values in place:
`ragged_attention` runs every row of a step (on CPUs with AVX-512 and head sizes 32, 64, 128
or 256: `ragged_available`), `decode_attention` the decode rows alone (any head size; the jnp
tiles then run the prefill rows). `packed_matmul` multiplies by weights `pack_weight` laid
out once in panels of 64 columns (the model's `packed_weights`), where XLA's dot repacks them
on every call; `grouped_packed_matmul` does the same for a mixture of experts' rows sorted by
expert, each run of rows against its own expert's panels. `packed_matmul_int8` and
`grouped_packed_matmul_int8` (cpu_matmul_int8.cc) multiply by the same panels in int8 with
per-column scales (`pack_weight_int8`): weight-only for decode, or W8A8 (per-row int8
activations, VNNI's exact int32 sums) for prefill. The library is built on first use with the
machine's g++ against jaxlib's FFI headers into $JAXSERVE_CACHE_DIR (default
~/.cache/jaxserve)/ffi, keyed by the source, the jaxlib version, the compiler flags and the
CPU's features, so a second process loads the same library without building (about 4 s
once). Where there is no compiler, or $JAXSERVE_CPU_FFI=0, `available()` is False and the jnp
path runs instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import common

_HERE = pathlib.Path(__file__).parent
_SOURCES = (_HERE / "cpu_decode.cc", _HERE / "cpu_matmul.cc", _HERE / "cpu_matmul_int8.cc")
_HEADERS = (_HERE / "cpu_pool.h",)
_TARGET = "jaxserve_decode_attention"
_Q8_TARGET = "jaxserve_decode_attention_q8"
_WRITE_ROWS_TARGET = "jaxserve_write_rows"
_RAGGED_TARGET = "jaxserve_ragged_attention"
_FUSED_TARGET = "jaxserve_rope_write_attention"
_MATMUL_TARGET = "jaxserve_packed_matmul"
_GROUPED_MATMUL_TARGET = "jaxserve_grouped_packed_matmul"
_INT8_MATMUL_TARGET = "jaxserve_packed_matmul_int8"
_GROUPED_INT8_MATMUL_TARGET = "jaxserve_grouped_packed_matmul_int8"
# -ffp-contract=off: RoPE's products and sums stay unfused, as XLA:CPU computes them (the kernels'
# own FMAs are written out as intrinsics).
_FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-ffp-contract=off",
    "-fopenmp-simd",
    "-std=c++17",
    "-fPIC",
)
log = logging.getLogger(__name__)


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("JAXSERVE_CACHE_DIR") or os.path.expanduser("~/.cache/jaxserve")
    return pathlib.Path(root) / "ffi"


def _cpu_flags() -> str:
    """The CPU's architecture and feature flags (Linux's /proc/cpuinfo), for the cache key."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags.strip()}"


def _build() -> pathlib.Path:
    """The shared library's path, compiling it first if this source and jaxlib have none."""
    import jaxlib

    # -march=native: a cache shared between machines (a network home) must not hand one CPU's
    # instructions to another, so the CPU's feature flags are part of the key.
    sources = tuple(p.read_bytes() for p in (*_SOURCES, *_HEADERS))
    parts = (sources, jaxlib.__version__, " ".join(_FLAGS), _cpu_flags())
    key = hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_decode-{key}.so"
    if out.exists():
        return out
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("Building the CPU kernels into %s (once per machine, a few seconds).", out)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = pathlib.Path(tmp) / out.name
        cmd = [compiler, *_FLAGS, "-shared", f"-I{jax.ffi.include_dir()}", f"-I{_HERE}"]
        cmd += [*map(str, _SOURCES), "-o"]
        done = subprocess.run([*cmd, str(part)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
        os.replace(part, out)  # atomic: a concurrent process sees the whole library or none
    return out


@functools.cache
def available() -> bool:
    """Whether the native decode attention is registered for the CPU (built and loaded)."""
    if os.environ.get("JAXSERVE_CPU_FFI", "1") == "0":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(
            _TARGET, jax.ffi.pycapsule(lib.JaxserveDecodeAttention), platform="cpu"
        )
        jax.ffi.register_ffi_target(
            _Q8_TARGET, jax.ffi.pycapsule(lib.JaxserveDecodeAttentionQ8), platform="cpu"
        )
        jax.ffi.register_ffi_target(
            _WRITE_ROWS_TARGET, jax.ffi.pycapsule(lib.JaxserveWriteRows), platform="cpu"
        )
        jax.ffi.register_ffi_target(
            _RAGGED_TARGET, jax.ffi.pycapsule(lib.JaxserveRaggedAttention), platform="cpu"
        )
        jax.ffi.register_ffi_target(
            _FUSED_TARGET, jax.ffi.pycapsule(lib.JaxserveRopeWriteAttention), platform="cpu"
        )
        jax.ffi.register_ffi_target(
            _MATMUL_TARGET, jax.ffi.pycapsule(lib.JaxservePackedMatmul), platform="cpu"
        )
        jax.ffi.register_ffi_target(
            _GROUPED_MATMUL_TARGET,
            jax.ffi.pycapsule(lib.JaxserveGroupedPackedMatmul),
            platform="cpu",
        )
        jax.ffi.register_ffi_target(
            _INT8_MATMUL_TARGET, jax.ffi.pycapsule(lib.JaxservePackedMatmulInt8), platform="cpu"
        )
        jax.ffi.register_ffi_target(
            _GROUPED_INT8_MATMUL_TARGET,
            jax.ffi.pycapsule(lib.JaxserveGroupedPackedMatmulInt8),
            platform="cpu",
        )
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU decode attention falls back to the jnp loop: %s", e)
        return False
    return True


def decode_attention(
    q: jax.Array,  # f32[S, num_kv_heads, group, head_dim], unscaled
    kv_pool: jax.Array,  # f32, i8 or f8e4m3fn[num_layers, num_pages, page_size, lanes] (fuse_kv)
    layer: jax.Array,  # i32[]
    page_tables: jax.Array,  # i32[S, P]
    kv_len: jax.Array,  # i32[S] context of each decoding slot; 0 for every other slot
    lowest: jax.Array,  # i32[S] first visible position (sliding window; 0 without one)
    sm_scale: float,
) -> jax.Array:  # f32[S, num_kv_heads, group, head_dim]; slots with kv_len 0 are 0
    """Softmax(q k^T * sm_scale) v over each slot's keys [lowest, kv_len), read from its pages.

    A quantized pool (int8 or e4m3 with its scale lanes, common.fuse_kv) goes to the 8-bit call,
    which dequantizes each row it reads (values times 2^e) in float32."""
    target = _Q8_TARGET if common.is_quantized(kv_pool.dtype) else _TARGET
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32),
        kv_pool,
        jnp.asarray(layer, jnp.int32),
        page_tables.astype(jnp.int32),
        kv_len.astype(jnp.int32),
        lowest.astype(jnp.int32),
        sm_scale=np.float32(sm_scale),
    )


def write_rows(
    kv_pool: jax.Array,  # i8 | f8e4m3[L, P, page_size, lanes], donated by the caller's step
    layer: jax.Array,  # i32[]
    rows: jax.Array,  # [T, lanes], the pool's dtype (common.fuse_kv's quantized rows)
    slot_mapping: jax.Array,  # i32[T] page * page_size + offset; out of range: dropped
) -> jax.Array:  # the pool with the rows written, in place
    """`kv_pool.at[layer, page, offset].set(rows, mode="drop")` for an 8-bit pool, in C++ on the
    pool's own buffer (aliased): XLA:CPU has no float8 scatter and widened the whole pool to
    float16 and back around every layer's write."""
    if not available():
        raise RuntimeError("write_rows needs the CPU kernels' library, which did not load.")
    if jnp.dtype(kv_pool.dtype).itemsize != 1 or rows.dtype != kv_pool.dtype:
        raise ValueError(
            f"write_rows takes an 8-bit pool and rows of its dtype; got a {kv_pool.dtype} pool "
            f"and {rows.dtype} rows."
        )
    call = jax.ffi.ffi_call(
        _WRITE_ROWS_TARGET,
        jax.ShapeDtypeStruct(kv_pool.shape, kv_pool.dtype),
        input_output_aliases={0: 0},
    )
    return call(kv_pool, jnp.asarray(layer, jnp.int32), rows, jnp.asarray(slot_mapping, jnp.int32))


RAGGED_HEAD_DIMS = (32, 64, 128, 256)  # cpu_decode.cc's AttendSlot and PrefillRows


def ragged_available(head_dim: int) -> bool:
    """Whether `ragged_attention` runs for `head_dim` here: the library is loaded, the head size
    is one the vectorised kernels take, and this CPU has AVX-512 (the build is -march=native)."""
    return head_dim in RAGGED_HEAD_DIMS and available() and "avx512f" in _cpu_flags().split()


def ragged_runs_here(q: jax.Array, kv_pool: jax.Array, head_dim: int) -> bool:
    """Whether a step may lower to `ragged_attention` or `rope_write_attention` in this process:
    float32 q and pool, the CPU as the default backend, and `ragged_available(head_dim)`."""
    return (
        q.dtype == jnp.float32
        and kv_pool.dtype == jnp.float32
        and jax.default_backend() == "cpu"
        and ragged_available(head_dim)
    )


def _ragged_args(kv_pool, layer, query_start, kv_lens, page_tables, num_seqs, sm_scale, window):
    """The arguments and attributes both ragged calls end with, in their C++ types."""
    args = (
        kv_pool,
        jnp.asarray(layer, jnp.int32),
        query_start.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        page_tables.astype(jnp.int32),
        jnp.asarray(num_seqs, jnp.int32),
    )
    return args, dict(sm_scale=np.float32(sm_scale), window=np.int32(window or 0))


def ragged_attention(
    q: jax.Array,  # f32[T, num_kv_heads, group, head_dim], unscaled
    kv_pool: jax.Array,  # f32[num_layers, num_pages, page_size, lanes] (common.fuse_kv)
    layer: jax.Array,  # i32[]
    query_start: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S] each sequence's context, this step's tokens included
    page_tables: jax.Array,  # i32[S, P]
    num_seqs: jax.Array,  # i32[]
    sm_scale: float,
    sliding_window: int | None,
) -> jax.Array:  # f32[T, num_kv_heads, group, head_dim]; padding rows are 0
    """Causal attention of every row of the step (decode rows and prefill chunks) over its
    sequence's keys, read from the pages; a row at position p sees [p - window + 1, p]."""
    call = jax.ffi.ffi_call(_RAGGED_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    args, attrs = _ragged_args(
        kv_pool, layer, query_start, kv_lens, page_tables, num_seqs, sm_scale, sliding_window
    )
    return call(q.astype(jnp.float32), *args, **attrs)


def rope_write_attention(
    q: jax.Array,  # f32[T, num_kv_heads, group, head_dim], before RoPE
    k: jax.Array,  # f32[T, num_kv_heads, head_dim], before RoPE
    v: jax.Array,  # f32[T, num_kv_heads, head_dim]
    cos: jax.Array,  # f32[T, head_dim]
    sin: jax.Array,  # f32[T, head_dim]
    slot_mapping: jax.Array,  # i32[T] page * page_size + offset; out of range for padding
    kv_pool: jax.Array,  # f32[num_layers, num_pages, page_size, lanes] (common.fuse_kv)
    layer: jax.Array,  # i32[]
    query_start: jax.Array,  # i32[S + 1]
    kv_lens: jax.Array,  # i32[S]
    page_tables: jax.Array,  # i32[S, P]
    num_seqs: jax.Array,  # i32[]
    sm_scale: float,
    sliding_window: int | None,
) -> tuple[jax.Array, jax.Array]:  # out f32[T, num_kv_heads, group, head_dim], the new pool
    """RoPE on q and k, this step's keys and values written into `layer` of the pool, then
    `ragged_attention`: one call for the attention block between its projections. The pool is
    updated in place (donate it, as the step does, or XLA copies it first)."""
    f32 = jnp.float32
    call = jax.ffi.ffi_call(
        _FUSED_TARGET,
        (jax.ShapeDtypeStruct(q.shape, f32), jax.ShapeDtypeStruct(kv_pool.shape, kv_pool.dtype)),
        input_output_aliases={6: 1},
    )
    args, attrs = _ragged_args(
        kv_pool, layer, query_start, kv_lens, page_tables, num_seqs, sm_scale, sliding_window
    )
    rows = (q, k, v, cos, sin)
    return call(*(x.astype(f32) for x in rows), slot_mapping.astype(jnp.int32), *args, **attrs)


PANEL = 64  # cpu_matmul.cc's kLanes: output columns per packed panel


def packed_matmul_available() -> bool:
    """Whether `packed_matmul` runs its vector kernel here: the library is loaded and this CPU
    has AVX-512 (elsewhere the call is exact but scalar, so the model keeps XLA's dot)."""
    return available() and "avx512f" in _cpu_flags().split()


@functools.cache
def matmul_k_block() -> int:
    """The k per block of a panel in `packed_matmul` on this CPU; 0: whole-K tiles.

    Measured with docs/history/matmul_packed.py on small's 30 layers: on a 2-core Xeon, blocks of
    64 k (each read from L1 by every row tile while the next is prefetched) took 16 rows 41.5 ->
    32.2 ms and 64 rows 71.0 -> 58.6; on a 2-core Zen 4 EPYC the same blocks were slower than
    whole-K tiles (64 rows 81 against 71-75 ms, 256 rows 311-357 against 258-269), whose rows of
    x stream in order while the panel sits in the larger L2. Both give the same bits.
    $JAXSERVE_CPU_MATMUL_K_BLOCK overrides it."""
    env = os.environ.get("JAXSERVE_CPU_MATMUL_K_BLOCK")
    if env is not None:
        if not env.isdigit():
            raise ValueError(
                f"JAXSERVE_CPU_MATMUL_K_BLOCK is 0 (whole-K tiles) or a positive count of k; "
                f"got {env!r}."
            )
        return int(env)
    return 0 if _cpu_vendor() == "AuthenticAMD" else 64


def _cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"; "" elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def pack_weight(w: jax.Array) -> jax.Array:  # w: [..., K, N] -> [..., N / PANEL, K, PANEL]
    """`w` in the panels `packed_matmul` reads: panel p is columns [64p, 64p + 64) of every row,
    contiguous. Leading axes (a stacked layer axis) are kept."""
    *lead, k, n = w.shape
    if n % PANEL:
        raise ValueError(f"A weight of {n} output columns does not fill panels of {PANEL}.")
    return jnp.swapaxes(w.reshape(*lead, k, n // PANEL, PANEL), -3, -2)


def unpack_weight(wp: jax.Array) -> jax.Array:  # wp: [..., P, K, PANEL] -> [..., K, P * PANEL]
    """The inverse of `pack_weight`."""
    *lead, p, k, lanes = wp.shape
    return jnp.swapaxes(wp, -3, -2).reshape(*lead, k, p * lanes)


def packed_matmul(
    x: jax.Array,  # f32[..., K]
    wp: jax.Array,  # f32[N / PANEL, K, PANEL] (pack_weight)
    valid: jax.Array | int | None = None,  # i32[]: rows of x (flattened) that are real
    k_block: int | None = None,
) -> jax.Array:  # f32[..., N]
    """x @ w for `wp = pack_weight(w)`: each output one chain of fused multiply-adds over k in
    order, so a row's result does not depend on the rows beside it (cpu_matmul.cc).

    `valid` (a step's real token count, known only on the device): rows from it on are padding,
    not computed, and come back 0; None computes every row. `k_block`: how a panel is cut along
    k (`matmul_k_block`, this CPU's choice, where None); it changes the speed, not the bits."""
    *lead, k = x.shape
    p, wk, lanes = wp.shape
    if wk != k or lanes != PANEL:
        raise ValueError(
            f"packed_matmul takes x [..., K] and weights [N / {PANEL}, K, {PANEL}]; got x "
            f"{tuple(x.shape)} and weights {tuple(wp.shape)}."
        )
    if not available():
        raise RuntimeError("packed_matmul needs the CPU kernels' library, which did not load.")
    rows = math.prod(lead)
    call = jax.ffi.ffi_call(_MATMUL_TARGET, jax.ShapeDtypeStruct((rows, p * PANEL), jnp.float32))
    valid = jnp.asarray(rows if valid is None else valid, jnp.int32)
    if valid.shape != ():
        raise ValueError(f"packed_matmul's valid is a count of rows, one int32; got {valid.shape}.")
    k_block = matmul_k_block() if k_block is None else k_block
    if k_block < 0:
        raise ValueError(f"packed_matmul's k_block is 0 (whole-K tiles) or more; got {k_block}.")
    out = call(
        x.reshape(rows, k).astype(jnp.float32),
        wp.astype(jnp.float32),
        valid,
        k_block=np.int64(k_block),
    )
    return out.reshape(*lead, p * PANEL)


def grouped_packed_matmul(
    x: jax.Array,  # f32[M, K] rows sorted by group
    wp: jax.Array,  # f32[G, N / PANEL, K, PANEL] (pack_weight of w f32[G, K, N])
    group_sizes: jax.Array,  # i32[G] rows of each group in order; rows past their sum: padding
    k_block: int | None = None,
) -> jax.Array:  # f32[M, N]: row r of group g is x[r] @ w[g]; rows past the groups are 0
    """A mixture-of-experts layer's grouped matmul on the CPU: XLA:CPU lowers `jax.lax.ragged_dot`
    to a dense dot masked per group (G times the multiply-adds), where this call multiplies each
    row by its own group's weights alone and never reads a group's weights without rows.

    Each element is `packed_matmul`'s chain of fused multiply-adds, so a row's bits are those of
    `packed_matmul(x[r:r+1], wp[g])`, whatever rows share the call. `group_sizes` is data (the
    router's counts, known only on the device): a negative size counts as 0 and the runs stop at
    M. `k_block` as in `packed_matmul`. It runs its vector kernel wherever
    `packed_matmul_available()` (one library, one CPU check), so it has no check of its own."""
    if x.ndim != 2 or wp.ndim != 4 or wp.shape[2] != x.shape[1] or wp.shape[3] != PANEL:
        raise ValueError(
            f"grouped_packed_matmul takes x [M, K] and weights [G, N / {PANEL}, K, {PANEL}]; "
            f"got x {tuple(x.shape)} and weights {tuple(wp.shape)}."
        )
    groups, panels = wp.shape[:2]
    group_sizes = jnp.asarray(group_sizes)
    if group_sizes.shape != (groups,):
        raise ValueError(
            f"grouped_packed_matmul takes one size per group of the weights, {groups}; got "
            f"group_sizes of shape {tuple(group_sizes.shape)}."
        )
    if not available():
        raise RuntimeError(
            "grouped_packed_matmul needs the CPU kernels' library, which did not load."
        )
    k_block = matmul_k_block() if k_block is None else k_block
    if k_block < 0:
        raise ValueError(
            f"grouped_packed_matmul's k_block is 0 (whole-K tiles) or more; got {k_block}."
        )
    call = jax.ffi.ffi_call(
        _GROUPED_MATMUL_TARGET, jax.ShapeDtypeStruct((x.shape[0], panels * PANEL), jnp.float32)
    )
    return call(
        x.astype(jnp.float32),
        wp.astype(jnp.float32),
        group_sizes.astype(jnp.int32),
        k_block=np.int64(k_block),
    )


# ---- int8 weights (issue 43): cpu_matmul_int8.cc ----

ACTIVATIONS = ("float", "int8")  # packed_matmul_int8's modes: weight-only, W8A8
# W8A8's exact int32 sums: |sum_k xq * wq| <= 127 * 127 * K must stay below 2**31.
W8A8_MAX_K = (2**31 - 1) // (127 * 127)


def int8_matmul_available(activations: str = "float") -> bool:
    """Whether `packed_matmul_int8` runs its vector kernel here for `activations`: weight-only
    needs AVX-512F, W8A8 also AVX512-BW and AVX512-VNNI (vpdpbusd). Elsewhere the calls are
    exact but scalar, the same bits, too slow to serve."""
    flags = _cpu_flags().split()
    need = {"float": ["avx512f"], "int8": ["avx512f", "avx512bw", "avx512_vnni"]}[activations]
    return available() and all(f in flags for f in need)


def pack_weight_int8(
    w: jax.Array,  # f32[..., K, N]
) -> tuple[jax.Array, jax.Array]:  # wq i8[..., N / PANEL, K, PANEL], scales f32[..., N]
    """`w` quantized for `packed_matmul_int8`: a quarter of float32's bytes, which is what a
    decode step on the CPU streams from memory. Per output column, symmetric: scale[n] =
    max_k |w[k, n]| / 127 (a column of zeros: 1) and wq = round-half-even(w / scale), clipped to
    [-127, 127], so |w - wq * scale| <= scale / 2. wq is packed in `pack_weight`'s panels; leading
    axes (stacked layers, experts) are kept."""
    n = w.shape[-1]
    if n % PANEL:
        raise ValueError(f"A weight of {n} output columns does not fill panels of {PANEL}.")
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-2)  # f32[..., N]
    scales = _divide(amax, jnp.full(amax.shape, 127, jnp.float32))
    scales = jnp.where(scales == 0, jnp.float32(1), scales)
    wq = _divide(w, jnp.broadcast_to(scales[..., None, :], w.shape))
    return pack_weight(jnp.clip(jnp.round(wq), -127, 127).astype(jnp.int8)), scales


def _divide(a: jax.Array, b: jax.Array) -> jax.Array:  # f32[s], f32[s] -> f32[s]
    """a / b elementwise, each quotient correctly rounded, as numpy's and the kernel's (W8A8's
    activations) are: XLA rewrites a division by a constant or by a broadcast into a multiply by
    the reciprocal, whose rounding differs in the last bit (a tie then rounds the other way).
    The barrier hides what `b` is."""
    return a / jax.lax.optimization_barrier(b)


def dequantize_int8(
    wq: jax.Array,  # i8[..., P, K, PANEL] (pack_weight_int8)
    scales: jax.Array,  # f32[..., P * PANEL]
) -> jax.Array:  # f32[..., K, P * PANEL]
    """The float32 weights `pack_weight_int8`'s output stands for, wq * scale unpacked: the
    reference the int8 matmuls are measured against."""
    return unpack_weight(wq).astype(jnp.float32) * scales[..., None, :].astype(jnp.float32)


def _int8_checks(name: str, k: int, activations: str) -> None:
    """The refusals both int8 calls share: the mode, the library, W8A8's bound on K."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"{name}'s activations is one of {ACTIVATIONS}; got {activations!r}.")
    if activations == "int8" and k > W8A8_MAX_K:
        raise ValueError(
            f"{name} with int8 activations sums in int32, which K = {k} could overflow; "
            f"K must be at most {W8A8_MAX_K}."
        )
    if not available():
        raise RuntimeError(f"{name} needs the CPU kernels' library, which did not load.")


def _check_weight_kind(name: str, wq: jax.Array, activations: str) -> None:
    """Refuses weights neither int8 nor e4m3, and e4m3 with int8 activations (the e4m3 path is
    weight-only). The kernel reads the dtype itself: no bitcast, which XLA:CPU would run as a
    copy of the whole weight every call."""
    if wq.dtype == jnp.int8:
        return
    if wq.dtype != jnp.float8_e4m3fn:
        raise ValueError(
            f"{name} takes int8 (pack_weight_int8) or float8_e4m3fn weights; got {wq.dtype}."
        )
    if activations != "float":
        raise ValueError(
            f"{name} runs e4m3 weights weight-only (activations='float'); got "
            f"activations={activations!r}."
        )


def packed_matmul_int8(
    x: jax.Array,  # f32[..., K]
    wq: jax.Array,  # i8 | f8e4m3[P, K, PANEL] (pack_weight_int8; pack_weight of e4m3)
    scales: jax.Array,  # f32[P * PANEL]
    valid: jax.Array | int | None = None,  # i32[]: rows of x (flattened) that are real
    activations: str = "float",
) -> jax.Array:  # f32[..., P * PANEL]
    """x @ dequantize_int8(wq, scales) with the weights read as int8 (cpu_matmul_int8.cc), or
    as e4m3 where wq is float8_e4m3fn (the same panels; weight-only, each byte widened to its
    exact float32 value in registers: XLA:CPU's dot widens it into a copy of the weight).

    activations="float" (weight-only, for decode, where the weights' bytes are the bound): each
    output (sum_k x[k] * float(wq[k])) * scale, one chain of fused multiply-adds over k in order,
    the scale once at the end; bit for bit `packed_matmul(x, wq.astype(f32), k_block=0) * scales`.
    activations="int8" (W8A8, for prefill, where the multiply is the bound): each row quantized
    on the way in, sx = max|x[r]| / 127 (1 for a row of zeros), xq = round-half-even(x / sx),
    then exact int32 sums (AVX512-VNNI): float32(sum_k xq * wq) * sx * scale, in that order.
    Either way a row's result does not depend on the rows beside it. `valid` as in
    `packed_matmul`: rows from it on are padding, not computed, and come back 0."""
    *lead, k = x.shape
    if wq.ndim != 3 or wq.shape[1] != k or wq.shape[2] != PANEL:
        raise ValueError(
            f"packed_matmul_int8 takes x [..., K] and weights [N / {PANEL}, K, {PANEL}]; got x "
            f"{tuple(x.shape)} and weights {tuple(wq.shape)}."
        )
    p = wq.shape[0]
    _check_weight_kind("packed_matmul_int8", wq, activations)
    if tuple(scales.shape) != (p * PANEL,):
        raise ValueError(
            f"packed_matmul_int8 takes one scale per output column, ({p * PANEL},) for weights "
            f"{tuple(wq.shape)}; got scales {tuple(scales.shape)}."
        )
    _int8_checks("packed_matmul_int8", k, activations)
    rows = math.prod(lead)
    valid = jnp.asarray(rows if valid is None else valid, jnp.int32)
    if valid.shape != ():
        raise ValueError(
            f"packed_matmul_int8's valid is a count of rows, one int32; got {valid.shape}."
        )
    call = jax.ffi.ffi_call(
        _INT8_MATMUL_TARGET, jax.ShapeDtypeStruct((rows, p * PANEL), jnp.float32)
    )
    out = call(
        x.reshape(rows, k).astype(jnp.float32),
        wq,
        scales.astype(jnp.float32),
        valid,
        int8_activations=np.int64(activations == "int8"),
    )
    return out.reshape(*lead, p * PANEL)


def grouped_packed_matmul_int8(
    x: jax.Array,  # f32[M, K] rows sorted by group
    wq: jax.Array,  # i8 | f8e4m3[G, P, K, PANEL] (pack_weight_int8 of w f32[G, K, N])
    scales: jax.Array,  # f32[G, P * PANEL]
    group_sizes: jax.Array,  # i32[G] rows of each group in order; rows past their sum: padding
    activations: str = "float",
) -> jax.Array:  # f32[M, P * PANEL]: row r of group g is x[r] @ dequantize_int8(wq[g], scales[g])
    """`grouped_packed_matmul` over int8 experts: each run of rows against its own expert's
    int8 panels alone, an expert without rows never read. The groups' semantics are
    grouped_packed_matmul's (a negative size is 0, the runs stop at M, the rows after them are
    0), the arithmetic `packed_matmul_int8`'s for `activations`: a row's bits are
    `packed_matmul_int8(x[r:r+1], wq[g], scales[g], activations=...)`'s."""
    if x.ndim != 2 or wq.ndim != 4 or wq.shape[2] != x.shape[1] or wq.shape[3] != PANEL:
        raise ValueError(
            f"grouped_packed_matmul_int8 takes x [M, K] and weights [G, N / {PANEL}, K, "
            f"{PANEL}]; got x {tuple(x.shape)} and weights {tuple(wq.shape)}."
        )
    groups, panels = wq.shape[:2]
    _check_weight_kind("grouped_packed_matmul_int8", wq, activations)
    if tuple(scales.shape) != (groups, panels * PANEL):
        raise ValueError(
            f"grouped_packed_matmul_int8 takes one scale per expert and output column, "
            f"{(groups, panels * PANEL)} for weights {tuple(wq.shape)}; got scales "
            f"{tuple(scales.shape)}."
        )
    group_sizes = jnp.asarray(group_sizes)
    if group_sizes.shape != (groups,):
        raise ValueError(
            f"grouped_packed_matmul_int8 takes one size per group of the weights, {groups}; got "
            f"group_sizes of shape {tuple(group_sizes.shape)}."
        )
    _int8_checks("grouped_packed_matmul_int8", x.shape[1], activations)
    call = jax.ffi.ffi_call(
        _GROUPED_INT8_MATMUL_TARGET,
        jax.ShapeDtypeStruct((x.shape[0], panels * PANEL), jnp.float32),
    )
    return call(
        x.astype(jnp.float32),
        wq,
        scales.astype(jnp.float32),
        group_sizes.astype(jnp.int32),
        int8_activations=np.int64(activations == "int8"),
    )
