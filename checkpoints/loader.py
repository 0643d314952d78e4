"""`load_model(spec)`: one entry point for every way a model reaches jaxserve."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from checkpoints.config_json import (
    LoadedModel,
    abstract_params,
    config_from_json,
    model_for,
    unstack_layers,
)
from checkpoints.hf_config import UnsupportedModelError, model_config_from_hf
from checkpoints.orbax_io import MARKER as ORBAX_MARKER
from checkpoints.orbax_io import is_orbax_dir, restore_orbax
from checkpoints.prequantized import checkpoint_quantization
from checkpoints.random_weights import NAMED_SHAPES, random_params
from checkpoints.weights import load_hf_weights, place_hf_weights
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import resolve_layer_loop
from jaxserve.models.quant import quantize_params, transpose_kernels
from jaxserve.quantization import CheckpointQuant, QuantScheme, resolve_checkpoint_quantization

logger = logging.getLogger(__name__)

# The embedded default: stories260k ships inside the package, so nothing is ever downloaded.
DEFAULT_MODEL_DIR = Path(__file__).parent / "stories260k"

__all__ = ["DEFAULT_MODEL_DIR", "LoadedModel", "ModelLoadError", "load_model", "model_for"]


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message names the path or name and the reason."""


def default_dtype():
    """float32 on the CPU (XLA's bfloat16 matmuls are slow there), bfloat16 on accelerators: the
    target's platform (jaxserve.target), so a compile for a TPU from this CPU gets bfloat16."""
    from jaxserve import target

    return jnp.float32 if target.current().platform == "cpu" else jnp.bfloat16


def load_model(
    spec: str | Path | None = None,
    *,
    dtype=None,
    seed: int = 0,
    mesh=None,
    layer_loop: str = "auto",
    quant: QuantScheme | None = None,
) -> LoadedModel:
    """Loads a model from a folder (Hugging Face or orbax) or a named random shape.

    `quant` (jaxserve.quantization): the decoder's matmul weights quantized as they load
    (jaxserve/models/quant.py). A Hugging Face folder on a mesh is read one param at a time,
    each quantized and its float copy freed before the next is read, so a model whose float
    weights exceed the device's memory loads where its quantized ones fit; orbax folders and
    random shapes are quantized leaf by leaf after they load. A pre-quantized Hugging Face
    folder (its config.json's `quantization_config`: checkpoints/prequantized.py) loads its
    8-bit weights and scales as they are stored, in its own scheme for the target when
    `quant` is None; a `quant` of other weights than the checkpoint's is refused.

    `spec` None means the embedded default model. Raises `ModelLoadError` with a one-line reason.
    With `mesh` (jaxserve.models.sharding.make_mesh) each device receives only its shard of the
    params,
    as jaxserve.models.sharding decides: the whole model is never built on one device. The params
    come
    in the layout of `layer_loop`'s module (`model_for`, same default): stacked for "scan", one
    subtree per layer for "unrolled".
    """
    dtype = jnp.dtype(dtype if dtype is not None else default_dtype())

    def unrolled(config) -> bool:  # decided per model: see resolve_layer_loop
        return resolve_layer_loop(layer_loop, config, dtype) == "unrolled"

    if spec is None:
        spec = DEFAULT_MODEL_DIR
    if isinstance(spec, str) and spec in NAMED_SHAPES:
        config = NAMED_SHAPES[spec]
        abstract = abstract_params(config, dtype)
        params = random_params(abstract, seed, _shardings(mesh, config, abstract))
        if unrolled(config):  # drawn stacked: one jitted draw of few leaves compiles in seconds
            params = _unstack(params, mesh, config)
        return _quantized(
            LoadedModel(
                config=config,
                params=params,
                tokenizer=None,
                dtype=dtype,
                source=f"random:{spec}:seed={seed}",
            ),
            quant,
            mesh,
        )
    path = Path(spec)
    if not path.exists():
        raise ModelLoadError(
            f"Model folder {str(path)!r} does not exist (and is not one of the named random "
            f"shapes {sorted(NAMED_SHAPES)})."
        )
    if not path.is_dir():
        raise ModelLoadError(f"Model path {str(path)!r} is a file; pass the model's folder.")
    try:
        if is_orbax_dir(path):
            model = restore_orbax(path, dtype=dtype, mesh=mesh)
            if unrolled(model.config):
                model.params = _unstack(model.params, mesh, model.config)
            return _quantized(model, quant, mesh)
        return _load_hf(path, dtype, mesh, layer_loop, quant)
    except (UnsupportedModelError, FileNotFoundError, ValueError, OSError) as e:
        raise ModelLoadError(f"Cannot load model from {str(path)!r}: {e}") from e


def model_config_of(spec: str | Path | None = None) -> tuple[ModelConfig, str]:
    """(config, source) of a model without reading its weights: for planning and ahead-of-time
    compiles (`jaxserve compile`), where the params are only shapes. Same specs as load_model."""
    if spec is None:
        spec = DEFAULT_MODEL_DIR
    if isinstance(spec, str) and spec in NAMED_SHAPES:
        return NAMED_SHAPES[spec], f"random:{spec}"
    path = Path(spec)
    try:
        if is_orbax_dir(path):
            meta = json.loads((path / ORBAX_MARKER).read_text())
            return config_from_json(meta["config"]), str(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json (nor a jaxserve.json).")
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(path, local_files_only=True)
        return model_config_from_hf(hf), str(path)
    except (UnsupportedModelError, FileNotFoundError, ValueError, OSError, KeyError) as e:
        raise ModelLoadError(f"Cannot read the model config of {str(path)!r}: {e}") from e


def _shardings(mesh, config, abstract) -> dict | None:
    if mesh is None:
        return None
    from jaxserve.models.sharding import ShardingPlan

    return ShardingPlan.create(mesh, config).params(abstract)


def _unstack(params: dict, mesh, config) -> dict:
    """The unrolled loop's per-layer tree of stacked `params`, in the plan's shardings if any."""
    target = unstack_layers(jax.eval_shape(lambda: params))
    return unstack_layers(params, _shardings(mesh, config, target))


def _quantized(model: LoadedModel, quant: QuantScheme | None, mesh) -> LoadedModel:
    """`model` with its float leaves quantized (and freed) one at a time, if `quant`."""
    if quant is None:
        return model
    plan = None if mesh is None else _plan(mesh, model.config)
    params = quantize_params(model.params, quant, plan, donate=True)
    return dataclasses.replace(model, params=params, quant=quant)


def _plan(mesh, config):
    from jaxserve.models.sharding import ShardingPlan

    return ShardingPlan.create(mesh, config)


def _checkpoint_scheme(
    prequant: CheckpointQuant, quant: QuantScheme | None, path: Path
) -> QuantScheme:
    """The scheme a pre-quantized folder loads as: `quant` where its weights are the
    checkpoint's own (their activations and layout are the caller's choice), else the
    checkpoint's own scheme for the target (resolve_checkpoint_quantization), logged."""
    if quant is None:
        from jaxserve import target

        quant, note = resolve_checkpoint_quantization("none", prequant, target.current())
        logger.info(note)
        return quant
    if (quant.weights, quant.block) != (prequant.weights, prequant.block):
        raise ValueError(
            f"The folder is pre-quantized as {prequant.label}, which cannot load as "
            f"{quant.label}: its weights are stored so (pass its own scheme, or none)."
        )
    return quant


def _first_expert(path: Path) -> str:
    """The first expert weight's name in the folder's safetensors headers (for messages)."""
    from checkpoints.safetensors_io import read_header, weight_files

    names = sorted(n for f in weight_files(path) for n in read_header(f)[0] if ".experts." in n)
    return names[0] if names else "mlp.experts"


def _load_hf(
    path: Path, dtype, mesh=None, layer_loop: str = "scan", quant: QuantScheme | None = None
) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json (nor a jaxserve.json).")
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    prequant = checkpoint_quantization(json.loads((path / "config.json").read_text()), path)
    if prequant is not None:
        quant = _checkpoint_scheme(prequant, quant, path)
    eos: tuple[int, ...] = ()
    if (path / "generation_config.json").exists():
        gen = GenerationConfig.from_pretrained(path, local_files_only=True)
        ids = gen.eos_token_id
        eos = tuple([ids] if isinstance(ids, int) else (ids or []))
    config = model_config_from_hf(hf_config, eos)
    if prequant is not None and config.moe is not None:
        raise ValueError(
            f"Tensor {_first_expert(path)!r} is a mixture of experts' expert in a checkpoint "
            f"pre-quantized as {prequant.label}: jaxserve loads pre-quantized dense models "
            "(Llama, Mistral, Qwen2, Qwen3) only; load the float checkpoint with "
            "--quantization to quantize its experts."
        )
    # Pre-quantized: the quantized tree, filled as stored (kernels [in, *features]: a
    # transposed scheme's `kernel_t` are moved after, one 8-bit leaf at a time).
    stored = None if prequant is None else dataclasses.replace(quant, transposed=False)
    abstract = abstract_params(config, dtype, quant=stored)
    # Unrolled: read straight into per-layer arrays, no stacked copy on the way.
    if resolve_layer_loop(layer_loop, config, dtype) == "unrolled":
        abstract = unstack_layers(abstract)
    tied = config.tie_word_embeddings
    if mesh is None:
        params = jax.device_put(
            load_hf_weights(path, abstract, tied_embeddings=tied, prequant=prequant)
        )
        if quant is not None and prequant is None:
            params = quantize_params(params, quant, donate=True)
    else:  # each device's shard read from the memory-mapped files
        shardings = _shardings(mesh, config, abstract)
        # Quantized: each param read, quantized and freed in turn (`lazy`), never all float.
        lazy = quant is not None and prequant is None
        params = place_hf_weights(
            path, abstract, shardings, tied_embeddings=tied, lazy=lazy, prequant=prequant
        )
        if lazy:
            params = quantize_params(params, quant, _plan(mesh, config), donate=True)
    if prequant is not None and quant.transposed:
        params = transpose_kernels(params, None if mesh is None else _plan(mesh, config))
    tokenizer = None
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedModel(
        config=config,
        params=params,
        tokenizer=tokenizer,
        dtype=dtype,
        source=str(path),
        quant=quant,
    )
