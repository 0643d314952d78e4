"""LoRA adapters on the device: fixed-shape slots the step reads, and the low-rank update of a
projection for every token of a ragged step in one pass.

Many fine-tunes of one base model are served in one batch (Punica / S-LoRA style): each token
carries the slot of its request's adapter (`StepBatch.lora_slots`, 0 = the base model alone),
and each targeted projection adds `x @ A[slot] @ B[slot]` to its output. The slots are two
arrays per projection and layer of fixed shape, A [in, max_loras, max_rank] and B [max_loras,
max_rank, out], each adapter's rank zero-padded to max_rank and its scaling (lora_alpha / r, or
/ sqrt(r) for rsLoRA) folded into B; so loading, swapping or removing an adapter writes a slot
in place (`set_slot`, jitted with the arrays donated) and the step never recompiles. Slot 0 is
not stored: it is the zeros of "no adapter", and a token of slot s reads storage row s - 1.

The arrays are laid out as the params are (loaded.py): stacked [num_layers, ...] under
"layers" for the scanned layer loop, one subtree per layer under "layers_{i}" for the unrolled
one, so an unrolled layer reads its own arrays as they are. A is stored [in, M, R] rather than
[M, in, R] so that every slot's A is one [in, M*R] matrix without a copy. With both copies (a
layer's slice out of a stacked array, A's transpose) a burst of 64 on SmolLM2-135M's shape with
4 rank-16 adapters served 0.735x the base model's output tokens/s; without, 0.82-0.91x
(docs/benchmarks.md, Multi-LoRA).

How a step applies them (`LORA_KERNELS`, docs/architecture.md "Multi-LoRA" has the numbers):
- "dense": x @ A of every slot at once ([T, in] x [in, M*R]), the rows of other slots zeroed
  by a one-hot mask, then one [T, M*R] x [M*R, out] matmul. Two plain matmuls, M times the
  ideal flops of the update, and no gather: on a TPU the M*R columns (<= 128 for 8 rank-16
  adapters) are one MXU tile, so a memory-bound decode step pays about nothing for them.
- "gather": each token's A and B gathered ([T, in, R] and [T, R, out]) and contracted per
  token: the ideal flops, but T copies of the adapter weights made and read (Punica's BGMV
  reads them in place; XLA materialises the gather).
Both are exact (the padding is zeros). Measured on the CPU (the default): `dense`.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.config import ModelConfig

# The projections an adapter may target, by their Hugging Face names.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_KERNELS = ("dense", "gather")
# The kernel the step uses; $JAXSERVE_LORA_KERNEL overrides it (for measuring the other).
DEFAULT_LORA_KERNEL = "dense"


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target module of `config`, as Hugging Face's Linear has them.
    A mixture of experts has the attention's alone: adapters on its experts are refused
    (checkpoints/peft.py), so its MLP holds no slots."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {
        "q_proj": (c.hidden_size, q),
        "k_proj": (c.hidden_size, kv),
        "v_proj": (c.hidden_size, kv),
        "o_proj": (q, c.hidden_size),
    }
    if c.moe is not None:
        return shapes
    return {
        **shapes,
        "gate_proj": (c.hidden_size, c.intermediate_size),
        "up_proj": (c.hidden_size, c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size),
    }


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights on the host, scaled and laid out for the slots (unpadded rank).

    Modules it does not target, and layers it leaves alone, are absent or zero.
    """

    name: str
    rank: int
    # module -> (A f32[num_layers, in, rank], B f32[num_layers, rank, out] with scaling folded in)
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    source: str = ""  # where it was loaded from, for /v1/models and logs

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(m for m in TARGET_MODULES if m in self.weights)


def _by_layer(stacked: dict, layer_loop: str, num_layers: int) -> dict:
    """module -> arrays [L, ...] as the layer loop reads them: {"layers": stacked} (scan) or
    {"layers_{i}": layer i's} (unrolled)."""
    if layer_loop == "scan":
        return {"layers": stacked}
    return {f"layers_{i}": jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(num_layers)}


def empty_slots(
    config: ModelConfig, max_loras: int, max_rank: int, dtype, layer_loop: str = "scan"
) -> dict:
    """Zeroed slot arrays, per layer as `layer_loop` reads them (see the module docstring):
    module -> {"a": [(L,) in, max_loras, R], "b": [(L,) max_loras, R, out]}.

    Every target module has its arrays whatever the adapters target, so any adapter fits any
    slot without a new shape (a module an adapter leaves alone stays zero in its slot).
    """
    L = config.num_layers
    stacked = {
        m: {
            "a": np.zeros((L, i, max_loras, max_rank), dtype),
            "b": np.zeros((L, max_loras, max_rank, o), dtype),
        }
        for m, (i, o) in module_shapes(config).items()
    }
    return jax.tree.map(jnp.asarray, _by_layer(stacked, layer_loop, L))


def slot_weights(
    adapter: LoraAdapter | None,
    config: ModelConfig,
    max_rank: int,
    dtype,
    layer_loop: str = "scan",
) -> dict:
    """The host arrays `set_slot` writes for `adapter` (None: zeros), rank padded to max_rank,
    per layer as `empty_slots`: module -> {"a": [(L,) in, max_rank], "b": [(L,) max_rank, out]}."""
    L = config.num_layers
    stacked = {}
    for m, (i, o) in module_shapes(config).items():
        a = np.zeros((L, i, max_rank), dtype)
        b = np.zeros((L, max_rank, o), dtype)
        if adapter is not None and m in adapter.weights:
            wa, wb = adapter.weights[m]
            a[:, :, : wa.shape[-1]] = wa
            b[:, : wb.shape[1], :] = wb
        stacked[m] = {"a": a, "b": b}
    return _by_layer(stacked, layer_loop, L)


def set_slot(slots: dict, index: jax.Array, weights: dict) -> dict:
    """`slots` with storage row `index` (i32[], slot - 1) replaced by `weights` (slot_weights).

    Jitted with `slots` donated, it writes in place; one compiled shape for every slot and
    adapter, so adding or swapping adapters while serving compiles nothing.
    """

    def put(path, s, w):
        w = w.astype(s.dtype)
        if path[-1].key == "a":  # [..., in, M, R]: the slot axis is second to last
            return s.at[..., index, :].set(w)
        return s.at[..., index, :, :].set(w)  # b [..., M, R, out]

    return jax.tree_util.tree_map_with_path(put, slots, weights)


def lora_kernel() -> str:
    """The step's way of applying the adapters: $JAXSERVE_LORA_KERNEL, else the default."""
    kernel = os.environ.get("JAXSERVE_LORA_KERNEL") or DEFAULT_LORA_KERNEL
    if kernel not in LORA_KERNELS:
        raise ValueError(f"$JAXSERVE_LORA_KERNEL={kernel!r} is not one of {LORA_KERNELS}.")
    return kernel


def lora_delta(
    slots: dict,  # this layer's slot arrays: empty_slots' tree under "layers" or "layers_{i}"
    module: str,
    layer: jax.Array,  # i32[] the layer running (indexes stacked arrays; unused otherwise)
    x: jax.Array,  # [T, in] the projection's input
    token_slots: jax.Array,  # i32[T] each token's adapter slot; 0: none
    kernel: str | None = None,
) -> jax.Array:  # [T, out] what the adapters add to the projection's output
    """The low-rank update of `module` for every token, each by its own adapter."""
    a, b = slots[module]["a"], slots[module]["b"]
    if a.ndim == 4:  # stacked over the layers (the scan)
        a, b = a[layer], b[layer]
    n_in, num_loras, rank = a.shape  # a: [in, M, R]; b: [M, R, out]
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = kernel or lora_kernel()
    if kernel == "gather":
        index = jnp.maximum(token_slots - 1, 0)
        h = jnp.einsum("ti,itr->tr", x, a[:, index], precision=precision)
        h = jnp.where((token_slots > 0)[:, None], h, 0)
        return jnp.einsum("tr,tro->to", h, b[index], precision=precision).astype(x.dtype)
    # dense: every slot's x @ A in one matmul, other slots' columns zeroed, then one matmul.
    a_all = a.reshape(n_in, num_loras * rank)  # [in, M*R], no copy
    h = jnp.dot(x, a_all, precision=precision).reshape(-1, num_loras, rank)  # [T, M, R]
    own = token_slots[:, None] == jnp.arange(1, num_loras + 1)[None, :]  # bool[T, M]
    h = jnp.where(own[:, :, None], h, 0).reshape(-1, num_loras * rank)
    return jnp.dot(h, b.reshape(num_loras * rank, -1), precision=precision).astype(x.dtype)
