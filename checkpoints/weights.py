"""The weight-name table: Hugging Face tensor names -> jaxserve's (layer-stacked) param tree.

HF stores `model.layers.{i}.self_attn.q_proj.weight` as [out, in]; jaxserve's scanned layers hold
`params["layers"]["self_attn"]["q_proj"]["kernel"]` as [num_layers, in, out]. One table says
where each tensor goes and whether it is transposed; the loader checks that every param was filled
exactly once, so a renamed or missing tensor fails loudly instead of leaving random weights.
"""

from __future__ import annotations

import re
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


Layout = dict[tuple[str, ...], dict[int | None, np.ndarray]]


def index_hf_weights(model_dir: Path, abstract_params: dict, *, tied_embeddings: bool) -> Layout:
    """Where each param's values are: {param path: {layer (None if unstacked): array}}.

    The arrays are memory-mapped views, already transposed to jaxserve's layout, so nothing is read
    until a loader slices them. Checks what the loaders rely on: every tensor is known, every
    param filled, every shape as the config says. `abstract_params` is the model's
    `jax.eval_shape` param tree.
    """
    shapes = {_path(kp): leaf.shape for kp, leaf in _leaves(abstract_params)}
    found: Layout = {}
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
            if path not in shapes:
                unexpected.append(name)
                continue
            value = tensor.T if transpose else tensor
            expected = shapes[path] if layer is None else shapes[path][1:]
            if value.shape != tuple(expected):
                raise ValueError(
                    f"Tensor {name!r} has shape {tuple(tensor.shape)}; expected {tuple(expected)} "
                    f"(after transpose={transpose}) from the model config."
                )
            found.setdefault(path, {})[layer] = value
    if unexpected:
        raise ValueError(f"{model_dir} holds tensors jaxserve does not know: {unexpected[:8]}.")
    missing = []
    for path, shape in shapes.items():
        expected_layers = range(shape[0]) if path[0] == "layers" else [None]
        done = found.get(path, {})
        missing += [f"{'/'.join(path)}[{i}]" for i in expected_layers if i not in done]
    if missing:
        raise ValueError(f"{model_dir} lacks weights for {missing[:8]}.")
    return found


def load_hf_weights(model_dir: Path, abstract_params: dict, *, tied_embeddings: bool) -> dict:
    """Reads the safetensors tensors of `model_dir` into numpy arrays like `abstract_params`."""
    layout = index_hf_weights(model_dir, abstract_params, tied_embeddings=tied_embeddings)
    return jax.tree_util.tree_map_with_path(
        lambda kp, leaf: read_slice(layout[_path(kp)], leaf.dtype, (slice(None),) * leaf.ndim),
        abstract_params,
    )


def place_hf_weights(
    model_dir: Path, abstract_params: dict, shardings: dict, *, tied_embeddings: bool
) -> dict:
    """Loads `model_dir` straight into `shardings`: each device's shard is read from the file.

    No host or device ever holds more than its own shards (plus one shard in flight), so a
    model larger than one device loads onto a mesh of them.
    """
    layout = index_hf_weights(model_dir, abstract_params, tied_embeddings=tied_embeddings)

    def place(kp, leaf, sharding):
        parts = layout[_path(kp)]
        return jax.make_array_from_callback(
            leaf.shape, sharding, lambda index: read_slice(parts, leaf.dtype, index)
        )

    return jax.tree_util.tree_map_with_path(place, abstract_params, shardings)


def read_slice(parts: dict[int | None, np.ndarray], dtype, index: tuple[slice, ...]) -> np.ndarray:
    """`index` of one param, cast to `dtype`, reading only those bytes of the mapped tensors."""
    if None in parts:
        return np.asarray(parts[None][index]).astype(dtype)
    layers = range(len(parts))[index[0]]
    out = np.empty((len(layers), *parts[0][index[1:]].shape), dtype)
    for i, layer in enumerate(layers):
        out[i] = parts[layer][index[1:]]  # casts while copying: one buffer, in the target dtype
    return out


def _leaves(tree: dict):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _path(keypath) -> tuple[str, ...]:
    return tuple(k.key for k in keypath)
