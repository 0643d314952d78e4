"""What an engine runs on, built from its config: the model placed on its mesh, and a runner whose
KV pool fits the devices' free memory.

Kept out of `Engine.__init__`, so that the engine reads as the loop it is, and so that anyone who
needs the runner alone (a benchmark of steps, a follower process) builds it the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from checkpoints import LoadedModel, load_model
from checkpoints.prequantized import checkpoint_quantization_of
from checkpoints.weights import hf_arrays_to_params
from jaxserve import target
from jaxserve.engine_config import EngineConfig
from jaxserve.models.config import ModelConfig
from jaxserve.models.kv_pool import free_device_bytes, pages_that_fit, resolve_kv_cache_dtype
from jaxserve.models.loaded import abstract_params, layer_loop_of, model_for
from jaxserve.models.quant import quantize_params
from jaxserve.models.sharding import MESH_AXES, ShardingPlan, make_mesh
from jaxserve.quantization import resolve_checkpoint_quantization
from jaxserve.runtime import aot
from jaxserve.runtime.buckets import bucket_ladder
from jaxserve.runtime.key_calibration import calibrate_key_transform
from jaxserve.runtime.model_runner import ModelRunner, RunnerConfig, enable_compilation_cache
from jaxserve.runtime.multihost import agree_min
from pallas_kernels.ragged_paged_attention import common

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096


def max_model_len_for(config: EngineConfig, model: ModelConfig) -> int:
    """The longest sequence served: the config's, else the model's context capped at 4096 (a
    longer default would size every request's page table, and the KV it may claim, for it)."""
    asked = config.max_model_len or min(model.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    return min(asked, model.max_position_embeddings)


# Set to 1 to serve a 16-bit dtype on the CPU anyway (`check_cpu_dtype`), to measure it.
CPU_HALF_PRECISION_ENV = "JAXSERVE_CPU_HALF_PRECISION"


def check_cpu_dtype(dtype: str | None, platform: str) -> None:
    """Refuses bfloat16 and float16 parameters on the CPU, unless CPU_HALF_PRECISION_ENV is 1.

    XLA:CPU (JAX 0.10.2, what `pip install -e .` gives on Python 3.11) compiled the 9 buckets of
    a 135M-parameter model in 448 s in bfloat16 against ~40 s in float32, then produced 19
    tokens of one request in 180 s (issue 41): a server that looks hung. A clear refusal at
    start serves users better than that; float32 is the CPU's default."""
    if platform != "cpu" or dtype is None or os.environ.get(CPU_HALF_PRECISION_ENV) == "1":
        return
    if jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(
            f"--dtype {dtype} is refused on the CPU: XLA:CPU compiles and runs 16-bit models "
            "many times slower than float32 (a 135M model: 448 s to compile its buckets, then "
            f"~10 s a token). Serve float32 (the CPU's default), or set {CPU_HALF_PRECISION_ENV}=1 "
            "to run it anyway."
        )


def engine_mesh(
    config: EngineConfig, devices: Sequence[jax.Device] | None = None, mesh: Mesh | None = None
) -> Mesh:
    """The ("data", "model") mesh an engine runs on: the config's over the first devices JAX
    sees; or, for colocation with a trainer (docs/rl.md), all of `devices` or all of `mesh`'s.

    Given devices are served tensor parallel over all of them, in their order. A `mesh` of
    jaxserve's axes is used as it is; one of other axes (a trainer's, e.g. ("fsdp",) or
    ("data", "tensor")) is served tensor parallel over all its devices, in its order: the
    engine's layout is its own, the chips are the trainer's. The config's tensor_parallel and
    mesh_shape must then be unset or agree."""
    if mesh is not None and devices is not None:
        raise ValueError("Give an engine either devices or a mesh, not both.")
    if mesh is None and devices is None:
        return make_mesh(config.tensor_parallel, config.mesh_shape)
    if mesh is not None:
        shape = mesh.devices.shape if tuple(mesh.axis_names) == MESH_AXES else (1, mesh.size)
        devices = list(mesh.devices.flat)
    else:
        devices = list(devices)
        shape = (1, len(devices))
    asked = tuple(config.mesh_shape or (1, config.tensor_parallel))
    if asked not in ((1, 1), tuple(shape)):  # the defaults, or the same mesh
        raise ValueError(
            f"The engine was given {len(devices)} devices (mesh {tuple(shape)}) but its "
            f"config asks for tensor_parallel={config.tensor_parallel}, "
            f"mesh_shape={config.mesh_shape}; leave those unset or make them agree."
        )
    return make_mesh(mesh_shape=shape, devices=devices)


def build_runner(
    config: EngineConfig,
    model: LoadedModel | None = None,
    runner_class: Callable[..., ModelRunner] = ModelRunner,
    *,
    devices: Sequence[jax.Device] | None = None,
    mesh: Mesh | None = None,
    kv_layout=None,
) -> ModelRunner:
    """Loads the model (unless given) onto the config's mesh (or `devices` / `mesh`:
    `engine_mesh`) and sizes the KV pool: the config's `num_pages`, else what fits
    `kv_cache_memory_fraction` of the devices' free memory (`kv_cache_memory_gb` per device
    where JAX reports none, the CPU), never more than `max_num_seqs` full-length sequences need.
    Every host of a multi-host mesh gets the same pool shape (the smallest fit among them).
    `runner_class` builds the runner from (model, RunnerConfig, ShardingPlan): the host
    benchmark's runner whose device call costs nothing. `kv_layout` (kv_pool.KVLayout, None:
    uniform) is the pool's layer groups, passed through to the RunnerConfig: the engine picks
    it (kv_pool.kv_layout)."""
    if config.compilation_cache_dir:
        enable_compilation_cache(config.compilation_cache_dir)
    if model is None:
        check_cpu_dtype(config.dtype, target.current().platform)
    mesh = engine_mesh(config, devices, mesh)
    owned = model is None  # loaded here: its float leaves may be freed as they are quantized
    if model is None:  # quantized as it loads: the float tree is never whole on the devices
        # A pre-quantized folder: its own scheme, read as stored (checkpoints/prequantized.py).
        checkpoint = checkpoint_quantization_of(config.model)
        scheme, _ = resolve_checkpoint_quantization(
            config.quantization, checkpoint, target.current()
        )
        model = load_model(
            config.model, dtype=config.dtype, seed=config.seed, mesh=mesh, quant=scheme
        )
    sharding = ShardingPlan.create(mesh, model.config)
    # Params into their shardings (a no-op when loaded there) before free memory is measured.
    model = dataclasses.replace(model, params=sharding.place(model.params))
    model = quantize_model(config.quantization, model, sharding, donate=owned)
    max_model_len = max_model_len_for(config, model.config)
    if kv_layout is None:
        kv_layout = aot.resolve_kv_layout(config, model.config)
    # The pool's own dtype: 8-bit pages (with their scale lanes) fit about twice as many, and
    # their keys are conditioned by a transform calibrated on this model (models/kv_keys.py).
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, model.dtype)
    kv_keys = None
    if common.is_quantized(kv_dtype):
        kv_keys = calibrate_key_transform(model, kv_dtype, max_model_len, sharding.replicated)
    runner_config = RunnerConfig(
        num_pages=config.num_pages or 1,  # sized below unless given
        page_size=config.page_size,
        max_model_len=max_model_len,
        token_buckets=config.token_buckets,
        seq_buckets=bucket_ladder(1, config.max_num_seqs, config.seq_bucket_factor),
        attention_backend=config.attention_backend,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        kv_cache_dtype=config.kv_cache_dtype,
        kv_layout=kv_layout,
        kv_keys=kv_keys,
    )
    if not config.num_pages:
        devices = list(mesh.devices.flat)
        cap = aot.pool_cap(config, max_model_len, kv_layout)
        fit = pages_that_fit(
            aot.pool_page_bytes(
                model.config, config.page_size, kv_dtype, sharding, runner_config.kv_layout
            ),
            devices,
            fraction=config.kv_cache_memory_fraction,
            fallback_gb=config.kv_cache_memory_gb,
            reserved_bytes=step_reserved_bytes(model, runner_config, sharding, cap),
        )
        runner_config = dataclasses.replace(runner_config, num_pages=min(cap, agree_min(fit)))
    return runner_class(model, runner_config, sharding)


def quantize_model(
    name: str, model: LoadedModel, sharding: ShardingPlan, *, donate: bool = False
) -> LoadedModel:
    """`model` with its decoder matmuls quantized as `name` (EngineConfig.quantization) asks on
    the target in use, onto `sharding`'s devices; the model itself for "none" or when it is
    already in that scheme. Logs the scheme, and the sentence saying where it falls back to
    weight-only. `donate`: the float leaves are freed as they are replaced (the caller owns
    them). A model loaded from a pre-quantized folder is already in its scheme: `name` must
    agree with it (resolve_checkpoint_quantization), and it is logged. Raises ValueError for
    a scheme the target refuses, a name that conflicts with a pre-quantized checkpoint, or a
    model already quantized otherwise."""
    checkpoint = checkpoint_quantization_of(model.source) if model.quant is not None else None
    scheme, note = resolve_checkpoint_quantization(name, checkpoint, target.current())
    if note:
        logger.warning(note)
    if scheme is None:
        return model
    if model.quant == scheme:  # a folder read quantized, param by param (load_model's quant)
        how = "read pre-quantized" if checkpoint is not None else "quantized as they loaded"
        logger.info("Decoder matmul weights %s: %s.", how, scheme.label)
        return model
    if model.quant is not None:
        raise ValueError(
            f"The model's weights are already {model.quant.label}; quantization={name!r} "
            "cannot requantize them: load the float checkpoint."
        )
    params = quantize_params(model.params, scheme, sharding, donate=donate)
    logger.info("Decoder matmul weights quantized at load: %s.", scheme.label)
    return dataclasses.replace(model, params=params, quant=scheme)


def step_reserved_bytes(model: LoadedModel, runner_config, sharding, cap: int) -> int:
    """Device memory the largest bucket's step needs besides the params and the pool: its
    temporaries and its outputs that do not alias a donated input, from the memory analysis of
    the step compiled from shapes alone (runtime/aot.py), nothing allocated. 0 where the platform
    reports no memory (the CPU), so nothing extra compiles there.

    Compiled with the largest pool the engine may take (`cap` pages): the very program served
    when the cap fits (a hit in the persistent compilation cache at precompile), else one at
    least as large. With the pool never copied (kv_pool.py) the temporaries are the step's
    activations and logits, tens of MiB, moving by a few tens of MiB with the pool's size as XLA
    schedules differently (smollm2-135m on v5e, compiled: 22 MiB at 64 pages, 63 MiB at 2048
    and 8192); kv_cache_memory_fraction is the margin for that. A step that copied its pool would
    show it here, twice the pool, and shrink the pool instead of failing at its first step.
    """
    if free_device_bytes(list(sharding.mesh.devices.flat)) is None:
        return 0
    module = model_for(
        model.config,
        model.dtype,
        runner_config.attention_backend,
        sharding,
        layer_loop=layer_loop_of(model.params),
        quant=model.quant,
        kv_layout=runner_config.kv_layout,
        kv_keys=runner_config.kv_keys,
    )
    probe = dataclasses.replace(runner_config, num_pages=cap)
    report = aot.step_memory(module, model.params, probe, sharding)
    if not report.compiled:
        raise RuntimeError(
            f"The largest step bucket ({report.num_tokens} tokens) does not compile on "
            f"{sharding.platform} for sizing the KV pool: {report.error}"
        )
    return report.reserved_bytes


def load_params(source, model: LoadedModel, sharding: ShardingPlan) -> dict:
    """The params of `source` for a model being served, in that model's dtype and layout: for
    Engine.update_weights. `source` is a checkpoint folder (Hugging Face safetensors or orbax,
    read by `checkpoints`, each device's shard straight onto the engine's mesh) or a mapping of
    Hugging Face tensor names to arrays (a trainer's state dict; numpy arrays, placed later).

    A quantized model's new weights are float like any checkpoint's and are quantized in its
    scheme as they are read (models/quant.py).

    Raises checkpoints.ModelLoadError naming a folder that cannot be read, and ValueError for
    a folder of another model (a config field differs) or arrays that do not fill the model."""
    if isinstance(source, Mapping):
        if model.quant is None:
            shapes = jax.eval_shape(lambda: model.params)
        else:  # the float tree the names fill, quantized after
            shapes = abstract_params(model.config, model.dtype, layer_loop_of(model.params))
        params = hf_arrays_to_params(
            source, shapes, tied_embeddings=model.config.tie_word_embeddings
        )
        return params if model.quant is None else quantize_params(params, model.quant, sharding)
    # The loader's ("data", "model") mesh over the plan's devices: the same devices in the same
    # order, so each shard is read onto the device that serves it.
    devices = sharding.mesh.devices
    mesh = Mesh(devices.reshape(devices.shape[0], -1), MESH_AXES)
    layer_loop = layer_loop_of(model.params)
    checkpoint = checkpoint_quantization_of(source)
    if checkpoint is not None and model.quant is None:
        raise ValueError(
            f"The checkpoint {str(source)!r} is pre-quantized as {checkpoint.label}, but the "
            "model served is float: serve the pre-quantized checkpoint, or swap in float weights."
        )
    loaded = load_model(
        source, dtype=model.dtype, mesh=mesh, layer_loop=layer_loop, quant=model.quant
    )
    if loaded.config != model.config:
        differ = {
            f.name: (getattr(loaded.config, f.name), getattr(model.config, f.name))
            for f in dataclasses.fields(model.config)
            if getattr(loaded.config, f.name) != getattr(model.config, f.name)
        }
        raise ValueError(
            f"The checkpoint {str(source)!r} is of another model than the one served: "
            f"(its value, the served one's) differ for {differ}."
        )
    return loaded.params
