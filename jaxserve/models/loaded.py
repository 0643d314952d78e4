"""`LoadedModel`: what every loader returns; the flax module of a config and its abstract param
tree, which loaders fill; the two layouts of the layers (stacked for scan and checkpoints, one
subtree per layer for the unrolled loop).

Here, beside the model, rather than in `checkpoints`: the runner needs them and never needs a
loader, so `jaxserve`'s core imports nothing from `checkpoints` (only the builder and the command
line load models), and `checkpoints` builds on `jaxserve.models`, one way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.models.config import ModelConfig
from jaxserve.models.kv_pool import KVPages, kv_lanes
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.quant import SCALE_SUFFIX
from jaxserve.models.step_batch import SeqChunk, pack_chunks
from jaxserve.quantization import QuantScheme
from pallas_kernels.ragged_paged_attention.cpu_ffi import pack_weight


@dataclasses.dataclass
class LoadedModel:
    """A model ready to run: config, params on the device, tokenizer (None if random)."""

    config: ModelConfig
    params: dict  # the flax param tree (without the outer {"params": ...})
    tokenizer: Any | None
    dtype: jnp.dtype
    source: str  # where it came from, for logs and GetModelInfo
    # The params' 8-bit matmul kernels (models/quant.py); None: float params of `dtype`.
    quant: QuantScheme | None = None


def model_for(
    config: ModelConfig,
    dtype=jnp.float32,
    attention_backend: str = "auto",
    plan=None,
    layer_loop: str = "auto",
    packed_weights: bool = False,
    quant: QuantScheme | None = None,
    kv_layout=None,
    kv_keys=None,
):
    """The flax module of `config`; `plan` (a jaxserve.models.sharding.ShardingPlan) splits it;
    `packed_weights`: its matmuls read `pack_params` trees (the runner's choice on the CPU);
    `quant`: its decoder matmuls read `quantize_params` trees (models/quant.py); `kv_layout`
    (kv_pool.KVLayout, None: uniform): the pool's layer groups, for a hybrid pool; `kv_keys`
    (kv_keys.KeyTransform, None: none): how an 8-bit pool's keys are conditioned.

    `layer_loop` decides the param tree's layout (see `unstack_layers`); loaders use the same
    "auto" default, so a loaded model and the runner's module agree on each platform.
    """
    return LlamaForCausalLM(
        config,
        attention_backend=attention_backend,
        dtype=dtype,
        plan=plan,
        layer_loop=layer_loop,
        packed_weights=packed_weights,
        quant=quant,
        kv_layout=kv_layout,
        kv_keys=kv_keys,
    )


def abstract_params(
    config: ModelConfig,
    dtype,
    layer_loop: str = "scan",
    packed: bool = False,
    quant: QuantScheme | None = None,
) -> dict:
    """Shapes and dtypes of the param tree, traced without allocating any weights.

    The default is the stacked layout every loader reads and writes; pass "auto" for the layout
    the platform's module runs (`unstack_layers` turns one into the other), `packed` for the
    tree of the packed module (`pack_params`), `quant` for the quantized module's
    (`quantize_params`: 8-bit kernels and their float32 scales).
    """
    if layer_loop == "scan" and config.layers_differ:
        # Such a model always runs unrolled (resolve_layer_loop); its stacked tree, what
        # checkpoints store, is the unrolled one's layers stacked.
        return stack_layers(abstract_params(config, dtype, "unrolled", packed, quant))
    # The reference attention: a param's shape never depends on the attention, and no kernel may
    # refuse this one-token, one-slot pool (issue 28, defect 4: the auto choice refused it).
    model = model_for(
        config,
        dtype,
        attention_backend="reference",
        layer_loop=layer_loop,
        packed_weights=packed,
        quant=quant,
    )
    kv_shape = (config.num_layers, 1, 1, kv_lanes(config))
    kv = KVPages(kv=jax.ShapeDtypeStruct(kv_shape, dtype))
    batch = pack_chunks(
        [SeqChunk([0], 0, [0])], page_size=1, num_tokens=1, num_seqs=1, pages_per_seq=1, num_pages=1
    )
    # The pool is an argument, not a closed-over constant: unrolled layers index it directly.
    variables = jax.eval_shape(
        lambda kv: model.init(jax.random.key(0), kv, batch, method=model.init_all), kv
    )
    return variables["params"]


def pack_params(params: dict, config: ModelConfig, dtype, quant: QuantScheme | None = None) -> dict:
    """`params` (the canonical tree, either layer layout; `quantize_params`' where `quant`) as
    the packed module's tree (`model_for(..., packed_weights=True, quant=quant)`): each matmul
    kernel whose outputs fill whole panels in cpu_matmul.cc's layout (cpu_ffi.pack_weight; an
    int8 kernel stays int8), its scales (where quantized) flattened to one per output column,
    a tied table's transposed copy added as `packed_head`, every other leaf the same array.
    Jitted by the runner, so packing new weights (update_weights, wake_up) compiles nothing
    after the first time."""
    target = abstract_params(config, dtype, layer_loop_of(params), packed=True, quant=quant)

    def leaf(path, want: jax.ShapeDtypeStruct) -> jax.Array:
        keys = [p.key for p in path]
        if keys == ["packed_head"]:
            return pack_weight(params["embed_tokens"]["embedding"].T)
        have = params
        for key in keys:
            have = have[key]
        if have.shape == want.shape:
            return have
        if keys[-1].endswith(SCALE_SUFFIX):  # f32[..., *features] -> f32[..., N]
            return have.reshape(want.shape)
        *lead, _, k, _ = want.shape  # [..., N / 64, K, 64] from [..., K, *features]
        return pack_weight(have.reshape(*lead, k, -1))

    return jax.tree_util.tree_map_with_path(leaf, target)


def is_unstacked(params: dict) -> bool:
    """Whether `params` holds one subtree per layer ("layers_0", ...) rather than "layers"."""
    return "layers_0" in params


def unstack_layers(params: dict, shardings: dict | None = None) -> dict:
    """The stacked tree (`params["layers"]` leaves [num_layers, ...]) as the unrolled loop's tree:
    `params["layers_{i}"]` holding layer i's own arrays, so no step slices a stacked weight.

    Works on arrays and on `jax.ShapeDtypeStruct`s. With `shardings` (of the unstacked tree) the
    arrays land there directly. The stacked arrays are not kept: callers drop them, so the model
    is held once.
    """
    if is_unstacked(params):
        return params
    stacked = params["layers"]
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    rest = {k: v for k, v in params.items() if k != "layers"}
    if isinstance(jax.tree.leaves(stacked)[0], jax.ShapeDtypeStruct):
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked)
        return {**rest, **{f"layers_{i}": one for i in range(num_layers)}}

    # Sliced eagerly, one small cached program per leaf shape: one jitted split of every layer
    # took XLA:CPU 3 minutes to compile for smollm2-135m's 30 layers (a busy machine), at every
    # start of a random-weight model.
    layers = {}
    for i in range(num_layers):
        layer = jax.tree.map(lambda a, i=i: a[i], stacked)
        if shardings is not None:
            layer = jax.device_put(layer, shardings[f"layers_{i}"])
        layers[f"layers_{i}"] = layer
    return {**rest, **layers}


def layer_loop_of(params: dict) -> str:
    """The layer loop whose module runs `params` as they are laid out: "unrolled" or "scan"."""
    return "unrolled" if is_unstacked(params) else "scan"


def stack_layers(params: dict) -> dict:
    """The inverse of `unstack_layers`: the stacked tree that checkpoints store."""
    if not is_unstacked(params):
        return params
    num_layers = sum(1 for k in params if k.startswith("layers_"))
    layers = [params[f"layers_{i}"] for i in range(num_layers)]
    rest = {k: v for k, v in params.items() if not k.startswith("layers_")}
    if isinstance(jax.tree.leaves(layers[0])[0], jax.ShapeDtypeStruct):
        stacked = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((num_layers, *a.shape), a.dtype), layers[0]
        )
    else:
        stacked = jax.jit(lambda ls: jax.tree.map(lambda *a: jnp.stack(a), *ls))(layers)
    return {**rest, "layers": stacked}
