"""Pre-quantized Hugging Face checkpoints: `quantization_config` -> CheckpointQuant, and their
8-bit tensors -> the quantized tree's kernels and scales, never widened to float.

    ckpt = checkpoint_quantization(json.load(open(folder / "config.json")), folder)
    pairs = prequantized_tensors(tensors, ckpt, folder, map_name)  # scales renamed

Two formats:
- `quant_method: "fp8"` (transformers' FineGrainedFP8: Qwen3-*-FP8, DeepSeek): `weight`
  float8_e4m3fn [out, in] and `weight_scale_inv` float32 [ceil(out / 128), ceil(in / 128)],
  w = q * scale_inv of its 128x128 block; `weight_block_size: [128, 128]`, `activation_scheme:
  "dynamic"`. Each block scale is repeated over its block's 128 output rows (the last block's
  rows that remain), giving the [out, ceil(in / 128)] scales of QuantScheme.block's layout.
- `quant_method: "compressed-tensors"` W8A8 or W8A16 (formats "int-quantized",
  "float-quantized", "naive-quantized"): `weight` int8 or float8_e4m3fn [out, in] with
  `weight_scale` [out, 1], strategy "channel", symmetric; input activations dynamic per token
  or none. The scale is the per-channel `kernel_scale` as it is.

Each scale becomes a tensor named `<module>.weight_scale` ([out, blocks] or [out]), which the
name table (checkpoints/weights.py) maps beside its weight: transposed like it, its fused
piece of qkv or gate_up like it. Everything else is refused with a sentence naming the value
or the tensor: another quant_method or block size, a missing scale, a decoder matmul left float,
a float param (the head, the router, the embedding) stored in 8 bits, a mixture of experts
(the grouped expert matmul has per-column scales only, and transformers' experts are not the
Linear layers compressed-tensors quantizes, so nothing here is tested against it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxserve.quantization import WEIGHT_DTYPES, CheckpointQuant

FP8_BLOCK = 128  # the one block size loaded: what Qwen3-*-FP8 and DeepSeek ship
CT_FORMATS = {"int-quantized": "int8", "float-quantized": "fp8", "naive-quantized": None}
_CT_TYPES = {"int": "int8", "float": "fp8"}
_NUMPY = {"int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}  # WEIGHT_DTYPES' values


def checkpoint_quantization_of(spec) -> CheckpointQuant | None:
    """The pre-quantized scheme of a model spec (load_model's): a folder whose config.json has a
    `quantization_config`; None for a float folder, an orbax folder or a named shape."""
    if spec is None:
        return None
    path = Path(spec)
    config = path / "config.json"
    if not config.is_file():
        return None
    return checkpoint_quantization(json.loads(config.read_text()), path)


def checkpoint_quantization(
    config: dict, where: object = "the checkpoint"
) -> CheckpointQuant | None:
    """The scheme of a Hugging Face config.json's `quantization_config` (None if it has none).

    Raises ValueError, naming the value, for what jaxserve cannot load as it is stored."""
    q = config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8(q, where)
    if method == "compressed-tensors":
        return _compressed_tensors(q, where)
    raise ValueError(
        f"{where} has quantization_config quant_method={method!r}, which jaxserve does not load: "
        "it loads 'fp8' (128x128 block-scaled e4m3) and 'compressed-tensors' (int8 or fp8 "
        "weights, one scale a channel)."
    )


def _fp8(q: dict, where) -> CheckpointQuant:
    block = q.get("weight_block_size")
    if block is None or list(block) != [FP8_BLOCK, FP8_BLOCK]:
        raise ValueError(
            f"{where} has an fp8 quantization_config with weight_block_size={block!r}: jaxserve "
            f"loads [{FP8_BLOCK}, {FP8_BLOCK}] blocks only."
        )
    activations = q.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        raise ValueError(
            f"{where} has an fp8 quantization_config with activation_scheme={activations!r}: "
            "jaxserve loads 'dynamic' activations only (no static activation scales)."
        )
    for key, ok in (("fmt", "e4m3"), ("scale_fmt", "float")):
        if q.get(key, ok) not in (ok, None):
            raise ValueError(
                f"{where} has an fp8 quantization_config with {key}={q[key]!r}: jaxserve loads "
                f"{key}={ok!r} only."
            )
    return CheckpointQuant(
        method="fp8",
        weights="fp8",
        activations="fp8",
        block=FP8_BLOCK,
        detail=f"{FP8_BLOCK}x{FP8_BLOCK} blocks",
    )


def _compressed_tensors(q: dict, where) -> CheckpointQuant:
    for key, empty in (
        ("sparsity_config", {}),
        ("kv_cache_scheme", None),
        ("transform_config", {}),
    ):
        if q.get(key) not in (empty, None, {}):
            raise ValueError(
                f"{where} has a compressed-tensors quantization_config with {key}={q[key]!r}: "
                "jaxserve loads quantized weights only."
            )
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(
            f"{where} has a compressed-tensors quantization_config with quantization_status="
            f"{status!r}: jaxserve loads 'compressed' checkpoints (8-bit weights) only."
        )
    groups = q.get("config_groups") or {}
    if not groups:
        raise ValueError(
            f"{where} has a compressed-tensors quantization_config without config_groups."
        )
    schemes = {_ct_group(name, group, q.get("format"), where) for name, group in groups.items()}
    if len(schemes) != 1:
        raise ValueError(
            f"{where} has compressed-tensors config_groups of different schemes {sorted(schemes)}: "
            "jaxserve serves one scheme for every decoder matmul."
        )
    (weights, activations, fmt) = schemes.pop()
    return CheckpointQuant(
        method="compressed-tensors", weights=weights, activations=activations, detail=fmt
    )


def _ct_group(name: str, group: dict, default_format, where) -> tuple[str, str | None, str]:
    """(weights, activations, format) of one compressed-tensors config group."""
    fmt = group.get("format") or default_format
    if fmt not in CT_FORMATS:
        raise ValueError(
            f"{where} has compressed-tensors format={fmt!r} (group {name!r}): jaxserve loads "
            f"{sorted(CT_FORMATS)}."
        )
    w = group.get("weights") or {}
    weights = _CT_TYPES.get(w.get("type"))
    shape = (w.get("num_bits"), w.get("strategy"), w.get("symmetric"), w.get("dynamic"))
    if weights is None or shape != (8, "channel", True, False):
        raise ValueError(
            f"{where} has compressed-tensors weights {w!r} (group {name!r}): jaxserve loads "
            "8-bit int or float weights, strategy 'channel', symmetric, static."
        )
    if CT_FORMATS[fmt] not in (None, weights):
        raise ValueError(
            f"{where} has compressed-tensors format={fmt!r} for {w.get('type')!r} weights "
            f"(group {name!r}); they disagree."
        )
    if group.get("output_activations"):
        raise ValueError(
            f"{where} quantizes output activations (group {name!r}): jaxserve does not."
        )
    a = group.get("input_activations")
    if not a:
        return weights, None, fmt
    ashape = (a.get("num_bits"), a.get("type"), a.get("strategy"), a.get("symmetric"))
    if ashape != (8, w.get("type"), "token", True) or a.get("dynamic") is not True:
        raise ValueError(
            f"{where} has compressed-tensors input_activations {a!r} (group {name!r}): jaxserve "
            "loads none, or dynamic symmetric per-token 8-bit activations of the weights' type."
        )
    return weights, weights, fmt


def prequantized_tensors(
    tensors: Iterable[tuple[str, np.ndarray]],
    ckpt: CheckpointQuant,
    where: object,
    map_name: Callable[[str], Any],  # checkpoints.weights.map_name: an HF name -> its param
) -> Iterator[tuple[str, np.ndarray]]:
    """The (HF name, array) pairs of a pre-quantized checkpoint as the name table reads them:
    each decoder matmul's 8-bit `weight` [out, in] as it is, and its scales as
    `<module>.weight_scale`: f32[out] (compressed-tensors) or f32[out, ceil(in / 128)]
    (fp8, each block scale repeated over its rows). Symmetric zero points (all 0) are dropped.

    Raises ValueError naming the tensor for a missing or misshapen scale, a decoder matmul
    stored in another dtype than the scheme's, and a param kept float stored in 8 bits. (A
    mixture of experts is refused before, by checkpoints/loader.py, naming an expert.)"""
    # `map_name` is handed in by weights.py, which calls this module (no import cycle).
    from jaxserve.models.quant import contracting_axis

    named = dict(tensors)  # memory-mapped views: nothing is read yet
    suffixes = ("weight_scale_inv",) if ckpt.block else ("weight_scale",)
    want = np.dtype(_NUMPY[WEIGHT_DTYPES[ckpt.weights]])
    eight_bits = set(map(np.dtype, _NUMPY.values()))
    for name, tensor in named.items():
        base, _, leaf = name.rpartition(".")
        if leaf in suffixes or leaf == "weight_zero_point":
            weight = named.get(f"{base}.weight")
            if weight is None or weight.dtype not in eight_bits:
                raise ValueError(
                    f"Tensor {name!r} has no 8-bit weight {base + '.weight'!r} beside it in "
                    f"{where} ({ckpt.label})."
                )
            if leaf == "weight_zero_point" and np.any(np.asarray(tensor)):
                raise ValueError(
                    f"Tensor {name!r} holds non-zero zero points: jaxserve loads symmetric "
                    "quantization only."
                )
            continue  # read with its weight
        try:
            mapped = map_name(name)
        except KeyError:  # the name table refuses it, with the other unknown names
            yield name, tensor
            continue
        path = None if mapped is None else mapped[0].path
        quantized = path is not None and leaf == "weight" and contracting_axis(path) is not None
        if not quantized:
            if tensor.dtype in eight_bits:
                raise ValueError(
                    f"Tensor {name!r} in {where} is {tensor.dtype}, but jaxserve keeps it float "
                    "(the embedding, the LM head, the norms and the router are never "
                    "quantized): a checkpoint that quantizes it is not supported."
                )
            yield name, tensor
            continue
        if tensor.dtype != want:
            raise ValueError(
                f"Tensor {name!r} in {where} is {tensor.dtype}, but the checkpoint is "
                f"{ckpt.label}, whose decoder matmul weights are {want}: jaxserve serves every "
                "decoder matmul in the checkpoint's 8-bit scheme (none left float)."
            )
        scale_name = f"{base}.{suffixes[0]}"
        scale = named.get(scale_name)
        if scale is None:
            raise ValueError(
                f"Tensor {scale_name!r} is missing from {where}: the {tensor.dtype} weight "
                f"{name!r} needs its scales ({ckpt.label})."
            )
        yield name, tensor
        yield f"{base}.weight_scale", _scales(scale, tensor.shape, ckpt, scale_name)


def _scales(scale: np.ndarray, shape: tuple[int, ...], ckpt: CheckpointQuant, name: str):
    """f32 scales of a weight of `shape` [out, in] in QuantScheme's layout, before transposing:
    [out] (one a channel) or [out, ceil(in / block)] (the block scale of each row)."""
    out, cols = shape
    if ckpt.block is None:
        if scale.shape not in ((out, 1), (out,)):
            raise ValueError(
                f"Tensor {name!r} has shape {tuple(scale.shape)}; expected ({out}, 1), one scale "
                f"for each of its weight's {out} output channels."
            )
        return np.asarray(scale, np.float32).reshape(out)
    b = ckpt.block
    blocks = (-(-out // b), -(-cols // b))
    if tuple(scale.shape) != blocks:
        raise ValueError(
            f"Tensor {name!r} has shape {tuple(scale.shape)}; expected {blocks}, one scale "
            f"for each {b}x{b} block of its weight's {(out, cols)}."
        )
    # Row r of the weight reads block row r // b: each block row repeated b times, cut to out.
    return np.repeat(np.asarray(scale, np.float32), b, axis=0)[:out]
