"""The weight-name table: Hugging Face tensor names -> jaxserve's (layer-stacked) param tree.

HF stores `model.layers.{i}.self_attn.q_proj.weight` as [out, in]; jaxserve's scanned layers hold
`params["layers"]["self_attn"]["q_proj"]["kernel"]` as [num_layers, in, out]. One table says
where each tensor goes and whether it is transposed; the loader checks that every param was filled
exactly once, so a renamed or missing tensor fails loudly instead of leaving random weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import jax
import numpy as np

from checkpoints.safetensors_io import iter_tensors, weight_files

# HF suffix under model.layers.{i}. -> (param path under params["layers"], transpose?)
LAYER_TABLE: dict[str, tuple[tuple[str, ...], bool]] = {
    "self_attn.q_proj.weight": (("self_attn", "q_proj", "kernel"), True),
    "self_attn.k_proj.weight": (("self_attn", "k_proj", "kernel"), True),
    "self_attn.v_proj.weight": (("self_attn", "v_proj", "kernel"), True),
    "self_attn.o_proj.weight": (("self_attn", "o_proj", "kernel"), True),
    "self_attn.q_proj.bias": (("self_attn", "q_proj", "bias"), False),
    "self_attn.k_proj.bias": (("self_attn", "k_proj", "bias"), False),
    "self_attn.v_proj.bias": (("self_attn", "v_proj", "bias"), False),
    "self_attn.o_proj.bias": (("self_attn", "o_proj", "bias"), False),
    "self_attn.q_norm.weight": (("self_attn", "q_norm", "scale"), False),
    "self_attn.k_norm.weight": (("self_attn", "k_norm", "scale"), False),
    "mlp.gate_proj.weight": (("mlp", "gate_proj", "kernel"), True),
    "mlp.up_proj.weight": (("mlp", "up_proj", "kernel"), True),
    "mlp.down_proj.weight": (("mlp", "down_proj", "kernel"), True),
    "mlp.gate_proj.bias": (("mlp", "gate_proj", "bias"), False),
    "mlp.up_proj.bias": (("mlp", "up_proj", "bias"), False),
    "mlp.down_proj.bias": (("mlp", "down_proj", "bias"), False),
    "input_layernorm.weight": (("input_layernorm", "scale"), False),
    "post_attention_layernorm.weight": (("post_attention_layernorm", "scale"), False),
}
TOP_TABLE: dict[str, tuple[tuple[str, ...], bool]] = {
    "model.embed_tokens.weight": (("embed_tokens", "embedding"), False),
    "model.norm.weight": (("norm", "scale"), False),
    "lm_head.weight": (("lm_head", "kernel"), True),
}
# Buffers some exporters save that carry no weights of their own.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def map_name(name: str) -> tuple[tuple[str, ...], int | None, bool] | None:
    """(param path, layer index or None, transpose) of an HF tensor name; None if ignored."""
    if IGNORED.match(name):
        return None
    if m := _LAYER_NAME.match(name):
        layer, suffix = int(m.group(1)), m.group(2)
        if suffix in LAYER_TABLE:
            path, transpose = LAYER_TABLE[suffix]
            return ("layers", *path), layer, transpose
    elif name in TOP_TABLE:
        path, transpose = TOP_TABLE[name]
        return path, None, transpose
    raise KeyError(name)


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def load_hf_weights(model_dir: Path, abstract_params: dict, *, tied_embeddings: bool) -> dict:
    """Reads the safetensors tensors of `model_dir` into numpy arrays like `abstract_params`.

    `abstract_params` is the model's `jax.eval_shape` param tree (shapes and target dtypes).
    """
    out = jax.tree.map(lambda a: np.empty(a.shape, a.dtype), abstract_params)
    filled: dict[tuple[str, ...], set[int | None]] = {}
    unexpected: list[str] = []
    for file in weight_files(model_dir):
        for name, tensor in iter_tensors(file):
            try:
                mapped = map_name(name)
            except KeyError:
                unexpected.append(name)
                continue
            if mapped is None or (tied_embeddings and name == "lm_head.weight"):
                continue
            path, layer, transpose = mapped
            try:
                target = _get(out, path)
            except KeyError:
                unexpected.append(name)
                continue
            value = tensor.T if transpose else tensor
            dest = target if layer is None else target[layer]
            if value.shape != dest.shape:
                raise ValueError(
                    f"Tensor {name!r} has shape {tuple(tensor.shape)}; expected {dest.shape} "
                    f"(after transpose={transpose}) from the model config."
                )
            dest[...] = value.astype(dest.dtype)
            filled.setdefault(path, set()).add(layer)
    if unexpected:
        raise ValueError(f"{model_dir} holds tensors jaxserve does not know: {unexpected[:8]}.")
    missing = _missing(out, filled)
    if missing:
        raise ValueError(f"{model_dir} lacks weights for {missing[:8]}.")
    return out


def _missing(params: dict, filled: dict[tuple[str, ...], set[int | None]]) -> list[str]:
    missing = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = tuple(k.key for k in keypath)
        expected: Iterable[int | None] = range(leaf.shape[0]) if path[0] == "layers" else [None]
        done = filled.get(path, set())
        missing += [f"{'/'.join(path)}[{i}]" for i in expected if i not in done]
    return missing
