"""Ahead-of-time compiles of every step bucket for a target this process need not have.

`jaxserve compile --target v5e:2x2 --model smollm2-135m --tensor-parallel 4` answers "will my
model and my flags fit and compile on that chip" before anyone rents it. The step is the one the
runner serves (model_runner.step_words), built for the target's devices (jaxserve.target:
libtpu's abstract TPU topologies, the CUDA plugin's compile-only H100/H200) with the params and
the KV pool as shapes only, so nothing is allocated. For each bucket: compiled or the compiler's
error, compile seconds, the executable's memory (arguments, temporaries, outputs), any copy of
the whole KV pool the compiler added (a relayout: the pool's bytes again, every step), and the
step time a roofline predicts from the compiled cost analysis and the chip's published peaks
(`pallas_kernels/chips.py`), never below the bytes and FLOPs the step must do
(jaxserve/runtime/roofline.py): predicted, never measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import target as targets
from jaxserve.engine_config import EngineConfig
from jaxserve.models.config import ModelConfig
from jaxserve.models.kv_keys import KeyTransform
from jaxserve.models.kv_pool import (
    KVLayout,
    KVPages,
    kv_layout,
    padded_bytes,
    pool_padding,
    pool_slots,
    resolve_kv_cache_dtype,
)
from jaxserve.models.llama import resolve_layer_loop
from jaxserve.models.loaded import abstract_params, layer_loop_of, model_for, unstack_layers
from jaxserve.models.quant import contracting_axis, weight_bytes_by_dtype
from jaxserve.models.sharding import ShardingPlan, make_mesh
from jaxserve.models.step_batch import pack_chunks, to_words
from jaxserve.quantization import resolve_checkpoint_quantization
from jaxserve.runtime.buckets import bucket_ladder
from jaxserve.runtime.model_runner import RunnerConfig, step_words
from jaxserve.runtime.roofline import StepWork, layer_floor, predict, step_floor
from jaxserve.runtime.sampling import PenaltyState, SamplingBatch, mask_words
from jaxserve.scheduling.kv_cache_manager import pages_held_at_most
from pallas_kernels import gpu_targets
from pallas_kernels.ragged_paged_attention import common

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _StepProgram:
    """What every bucket's compile shares: the module, the abstract inputs and their shardings."""

    module: object  # the flax module (models.loaded.model_for)
    params: object  # ShapeDtypeStructs with their shardings
    kv: KVPages  # of ShapeDtypeStructs
    pen: object  # PenaltyState of ShapeDtypeStructs
    last: jax.ShapeDtypeStruct  # i32[max_seqs]
    param_shardings: object
    kv_sharding: object
    replicated: object
    runner: RunnerConfig
    target: targets.Target
    pool_shard_shape: tuple[int, ...]  # one device's pool [L, pages, page_size, lanes]
    peaks: tuple[float, float] | None  # (FLOP/s, bytes/s) of one device
    model: ModelConfig
    tensor_parallel: int
    layer_loop: str  # "scan" or "unrolled", as the params are laid out
    itemsize: int  # bytes of one weight (and of one KV element)
    weight_itemsize: int  # bytes of one decoder matmul weight (1 where quantized)
    kv_itemsize: int = 0  # bytes of one KV element (1 for an 8-bit pool); 0: itemsize


@dataclasses.dataclass
class BucketReport:
    """One compiled (or refused) step bucket."""

    num_tokens: int
    num_seqs: int
    compiled: bool
    error: str | None = None
    compile_s: float = 0.0
    argument_bytes: int = 0  # per device, from the executable's memory analysis
    temp_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0  # outputs that reuse donated arguments (the pool)
    pool_copies: int = 0  # ops that materialise the whole (per-device) KV pool again
    # Pallas kernels the program calls on a TPU (Mosaic custom calls: the attention, and a
    # mixture of experts' two grouped matmuls, per layer body)
    mosaic_calls: int = 0
    flops: float | None = None  # per device, the compiled cost analysis (None on the GPU)
    bytes_accessed: float | None = None
    floor_flops: float = 0.0  # per device, the least the step must do (runtime/roofline.py)
    floor_bytes: float = 0.0
    floor_step_s: float | None = None  # the floor's roofline: no step of the bucket is faster
    # max(floor, the cost analysis's roofline with a scanned loop's other layers added)
    predicted_step_s: float | None = None

    @property
    def reserved_bytes(self) -> int:
        """Device memory the step needs beside its arguments: temporaries and the outputs that
        do not reuse a donated argument."""
        return self.temp_bytes + max(self.output_bytes - self.alias_bytes, 0)


@dataclasses.dataclass
class CompileReport:
    """Every bucket of one engine configuration, compiled for one target."""

    target: str
    platform: str
    device_kind: str
    num_devices: int
    model: str
    dtype: str
    attention_backend: str
    layer_loop: str
    num_pages: int
    page_size: int
    pool_bytes_per_device: int
    # The pool's device bytes over its keys' and values' own (1.0: none); a quantized pool's
    # scale lanes count as overhead here.
    pool_padding: float
    param_bytes_per_device: int
    hbm_bytes_per_device: int | None
    buckets: list[BucketReport]
    quantization: str = "none"  # the resolved scheme's label ("int8 weight-only", ...)
    quantization_note: str | None = None  # where the scheme falls back on this target, why
    max_model_len: int = 0  # the longest sequence served: the pool must hold one to serve it
    # The params' bytes on one device by dtype ({"bfloat16": ..., "int8": ..., "float32": ...})
    param_bytes_by_dtype: dict[str, int] = dataclasses.field(default_factory=dict)
    kv_cache_dtype: str = ""  # the pool's dtype ("bfloat16", "int8", "float8_e4m3fn")
    # The hybrid pool's groups ("7 groups of 4 layers, windows 512"); "": uniform, a page holds
    # every layer.
    kv_layout: str = ""

    @property
    def ok(self) -> bool:
        """Every bucket compiled and the largest fits the device's HBM."""
        return all(b.compiled for b in self.buckets) and self.fits

    @property
    def peak_bytes(self) -> int:
        """The most device memory one step needs: its arguments, temporaries and outputs that
        are not the donated arguments themselves."""
        return (
            max(
                (b.argument_bytes + b.temp_bytes + b.output_bytes - b.alias_bytes)
                for b in self.buckets
                if b.compiled
            )
            if any(b.compiled for b in self.buckets)
            else 0
        )

    @property
    def holds_a_sequence(self) -> bool:
        """Whether the KV pool holds one sequence of max_model_len tokens: a model whose
        weights leave the pool a page or two compiles and fits, yet serves nothing long."""
        return self.num_pages * self.page_size >= self.max_model_len

    @property
    def fits(self) -> bool:
        """The largest step fits the device's HBM and the pool beside it holds a sequence."""
        hbm = self.hbm_bytes_per_device
        return (hbm is None or self.peak_bytes <= hbm) and self.holds_a_sequence

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(
            ok=self.ok,
            fits=self.fits,
            peak_bytes=self.peak_bytes,
            holds_a_sequence=self.holds_a_sequence,
        )
        return out


def _bytes_per_device(shapes, shardings) -> int:
    """Bytes one device holds of a tree of shapes split by a matching tree of shardings."""
    return sum(
        math.prod(s.shard_shape(a.shape)) * jnp.dtype(a.dtype).itemsize
        for a, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True)
    )


def _hbm_per_device(where: targets.Target) -> int | None:
    chip = where.chip
    if chip is None:
        return None
    per_device = getattr(chip, "hbm_bytes_per_device", None)
    return per_device if per_device is not None else chip.hbm_bytes


def _peaks(where: targets.Target, dtype) -> tuple[float, float] | None:
    """(FLOP/s, bytes/s) of one device of the target, from the chip table."""
    return None if where.chip is None else chip_peaks(where.chip, dtype)


def chip_peaks(chip, dtype) -> tuple[float, float]:
    """(FLOP/s, bytes/s) of one JAX device of `chip` (a pallas_kernels.chips row) in `dtype`."""
    devices_per_chip = getattr(chip, "devices_per_chip", 1)
    flops = chip.peak_bf16_flops
    if jnp.dtype(dtype) == jnp.float32:  # f32 matmuls: the GPU's CUDA-core rate; TPUs emulate
        flops = getattr(chip, "peak_fp32_flops", flops / 4)
    return flops / devices_per_chip, chip.hbm_bandwidth / devices_per_chip


def resolve_kv_layout(config: EngineConfig, model: ModelConfig) -> KVLayout | None:
    """The pool's layer groups for EngineConfig.kv_layout: a hybrid KVLayout for a model whose
    layers mix full and windowed attention (Gemma) under "hybrid", and under "auto" unless a
    host KV pool is asked for (the host tier copies pages without groups) or the mesh spans
    hosts (untested there); None (uniform) otherwise. ValueError for
    "hybrid" on a model whose layers are all alike."""
    layout = kv_layout(model, hybrid=True)
    if config.kv_layout == "uniform":
        return None
    if config.kv_layout == "hybrid":
        if layout.is_uniform:
            raise ValueError(
                f"kv_layout='hybrid' needs layers of both full and windowed attention, but "
                f"every one of this model's {model.num_layers} layers has window "
                f"{model.layer_window(0)}: use kv_layout='uniform' or 'auto'."
            )
        return layout
    host_pool = bool(config.host_kv_gb) or config.preemption in ("swap", "auto")
    if layout.is_uniform or host_pool or jax.process_count() > 1:
        return None
    logger.info(
        "KV pool: hybrid, %d groups of %d layers (windows %s); local pages are freed past the "
        "window.",
        layout.num_groups,
        layout.group_size,
        layout.windows,
    )
    return layout


def size_pool(
    config: EngineConfig,
    model: ModelConfig,
    dtype,
    hbm_bytes: int | None,
    param_bytes: int,
    page_bytes: int,
    max_model_len: int,
    reserved_bytes: int = 0,
    layout: KVLayout | None = None,
) -> int:
    """Pages of the KV pool for a target: the config's `num_pages`, else what fits
    `kv_cache_memory_fraction` of the device's HBM after its params and `reserved_bytes` (the
    step's temporaries, once a first compile has measured them), never more than max_num_seqs
    full-length sequences need; on a target with no HBM figure, `kv_cache_memory_gb`.
    `page_bytes` is one page's bytes on one device as laid out (`pool_page_bytes`); a hybrid
    `layout` caps the page IDs at what its groups hold for max_num_seqs such sequences."""
    cap = pool_cap(config, max_model_len, layout)
    if config.num_pages:
        return config.num_pages
    page_bytes = max(1, page_bytes)
    if hbm_bytes is None:
        budget = config.kv_cache_memory_gb * 2**30
    else:
        budget = config.kv_cache_memory_fraction * hbm_bytes - param_bytes - reserved_bytes
    return max(1, min(cap, int(budget // page_bytes)))


def pool_cap(config: EngineConfig, max_model_len: int, layout: KVLayout | None) -> int:
    """The most page IDs the pool needs: max_num_seqs sequences of max_model_len tokens, each
    holding every page of its full groups and the window (and a chunk) of its windowed ones."""
    windows = (None,) if layout is None else layout.windows
    return config.max_num_seqs * pages_held_at_most(
        windows, config.page_size, max_model_len, config.max_num_batched_tokens
    )


def pool_page_bytes(
    model: ModelConfig,
    page_size: int,
    dtype,
    sharding: ShardingPlan,
    layout: KVLayout | None = None,
) -> int:
    """Bytes of one page ID on each device: its KV shard's lanes over its layer slots (all
    layers; a hybrid `layout`'s group size, kv_pool.KVLayout), padded as the
    platform lays them out (kv_pool.padded_bytes: whole 128-lane tiles on TPU, whose lanes are
    already a multiple of 128, so only the sublane rows of a short page pad there). `dtype` is
    the pool's: a quantized one has 1-byte lanes and its scale lanes (ShardingPlan.pool_lanes)."""
    shard_lanes = sharding.pool_lanes(dtype) // sharding.kv_shards
    return pool_slots(model, layout) * padded_bytes(
        (page_size, shard_lanes), dtype, sharding.platform
    )


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\w+\[([\d,]*)\](?:\{[^}]*\})?\s+([\w\-]+)\((.*)$"
)
# Ops that materialise a whole pool again: a relayout, or a reshard of it across devices.
_POOL_MOVES = (
    "copy",
    "copy-start",
    "copy-done",
    "transpose",
    "all-gather",
    "all-gather-start",
    "all-gather-done",
    "all-to-all",
    "collective-permute",
    "collective-permute-start",
    "collective-permute-done",
)


def pool_copies(hlo_text: str, pool_shape: tuple[int, ...]) -> list[str]:
    """Instructions of a compiled program (`compiled.as_text()`) that copy, transpose or reshard
    a whole pool: a relayout the step pays every call (twice the pool in temporaries, and its
    bandwidth), or a gather of it across devices. Empty for a step that keeps its pool in place.

    `pool_shape` is one device's shard of the pool. Matched by element count, since a relayout
    may also reshape; fusions count by their root's opcode. The pool's in-place update (a
    scatter into the donated buffer) is not a copy and is not reported.
    """
    size = math.prod(pool_shape)
    lines = hlo_text.splitlines()
    roots: dict[str, str] = {}  # fused computation -> its root's opcode
    current = None
    for line in lines:
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
        elif current and line.lstrip().startswith("ROOT"):
            ins = _INSTRUCTION.match(line)
            if ins:
                roots[current] = ins.group(2)
    found = []
    for line in lines:
        ins = _INSTRUCTION.match(line)
        if not ins or not ins.group(1):
            continue
        if math.prod(int(d) for d in ins.group(1).split(",")) != size:
            continue
        op = ins.group(2)
        if op == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", line)
            op = roots.get(called.group(1), "fusion") if called else "fusion"
        if op in _POOL_MOVES:
            found.append(line.strip()[:160])
    return found


def _cost(compiled) -> tuple[float | None, float | None]:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # compile-only GPU clients have none
        return None, None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    if not cost:
        return None, None
    return cost.get("flops"), cost.get("bytes accessed")


def compile_for_target(
    config: EngineConfig,
    target_name: str | None,
    *,
    buckets: list[int] | None = None,
    log=None,
) -> CompileReport:
    """Compiles every step bucket of `config` for `target_name` (see jaxserve.target.resolve),
    or the token buckets listed in `buckets`; the model is read for its config only."""
    from checkpoints.loader import default_dtype, model_config_of
    from checkpoints.prequantized import checkpoint_quantization_of

    tp = config.mesh_shape[1] if config.mesh_shape else config.tensor_parallel
    where = targets.resolve(target_name, min_devices=tp)
    with targets.use(where):
        model, source = model_config_of(config.model)
        dtype = jnp.dtype(config.dtype or default_dtype())
        mesh = make_mesh(config.tensor_parallel, config.mesh_shape, devices=where.devices)
        sharding = ShardingPlan.create(mesh, model)
        layer_loop = resolve_layer_loop("auto", model, dtype)
        # A pre-quantized folder compiles in its own scheme (checkpoints/prequantized.py).
        checkpoint = checkpoint_quantization_of(config.model)
        scheme, note = resolve_checkpoint_quantization(config.quantization, checkpoint, where)
        shapes = abstract_params(model, dtype, quant=scheme)
        if layer_loop == "unrolled":
            shapes = unstack_layers(shapes)
        param_shardings = sharding.params(shapes)
        params = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, param_shardings
        )
        param_bytes = _bytes_per_device(shapes, param_shardings)
        by_dtype = weight_bytes_by_dtype(shapes, param_shardings)
        max_model_len = min(
            config.max_model_len or min(model.max_position_embeddings, 4096),
            model.max_position_embeddings,
        )
        hbm = _hbm_per_device(where)
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
        layout = resolve_kv_layout(config, model)
        page_bytes = pool_page_bytes(model, config.page_size, kv_dtype, sharding, layout)
        # No weights to calibrate an 8-bit pool's keys on: the transform's shape, so the step
        # compiled is the served one (models/kv_keys.py).
        kv_keys = None
        if common.is_quantized(kv_dtype):
            kv_keys = KeyTransform.identity(
                model.num_layers, model.num_kv_heads, model.head_dim, kv_dtype
            )
        module = model_for(
            model,
            dtype,
            config.attention_backend,
            sharding,
            layer_loop=layer_loop,
            quant=scheme,
            kv_layout=layout,
            kv_keys=kv_keys,
        )

        def program_of(num_pages: int) -> _StepProgram:
            runner = RunnerConfig(
                num_pages=num_pages,
                page_size=config.page_size,
                max_model_len=max_model_len,
                token_buckets=config.token_buckets,
                seq_buckets=bucket_ladder(1, config.max_num_seqs, config.seq_bucket_factor),
                attention_backend=config.attention_backend,
                kv_cache_dtype=config.kv_cache_dtype,
                kv_layout=layout,
            )
            return step_program(module, params, param_shardings, runner, sharding, where)

        def size(reserved: int) -> int:
            return size_pool(
                config, model, dtype, hbm, param_bytes, page_bytes, max_model_len, reserved, layout
            )

        # The pool is sized from HBM, then again once the largest bucket's compile has measured
        # what the step needs beside it (temporaries, outputs not donated): issue 28, item 4.
        num_pages = size(0)
        program = program_of(num_pages)
        all_buckets = [b for b in program.runner.buckets() if not buckets or b[0] in buckets]
        largest = _compile_bucket(program, *all_buckets[-1]) if all_buckets else None
        if largest is not None and largest.compiled and hbm is not None and not config.num_pages:
            resized = size(largest.reserved_bytes)
            if resized != num_pages:
                num_pages, program = resized, program_of(resized)
                largest = _compile_bucket(program, *all_buckets[-1])
        reports = []
        for num_tokens, num_seqs in all_buckets:
            if (num_tokens, num_seqs) == all_buckets[-1]:
                report = largest
            else:
                report = _compile_bucket(program, num_tokens, num_seqs)
            reports.append(report)
            if log is not None:
                log(report)
        pool_bytes = num_pages * page_bytes
        from jaxserve.models.attention import resolve_backend

        backend = resolve_backend(config.attention_backend)
    return CompileReport(
        target=where.name or "local",
        platform=where.platform,
        device_kind=where.device_kind,
        num_devices=mesh.devices.size,
        model=source,
        dtype=dtype.name,
        attention_backend=backend,
        layer_loop=layer_loop,
        num_pages=num_pages,
        page_size=config.page_size,
        pool_bytes_per_device=pool_bytes,
        pool_padding=pool_padding(
            model,
            sharding.pool_lanes(kv_dtype),
            config.page_size,
            kv_dtype,
            where.platform,
            sharding.kv_shards,
        ),
        kv_cache_dtype=kv_dtype.name,
        kv_layout=""
        if layout is None
        else f"{layout.num_groups} groups of {layout.group_size} layers, windows "
        + ", ".join(str(w) for w in sorted({w for w in layout.windows if w is not None})),
        param_bytes_per_device=param_bytes,
        hbm_bytes_per_device=hbm,
        buckets=reports,
        quantization="none" if scheme is None else scheme.label,
        quantization_note=note,
        max_model_len=max_model_len,
        param_bytes_by_dtype=by_dtype,
    )


def step_program(
    module, params, param_shardings, runner: RunnerConfig, sharding: ShardingPlan, where
) -> _StepProgram:
    """The step's abstract inputs for `runner`'s buckets: `params` as ShapeDtypeStructs (or
    arrays) laid out as `param_shardings`, the pool and the penalty state as shapes on
    `sharding`'s mesh, compiled for target `where`."""
    mc = sharding.config
    dtype = params["embed_tokens"]["embedding"].dtype  # the model's dtype
    kv_dtype = resolve_kv_cache_dtype(runner.kv_cache_dtype, dtype)  # the pool's
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, param_shardings
    )
    pool_shape = (
        pool_slots(mc, runner.kv_layout),
        runner.num_pages,
        runner.page_size,
        sharding.pool_lanes(kv_dtype),
    )
    kv_sharding = sharding.kv_pages
    rep = sharding.replicated
    max_seqs = runner.seq_buckets[-1]
    pen = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
        jax.eval_shape(lambda: PenaltyState.zeros(max_seqs, mc.vocab_size)),
    )
    return _StepProgram(
        module=module,
        params=params,
        kv=KVPages(kv=jax.ShapeDtypeStruct(pool_shape, kv_dtype, sharding=kv_sharding)),
        pen=pen,
        last=jax.ShapeDtypeStruct((max_seqs,), jnp.int32, sharding=rep),
        param_shardings=param_shardings,
        kv_sharding=kv_sharding,
        replicated=rep,
        runner=runner,
        target=where,
        pool_shard_shape=tuple(kv_sharding.shard_shape(pool_shape)),
        peaks=_peaks(where, dtype),
        model=mc,
        tensor_parallel=sharding.tensor_parallel,
        layer_loop=layer_loop_of(params),
        itemsize=jnp.dtype(dtype).itemsize,
        weight_itemsize=_matmul_itemsize(params),
        kv_itemsize=kv_dtype.itemsize,
    )


def _matmul_itemsize(params) -> int:
    """Bytes of one element of the decoder's matmul kernels (1 when quantized)."""
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tuple(str(getattr(k, "key", k)) for k in keypath)
        if contracting_axis(path) is not None:
            return jnp.dtype(leaf.dtype).itemsize
    return jnp.dtype(params["embed_tokens"]["embedding"].dtype).itemsize


def step_memory(module, params, runner: RunnerConfig, sharding: ShardingPlan) -> BucketReport:
    """The largest bucket of `runner` compiled from shapes on `sharding`'s (real) devices,
    nothing allocated: what the builder reserves beside the params and the pool."""
    where = targets.current()
    program = step_program(module, params, sharding.params(params), runner, sharding, where)
    return _compile_bucket(program, *runner.buckets()[-1])


def _compile_bucket(p: _StepProgram, num_tokens: int, num_seqs: int) -> BucketReport:
    """One bucket's step, traced, lowered and compiled for the target (in `targets.use`)."""
    batch = pack_chunks(
        [],
        page_size=p.runner.page_size,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        pages_per_seq=p.runner.pages_per_seq,
        num_pages=p.runner.num_pages,
        num_groups=p.runner.num_groups,
    )
    words = to_words((batch, SamplingBatch.empty(num_seqs)))
    words_in = jax.ShapeDtypeStruct(np.shape(words.words), jnp.int32, sharding=p.replicated)
    mask_in = jax.ShapeDtypeStruct(
        (num_seqs, mask_words(p.pen.output_counts.shape[1])), jnp.int32, sharding=p.replicated
    )
    step = jax.jit(
        functools.partial(step_words, p.module),
        static_argnums=(6,),
        donate_argnums=(1, 3, 4),
        in_shardings=(p.param_shardings, p.kv_sharding, *[p.replicated] * 4),
        out_shardings=(p.replicated, p.kv_sharding, p.replicated, p.replicated),
    )
    report = BucketReport(num_tokens=num_tokens, num_seqs=num_seqs, compiled=False)
    start = time.perf_counter()
    try:
        # GPUs: Pallas's Triton lowering learns the target GPU from the abstract mesh.
        with (
            gpu_targets.lowering_for(p.replicated.mesh)
            if p.target.platform == "gpu"
            else contextlib.nullcontext()
        ):
            lowered = step.trace(
                p.params, p.kv, words_in, p.pen, p.last, mask_in, words.layout
            ).lower()
        compiled = lowered.compile()
    except Exception as e:  # the compiler's own words are the report
        report.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        report.compile_s = time.perf_counter() - start
        return report
    report.compile_s = time.perf_counter() - start
    report.compiled = True
    memory = compiled.memory_analysis()
    if memory is not None:
        report.argument_bytes = int(memory.argument_size_in_bytes)
        report.temp_bytes = int(memory.temp_size_in_bytes)
        report.output_bytes = int(memory.output_size_in_bytes)
        report.alias_bytes = int(memory.alias_size_in_bytes)
    hlo = compiled.as_text()
    report.pool_copies = len(pool_copies(hlo, p.pool_shard_shape))
    report.mosaic_calls = hlo.count('custom_call_target="tpu_custom_call"')
    report.flops, report.bytes_accessed = _cost(compiled)
    analysed = None
    if report.flops is not None:
        analysed = StepWork(report.flops, report.bytes_accessed or 0.0)
    floor, report.predicted_step_s = predict_bucket(
        p.model,
        num_tokens,
        num_seqs,
        p.itemsize,
        p.peaks,
        analysed,
        tensor_parallel=p.tensor_parallel,
        layer_loop=p.layer_loop,
        dense_experts=p.target.platform == "gpu",  # XLA:GPU's ragged_dot: a dense masked dot
        weight_itemsize=p.weight_itemsize,
        kv_itemsize=p.kv_itemsize or None,
    )
    report.floor_flops, report.floor_bytes = floor.flops, floor.bytes
    if p.peaks is not None:
        report.floor_step_s = floor.seconds(p.peaks)
    return report


def predict_bucket(
    model: ModelConfig,
    num_tokens: int,
    num_seqs: int,
    itemsize: int,
    peaks: tuple[float, float] | None,
    analysed: StepWork | None,
    *,
    tensor_parallel: int = 1,
    layer_loop: str = "scan",
    dense_experts: bool = False,
    weight_itemsize: int | None = None,
    kv_itemsize: int | None = None,
) -> tuple[StepWork, float | None]:
    """(the floor, the predicted step time or None without peaks) of one bucket on one device.

    `analysed` is the compiled cost analysis (None: the compile-only GPU client gives none). XLA
    prices a while loop's body once, so under the scan the other num_layers - 1 layers are
    added at the floor's per-layer work (tests/unit/test_roofline.py measures the undercount).
    `dense_experts`: a mixture of experts' grouped matmul runs every expert (roofline.py).
    `weight_itemsize`: bytes of a decoder matmul weight where quantized (None: `itemsize`);
    `kv_itemsize` likewise of a KV element (1 for an 8-bit pool).
    """
    kw = dict(
        tensor_parallel=tensor_parallel,
        dense_experts=dense_experts,
        weight_itemsize=weight_itemsize,
        kv_itemsize=kv_itemsize,
    )
    floor = step_floor(model, num_tokens, num_seqs, itemsize, **kw)
    if peaks is None:
        return floor, None
    layer = layer_floor(model, num_tokens, num_seqs, itemsize, **kw)
    missing = model.num_layers - 1 if layer_loop == "scan" else 0
    return floor, predict(floor, peaks, analysed, missing_layers=missing, layer=layer)
