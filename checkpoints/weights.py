"""The weight-name table: Hugging Face tensor names -> jaxserve's (layer-stacked) param tree.

HF stores `model.layers.{i}.self_attn.o_proj.weight` as [out, in]; jaxserve's scanned layers hold
`params["layers"]["self_attn"]["o_proj"]["kernel"]` as [num_layers, in, out]. One table says
where each tensor goes and whether it is transposed; the loader checks that every param was filled
exactly once, so a renamed or missing tensor fails loudly instead of leaving random weights.

Fused projections are filled from several tensors, each one *piece* of the fused param's
second-to-last axis: `qkv_proj/kernel` [in, num_kv_heads, group + 2, head_dim] takes q_proj
reshaped to [in, num_kv_heads, group, head_dim] at [..., :group, :] (q head j * group + i reads
KV head j, as in HF), k_proj at [..., group, :] and v_proj at [..., group + 1, :];
`gate_up_proj/kernel` [in, 2, intermediate] takes gate_proj at [:, 0] and up_proj at [:, 1].
Biases likewise. Nothing is concatenated up front: a reader copies each piece's share of the
slice it is asked for, so a tensor-parallel shard reads only its own heads.

A mixture of experts (Qwen3-MoE's `mlp.experts.{j}.gate_proj`, Mixtral's
`block_sparse_moe.experts.{j}.w1`, ...) stacks its experts on the first axis of one param:
`mlp/experts_gate_up` [num_experts, in, 2, intermediate] and `mlp/experts_down`
[num_experts, intermediate, hidden], each expert's tensors a piece at its index of that axis
(and gate/up at their range of axis -2), so an expert-parallel shard reads only its experts.
The router (`mlp.gate`, `block_sparse_moe.gate`) is `mlp/router` [hidden, num_experts].

Gemma 2 and 3 use the same names plus `pre_feedforward_layernorm` and
`post_feedforward_layernorm` (their `post_attention_layernorm` is the attention's output norm,
not the MLP's input norm as in Llama: the module reads each by name). A multimodal Gemma 3
(Gemma3ForConditionalGeneration) keeps its text model under `model.language_model.` (or
`language_model.model.`, older exports), read as `model.`; its vision tower and projector are
skipped: jaxserve serves the text model.

A pre-quantized checkpoint (checkpoints/prequantized.py) fills a quantized tree: each decoder
matmul's 8-bit `weight` goes to its kernel as above, and its scales, renamed
`<module>.weight_scale` ([out] or [out, blocks]), to the kernel's `kernel_scale`, transposed
and cut into the same fused pieces.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import jax
import numpy as np

from checkpoints.safetensors_io import iter_tensors, weight_files

_Q, _K, _V = slice(0, -2), slice(-2, -1), slice(-1, None)  # pieces of qkv's (group + 2) axis
_GATE, _UP = slice(0, 1), slice(1, 2)  # pieces of gate_up's 2 axis


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one HF tensor goes: a param path, transposed or not, whole or one fused piece."""

    path: tuple[str, ...]
    transpose: bool
    piece: slice | None = None  # its range of the param's axis -2 (None: the whole param)
    expert: int | None = None  # its index of the param's axis 0, the experts' (None: all)


# HF suffix under model.layers.{i}. -> its target under params["layers"]
LAYER_TABLE: dict[str, Target] = {
    "self_attn.q_proj.weight": Target(("self_attn", "qkv_proj", "kernel"), True, _Q),
    "self_attn.k_proj.weight": Target(("self_attn", "qkv_proj", "kernel"), True, _K),
    "self_attn.v_proj.weight": Target(("self_attn", "qkv_proj", "kernel"), True, _V),
    "self_attn.o_proj.weight": Target(("self_attn", "o_proj", "kernel"), True),
    "self_attn.q_proj.bias": Target(("self_attn", "qkv_proj", "bias"), False, _Q),
    "self_attn.k_proj.bias": Target(("self_attn", "qkv_proj", "bias"), False, _K),
    "self_attn.v_proj.bias": Target(("self_attn", "qkv_proj", "bias"), False, _V),
    "self_attn.o_proj.bias": Target(("self_attn", "o_proj", "bias"), False),
    "self_attn.q_norm.weight": Target(("self_attn", "q_norm", "scale"), False),
    "self_attn.k_norm.weight": Target(("self_attn", "k_norm", "scale"), False),
    "mlp.gate_proj.weight": Target(("mlp", "gate_up_proj", "kernel"), True, _GATE),
    "mlp.up_proj.weight": Target(("mlp", "gate_up_proj", "kernel"), True, _UP),
    "mlp.down_proj.weight": Target(("mlp", "down_proj", "kernel"), True),
    "mlp.gate_proj.bias": Target(("mlp", "gate_up_proj", "bias"), False, _GATE),
    "mlp.up_proj.bias": Target(("mlp", "gate_up_proj", "bias"), False, _UP),
    "mlp.down_proj.bias": Target(("mlp", "down_proj", "bias"), False),
    "input_layernorm.weight": Target(("input_layernorm", "scale"), False),
    "post_attention_layernorm.weight": Target(("post_attention_layernorm", "scale"), False),
    # Gemma's sandwich: the MLP's input and output norms.
    "pre_feedforward_layernorm.weight": Target(("pre_feedforward_layernorm", "scale"), False),
    "post_feedforward_layernorm.weight": Target(("post_feedforward_layernorm", "scale"), False),
}
# HF suffix under model.layers.{i}.{mlp|block_sparse_moe}.experts.{j}. -> its expert's target
EXPERT_TABLE: dict[str, Target] = {
    "gate_proj.weight": Target(("mlp", "experts_gate_up"), True, _GATE),  # Qwen3-MoE
    "up_proj.weight": Target(("mlp", "experts_gate_up"), True, _UP),
    "down_proj.weight": Target(("mlp", "experts_down"), True),
    "w1.weight": Target(("mlp", "experts_gate_up"), True, _GATE),  # Mixtral
    "w3.weight": Target(("mlp", "experts_gate_up"), True, _UP),
    "w2.weight": Target(("mlp", "experts_down"), True),
}


def _with_scales(table: dict[str, Target]) -> dict[str, Target]:
    """`table` plus each dense kernel's `.weight_scale` (a pre-quantized checkpoint's scales,
    checkpoints/prequantized.py): its param's `kernel_scale` sibling, the same piece. The
    experts have none: pre-quantized mixtures of experts are refused (checkpoints/loader.py)."""
    out = dict(table)
    for suffix, t in table.items():
        if suffix.endswith("weight") and t.path[-1] == "kernel":
            scale = dataclasses.replace(t, path=(*t.path[:-1], t.path[-1] + "_scale"))
            out[suffix + "_scale"] = scale
    return out


LAYER_TABLE = _with_scales(LAYER_TABLE)
# The routers, under model.layers.{i}.
ROUTER_TABLE: dict[str, Target] = {
    "mlp.gate.weight": Target(("mlp", "router"), True),  # Qwen3-MoE
    "block_sparse_moe.gate.weight": Target(("mlp", "router"), True),  # Mixtral
}
TOP_TABLE: dict[str, Target] = {
    "model.embed_tokens.weight": Target(("embed_tokens", "embedding"), False),
    "model.norm.weight": Target(("norm", "scale"), False),
    "lm_head.weight": Target(("lm_head", "kernel"), True),
}
# Buffers some exporters save that carry no weights of their own.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# A multimodal Gemma 3's image side: not served (only its text model is).
_VISION = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")
# A multimodal Gemma 3's text model, under either export's prefix -> the plain model's names.
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_NAME = re.compile(r"^(mlp|block_sparse_moe)\.experts\.(\d+)\.(.+)$")


def canonical_name(name: str) -> str:
    """`name` with a multimodal Gemma 3's text-model prefix read as the plain model's."""
    for prefix, plain in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return plain + name[len(prefix) :]
    return name


def map_name(name: str) -> tuple[Target, int | None] | None:
    """(target with its path under params, layer index or None) of an HF tensor; None if ignored."""
    if IGNORED.match(name) or _VISION.match(name):
        return None
    name = canonical_name(name)
    if m := _LAYER_NAME.match(name):
        layer, suffix = int(m.group(1)), m.group(2)
        target = LAYER_TABLE.get(suffix) or ROUTER_TABLE.get(suffix)
        if (e := _EXPERT_NAME.match(suffix)) and e.group(3) in EXPERT_TABLE:
            expert = int(e.group(2))
            target = dataclasses.replace(EXPERT_TABLE[e.group(3)], expert=expert)
        if target is not None:
            return dataclasses.replace(target, path=("layers", *target.path)), layer
    elif name in TOP_TABLE:
        return TOP_TABLE[name], None
    raise KeyError(name)


def expected_names(paths, num_layers: int, num_experts: int = 0, seen=()) -> set[str]:
    """The HF tensor names that fill the params at `paths` (stacked param paths). A mixture of
    experts' names are one family's (Qwen3-MoE's or Mixtral's): the family of the router in
    `seen`, the names found."""
    names = {name for name, t in TOP_TABLE.items() if t.path in paths}
    for suffix, t in LAYER_TABLE.items():
        if ("layers", *t.path) in paths:
            names |= {f"model.layers.{i}.{suffix}" for i in range(num_layers)}
    if ("layers", "mlp", "router") in paths:
        mixtral = any(".block_sparse_moe." in name for name in seen)
        router = "block_sparse_moe.gate.weight" if mixtral else "mlp.gate.weight"
        prefix = "block_sparse_moe" if mixtral else "mlp"
        suffixes = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for i in range(num_layers):
            names.add(f"model.layers.{i}.{router}")
            names |= {
                f"model.layers.{i}.{prefix}.experts.{j}.{s}.weight"
                for j in range(num_experts)
                for s in suffixes
            }
    return names


# A piece's place in its param: (expert, the range of axis -2); None where it spans the axis.
PieceKey = tuple[int | None, tuple[int, int] | None]


class Parts:
    """One layer's share of one param: a whole mapped tensor, or the pieces of a fused param
    (ranges of axis -2) or of stacked experts (indices of axis 0), or both."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape  # the param's shape for one layer
        self.pieces: dict[PieceKey, np.ndarray] = {}  # where it goes -> view

    def read(self, index: tuple[slice, ...], out: np.ndarray) -> np.ndarray:
        """Copies `index` of this param into `out` (of the slice's shape, in the target dtype),
        reading only those bytes of the mapped tensors and casting while copying."""
        if (None, None) in self.pieces:
            out[...] = self.pieces[(None, None)][index]
            return out
        axis = len(self.shape) - 2
        want = range(self.shape[axis])[index[axis]]
        experts = range(self.shape[0])[index[0]]
        for (expert, span), piece in self.pieces.items():
            src, dst = list(index), [slice(None)] * len(index)
            if span is not None:
                (begin, end) = span
                lo, hi = max(want.start, begin), min(want.stop, end)
                if lo >= hi:  # this piece holds no part of the requested range
                    continue
                src[axis] = slice(lo - begin, hi - begin)
                dst[axis] = slice(lo - want.start, hi - want.start)
            if expert is not None:  # the piece is one expert's: it has no axis 0
                if expert not in experts:
                    continue
                dst[0] = experts.index(expert)
                src = src[1:]
            out[tuple(dst)] = piece[tuple(src)]
        return out


Layout = dict[tuple[str, ...], dict[int | None, Parts]]


def index_hf_weights(
    model_dir: Path, abstract_params: dict, *, tied_embeddings: bool, prequant=None
) -> Layout:
    """Where each param's values are: {stacked param path: {layer (None if unstacked): Parts}}.

    The arrays are memory-mapped views, already transposed (and, for fused params, reshaped to
    their piece) in jaxserve's layout, so nothing is read until a loader slices them. Checks what
    the loaders rely on: every tensor is known, every param filled, every shape as the config
    says. `abstract_params` is the model's `jax.eval_shape` param tree (stacked or unstacked).
    `prequant` (a jaxserve.quantization.CheckpointQuant): the folder is pre-quantized, and
    `abstract_params` the quantized tree its 8-bit weights and scales fill as they are.
    """
    tensors = (pair for file in weight_files(model_dir) for pair in iter_tensors(file))
    if prequant is not None:
        from checkpoints.prequantized import prequantized_tensors

        tensors = prequantized_tensors(tensors, prequant, model_dir, map_name)
    return index_hf_tensors(
        tensors, abstract_params, tied_embeddings=tied_embeddings, where=model_dir
    )


def index_hf_tensors(
    tensors: Iterable[tuple[str, np.ndarray]],
    abstract_params: dict,
    *,
    tied_embeddings: bool,
    where: object = "the Hugging Face-named arrays",
) -> Layout:
    """`index_hf_weights` over (HF name, array) pairs from anywhere: a folder's files, or a
    trainer's state dict in memory (`hf_arrays_to_params`). `where` names them in errors."""
    from checkpoints.config_json import stack_layers

    stacked = stack_layers(abstract_params)
    shapes = {_path(kp): tuple(leaf.shape) for kp, leaf in _leaves(stacked)}
    num_layers = jax.tree.leaves(stacked["layers"])[0].shape[0]
    found: Layout = {}
    seen: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in tensors:
        name = canonical_name(name)
        try:
            mapped = map_name(name)
        except KeyError:
            unexpected.append(name)
            continue
        if mapped is None or (tied_embeddings and name == "lm_head.weight"):
            continue
        target, layer = mapped
        if target.path not in shapes:
            unexpected.append(name)
            continue
        shape = shapes[target.path] if layer is None else shapes[target.path][1:]
        parts = found.setdefault(target.path, {}).setdefault(layer, Parts(shape))
        value = tensor.T if target.transpose else tensor
        span = None if target.piece is None else range(shape[-2])[target.piece]
        expected = shape if span is None else (*shape[:-2], len(span), shape[-1])
        if target.expert is not None:  # one expert of the stacked axis 0
            if not 0 <= target.expert < shape[0]:
                raise ValueError(
                    f"Tensor {name!r} is expert {target.expert}, but the model config has "
                    f"{shape[0]} experts."
                )
            expected = expected[1:]
        # A fused piece splits the tensor's last axis (heads, or gate|up), nothing else.
        flat = (*expected[: value.ndim - 1], int(np.prod(expected[value.ndim - 1 :])))
        if value.shape != flat:
            raise ValueError(
                f"Tensor {name!r} has shape {tuple(tensor.shape)}; expected {flat} "
                f"(after transpose={target.transpose}) from the model config."
            )
        key = (target.expert, None if span is None else (span.start, span.stop))
        parts.pieces[key] = value.reshape(expected)
        seen.add(name)
    if unexpected:
        raise ValueError(f"{where} holds tensors jaxserve does not know: {unexpected[:8]}.")
    router = shapes.get(("layers", "mlp", "router"))
    experts = 0 if router is None else router[-1]
    missing = sorted(expected_names(shapes.keys(), num_layers, experts, seen) - seen)
    if missing:
        raise ValueError(f"{where} lacks weights for {missing[:8]}.")
    return found


def hf_arrays_to_params(
    named: Mapping[str, np.ndarray], abstract_params: dict, *, tied_embeddings: bool
) -> dict:
    """Arrays under their Hugging Face names (a trainer's state dict: `model.layers.0.mlp.
    up_proj.weight` [out, in], ...) as numpy arrays in jaxserve's tree like `abstract_params`
    (fused, transposed, stacked or per layer): what Engine.update_weights serves. The checks
    of the folder loader: every name known, every param filled, every shape as configured."""
    pairs = ((name, np.asarray(value)) for name, value in named.items())
    layout = index_hf_tensors(pairs, abstract_params, tied_embeddings=tied_embeddings)
    return jax.tree_util.tree_map_with_path(
        lambda kp, leaf: read_slice(layout, _path(kp), leaf.dtype, (slice(None),) * leaf.ndim),
        abstract_params,
    )


def load_hf_weights(
    model_dir: Path, abstract_params: dict, *, tied_embeddings: bool, prequant=None
) -> dict:
    """Reads the safetensors tensors of `model_dir` into numpy arrays like `abstract_params`
    (`prequant`: a pre-quantized folder into its quantized tree, as index_hf_weights)."""
    layout = index_hf_weights(
        model_dir, abstract_params, tied_embeddings=tied_embeddings, prequant=prequant
    )
    return jax.tree_util.tree_map_with_path(
        lambda kp, leaf: read_slice(layout, _path(kp), leaf.dtype, (slice(None),) * leaf.ndim),
        abstract_params,
    )


def place_hf_weights(
    model_dir: Path,
    abstract_params: dict,
    shardings: dict,
    *,
    tied_embeddings: bool,
    lazy: bool = False,
    prequant=None,
) -> dict:
    """Loads `model_dir` straight into `shardings`: each device's shard is read from the file.

    No host or device ever holds more than its own shards (plus one shard in flight), so a
    model larger than one device loads onto a mesh of them. `lazy`: each leaf is a function
    of no arguments that reads and places it when called, so a consumer that quantizes leaf
    by leaf (jaxserve/models/quant.py's quantize_params) never holds the whole float tree.
    `prequant`: a pre-quantized folder's 8-bit weights and scales, as index_hf_weights.
    """
    layout = index_hf_weights(
        model_dir, abstract_params, tied_embeddings=tied_embeddings, prequant=prequant
    )

    def place(kp, leaf, sharding):
        path = _path(kp)

        def read():
            return jax.make_array_from_callback(
                leaf.shape, sharding, lambda index: read_slice(layout, path, leaf.dtype, index)
            )

        return read if lazy else read()

    return jax.tree_util.tree_map_with_path(place, abstract_params, shardings)


def read_slice(
    layout: Layout, path: tuple[str, ...], dtype, index: tuple[slice, ...]
) -> np.ndarray:
    """`index` of the param at `path` (stacked "layers/..." or unstacked "layers_{i}/...")."""
    if m := re.fullmatch(r"layers_(\d+)", path[0]):  # one layer of the unrolled layout
        parts = layout[("layers", *path[1:])][int(m.group(1))]
        return parts.read(index, np.empty(_sliced(parts.shape, index), dtype))
    by_layer = layout[path]
    if None in by_layer:
        return by_layer[None].read(index, np.empty(_sliced(by_layer[None].shape, index), dtype))
    layers = range(len(by_layer))[index[0]]
    out = np.empty((len(layers), *_sliced(by_layer[0].shape, index[1:])), dtype)
    for i, layer in enumerate(layers):
        by_layer[layer].read(index[1:], out[i])  # one buffer, in the target dtype
    return out


def _sliced(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(len(range(n)[i]) for n, i in zip(shape, index, strict=True))


def _leaves(tree: dict):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _path(keypath) -> tuple[str, ...]:
    return tuple(k.key for k in keypath)
