"""8-bit weights: per-output-channel symmetric quantization and the matmuls that read it.

    q, scale = quantize_weight(w, "int8", axis=-2)     # w [in, out] -> i8[in, out], f32[out]
    q, scale = quantize_weight(w, "fp8", -2, block=128)  # -> f8[in, out], f32[ceil(in/128), out]
    y = qdot(x, q, scale, scheme, jnp.bfloat16)        # x [T, in] -> [T, out]
    params = quantize_params(params, scheme, plan)     # a float tree -> the quantized tree

A quantized matmul weight is two param leaves: the kernel in int8 or float8_e4m3fn, its shape
the float kernel's ([in, *features], stacked [layers, ...] under the scan; `kernel_t`
[*features, in] where the scheme is `transposed`: fp8 W8A8 on GPUs), and `kernel_scale`,
float32 of the kernel's shape without the contracting axis: one scale per output column,
scale = max|w| over the column / 127 (int8) or / 448 (e4m3), so w ~= q * scale. A column of
zeros gets scale 0 and q 0. Shapes never depend on the values, so a quantized model's step
compiles once like a float one's. Block-scaled schemes (`QuantScheme.block`: a pre-quantized
`quant_method: fp8` checkpoint's 128x128 blocks, checkpoints/prequantized.py) keep one scale
per `block` rows of the contracting axis and per output column instead: `kernel_scale` is the
kernel's shape with the contracting axis counted in blocks, ceil(in / block), and
w ~= q * scale[row // block]; a checkpoint's 128x128 block scale is repeated over its 128
columns, so the values are the checkpoint's own (docs/architecture.md says why).

The dot reads the 8-bit kernel itself and applies the scale to its output columns:
`(x @ q.astype(dtype)) * scale`, the widening inside the dot's fusion (on TPU the MXU takes the
int8 operand directly), the multiply over [T, out] rather than over every weight. W8A8 schemes
also quantize x per token (dynamic: each row's max|x| / qmax) and run the dot in 8 bits:
int8 x int8 -> int32 (`preferred_element_type=jnp.int32`), or e4m3 x e4m3 -> float32, then
scale by the row's and the column's scales. Measured against qwix, which dequantizes the
weight before the dot: docs/architecture.md, "Quantized weights". A block-scaled kernel cannot
take one scale after the dot (they vary along the contracting axis): it runs one dot per block
of rows, batched, each block's f32 product scaled by its scale row and summed, weight-only.

Quantized: the decoder's matmuls (the fused qkv, o, gate_up, down, and a mixture of experts'
experts, weight-only in every scheme: the grouped matmul has no 8-bit operand path yet). Kept
in the model's dtype: the router and the norms (small, and routing is decided in float32), the
embedding (a gather of the step's rows: its bytes cost memory, not bandwidth) and the LM head
(the layer whose error lands on the logits unfiltered; Hugging Face's fp8 and W8A8 checkpoints
leave `lm_head` out too).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve.quantization import QMAX, QuantScheme

# Param paths (their last keys) that are quantized -> the contracting axis of the leaf,
# counted from the end, so it holds for the stacked [layers, ...] and the per-layer layouts.
QUANTIZED_PARAMS: dict[tuple[str, ...], int] = {
    ("self_attn", "qkv_proj", "kernel"): -4,  # [in, num_kv_heads, group + 2, head_dim]
    ("self_attn", "o_proj", "kernel"): -2,  # [heads * head_dim, hidden]
    ("mlp", "gate_up_proj", "kernel"): -3,  # [hidden, 2, intermediate]
    ("mlp", "down_proj", "kernel"): -2,  # [intermediate, hidden]
    # QuantScheme.transposed: the dense kernels as [*features, in], named so.
    ("self_attn", "qkv_proj", "kernel_t"): -1,
    ("self_attn", "o_proj", "kernel_t"): -1,
    ("mlp", "gate_up_proj", "kernel_t"): -1,
    ("mlp", "down_proj", "kernel_t"): -1,
    ("mlp", "experts_gate_up"): -3,  # [E, hidden, 2, intermediate]
    ("mlp", "experts_down"): -2,  # [E, intermediate, hidden]
}
SCALE_SUFFIX = "_scale"  # "kernel" -> "kernel_scale", "experts_down" -> "experts_down_scale"


def contracting_axis(path: tuple[str, ...]) -> int | None:
    """The contracting axis (negative) of the param at `path` if it is quantized, else None."""
    for suffix, axis in QUANTIZED_PARAMS.items():
        if tuple(path[-len(suffix) :]) == suffix:
            return axis
    return None


def quantize_weight(
    w: jax.Array, weights: str, axis: int, block: int | None = None
) -> tuple[jax.Array, jax.Array]:  # (q: like w in int8/e4m3, scale: f32[w.shape without axis])
    """Symmetric per-output-channel quantization of `w` over its contracting `axis`: every
    other axis is a channel with its own scale max|w| / QMAX[weights]. `block`: one scale per
    `block` rows of `axis` and per channel, the scale's `axis` of ceil(n / block) entries (the
    last block the rows that remain)."""
    if block is not None:
        return _quantize_blocks(w, weights, axis % w.ndim, block)
    w32 = w.astype(jnp.float32)
    qmax = QMAX[weights]
    scale = jnp.max(jnp.abs(w32), axis=axis) / qmax
    # A zero column keeps scale 0; dividing by 1 there gives q = 0, and q * 0 = 0 back.
    scaled = w32 / jnp.expand_dims(jnp.where(scale == 0, 1.0, scale), axis)
    if weights == "int8":
        q = jnp.clip(jnp.round(scaled), -qmax, qmax).astype(jnp.int8)
    else:  # the cast rounds to the nearest e4m3 value; |scaled| <= 448, e4m3's largest
        q = jnp.clip(scaled, -qmax, qmax).astype(jnp.float8_e4m3fn)
    return q, scale


def _quantize_blocks(
    w: jax.Array, weights: str, axis: int, block: int
) -> tuple[jax.Array, jax.Array]:  # (q like w, f32[w.shape with axis ceil(n / block) long])
    """quantize_weight's `block` case: (q like w, f32 scale with axis ceil(n / block) long)."""
    n = w.shape[axis]
    blocks = -(-n // block)
    pad = [(0, 0)] * w.ndim
    pad[axis] = (0, blocks * block - n)  # zero rows: they never raise a block's max
    split = jnp.pad(w.astype(jnp.float32), pad).reshape(
        *w.shape[:axis], blocks, block, *w.shape[axis + 1 :]
    )
    qmax = QMAX[weights]
    scale = jnp.max(jnp.abs(split), axis=axis + 1) / qmax
    scaled = split / jnp.expand_dims(jnp.where(scale == 0, 1.0, scale), axis + 1)
    if weights == "int8":
        q = jnp.clip(jnp.round(scaled), -qmax, qmax).astype(jnp.int8)
    else:
        q = jnp.clip(scaled, -qmax, qmax).astype(jnp.float8_e4m3fn)
    q = q.reshape(*w.shape[:axis], blocks * block, *w.shape[axis + 1 :])
    return jax.lax.slice_in_dim(q, 0, n, axis=axis), scale


def dequantize_weight(
    q: jax.Array, scale: jax.Array, axis: int, block: int | None = None
) -> jax.Array:  # f32, like q
    """q * scale, the scale broadcast over the contracting `axis`: what the dot computes with.
    `block`: the scale's `axis` counts blocks of `block` rows, each repeated over its rows."""
    if block is None:
        return q.astype(jnp.float32) * jnp.expand_dims(scale, axis)
    axis = axis % q.ndim
    rows = jnp.repeat(scale, block, axis=axis)
    return q.astype(jnp.float32) * jax.lax.slice_in_dim(rows, 0, q.shape[axis], axis=axis)


def quantize_activations(
    x: jax.Array, kind: str
) -> tuple[jax.Array, jax.Array]:  # (xq like x in int8/e4m3, scale f32[..., 1])
    """Dynamic per-token quantization of x [..., in]: each row's max|x| / QMAX[kind]."""
    x32 = x.astype(jnp.float32)
    qmax = QMAX[kind]
    scale = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / qmax
    scaled = x32 / jnp.where(scale == 0, 1.0, scale)
    if kind == "int8":
        return jnp.clip(jnp.round(scaled), -qmax, qmax).astype(jnp.int8), scale
    return jnp.clip(scaled, -qmax, qmax).astype(jnp.float8_e4m3fn), scale


def qdot(
    x: jax.Array,  # [..., in] activations in the compute dtype
    kernel: jax.Array,  # i8 | f8e4m3[in, *features] ([*features, in] where scheme.transposed)
    scale: jax.Array,  # f32[*features] (f32[ceil(in / block), *features] where scheme.block)
    scheme: QuantScheme,
    dtype,  # the compute dtype of the output
    precision=None,
) -> jax.Array:  # [..., *features] in dtype
    """x times the quantized kernel, its scale applied to the output columns after the dot.

    Weight-only: the kernel is widened to `dtype` inside the dot (one fusion: no float copy of
    the weight is written). W8A8: x is quantized per token and the dot runs in 8 bits,
    int8 -> int32 or e4m3 -> float32, then the token's scale times the column's. Block
    scales (weight-only): one dot per block of rows, each block's product scaled by its own
    scale row and summed (`_block_dot`)."""
    dims = (((x.ndim - 1,), (kernel.ndim - 1 if scheme.transposed else 0,)), ((), ()))
    if scheme.block is not None:
        return _block_dot(x.astype(dtype), kernel, scale, scheme.block, dtype, precision)
    features = kernel.ndim - 1
    if scheme.activations is None:
        y = jax.lax.dot_general(
            x.astype(dtype),
            kernel.astype(dtype),
            dims,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
    else:
        xq, x_scale = quantize_activations(x, scheme.activations)
        acc = jnp.int32 if scheme.activations == "int8" else jnp.float32
        y = jax.lax.dot_general(xq, kernel, dims, preferred_element_type=acc)
        y = y.astype(jnp.float32) * x_scale.reshape(*x_scale.shape, *([1] * (features - 1)))
    return (y * scale).astype(dtype)


# A block-scaled dot pads its rows to at least this many: libtpu compiles the one-row batched
# dot by widening the whole kernel into HBM (448 MiB for Llama-3.1-8B's gate_up), 8 rows and
# more with no temporaries (docs/history/quant_block_probe.py).
BLOCK_DOT_MIN_ROWS = 8


def _block_dot(
    x: jax.Array,  # [..., in] in the compute dtype
    kernel: jax.Array,  # f8e4m3 | i8[in, *features]
    scale: jax.Array,  # f32[ceil(in / block), *features]
    block: int,
    dtype,
    precision,
) -> jax.Array:  # [..., *features] in dtype
    """x [..., in] times a block-scaled kernel [in, *features] (scale f32[ceil(in / block),
    *features]): one dot per block of `block` rows, batched over the blocks, each reading the
    8-bit kernel itself (widened inside the dot as the per-column path's is), its f32 partial
    product scaled by that block's scale row and summed; the rows past the last whole block
    (one scale row) in a second dot scaled likewise. Nothing weight-sized is written on TPU:
    the scaling and the sum fuse into the dot's output (measured, quant_block_probe.py)."""
    lead, n, features = x.shape[:-1], x.shape[-1], kernel.shape[1:]
    rows = x.reshape(-1, n)
    t = rows.shape[0]
    if t < BLOCK_DOT_MIN_ROWS:
        rows = jnp.pad(rows, ((0, BLOCK_DOT_MIN_ROWS - t), (0, 0)))
    flat = kernel.reshape(n, -1)  # [in, F]: the features flattened
    scales = scale.reshape(scale.shape[0], -1)  # [ceil(in / block), F]
    blocks = n // block
    whole = blocks * block
    y = None
    if blocks:
        split = rows[:, :whole].reshape(-1, blocks, block)  # [T, blocks, block]
        parts = jax.lax.dot_general(  # [blocks, T, F]: each block's own product
            split,
            flat[:whole].reshape(blocks, block, -1).astype(dtype),
            (((2,), (1,)), ((1,), (0,))),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        y = jnp.sum(parts * scales[:blocks, None, :], axis=0)
    if whole < n:  # the last, partial block: one scale row, applied after its dot
        rest = jax.lax.dot_general(
            rows[:, whole:],
            flat[whole:].astype(dtype),
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        y = rest * scales[blocks] if y is None else y + rest * scales[blocks]
    return y[:t].reshape(*lead, *features).astype(dtype)


class QuantDense(nn.Module):
    """nn.DenseGeneral's x [T, in] -> [T, *features] over a quantized kernel: params `kernel`
    (the scheme's 8-bit type, [in, *features]) and `kernel_scale` (f32[*features], or
    f32[ceil(in / block), *features] for a block-scaled scheme), plus `bias` in `dtype` where
    the layer has one, added after the scaling."""

    features: tuple[int, ...]
    use_bias: bool
    dtype: Any
    scheme: QuantScheme

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # x: [..., in]
        if self.scheme.transposed:  # the contracting axis minor (QuantScheme.transposed)
            name, shape = "kernel_t", (*self.features, x.shape[-1])
        else:
            name, shape = "kernel", (x.shape[-1], *self.features)
        kernel = self.param(name, nn.initializers.zeros, shape, self.scheme.weight_dtype)
        scale_shape = self.features
        if self.scheme.block is not None:  # one row of scales per block of input rows
            scale_shape = (-(-x.shape[-1] // self.scheme.block), *self.features)
        scale = self.param(name + SCALE_SUFFIX, nn.initializers.ones, scale_shape, jnp.float32)
        # float32 models ask for full-precision matmuls (as _dense does for float kernels).
        precision = jax.lax.Precision.HIGHEST if self.dtype == jnp.float32 else None
        y = qdot(x, kernel, scale, self.scheme, self.dtype, precision)
        if self.use_bias:
            return y + self.param("bias", nn.initializers.zeros, self.features, self.dtype)
        return y


def quantize_params(params: dict, scheme: QuantScheme, plan=None, *, donate: bool = False) -> dict:
    """`params` (a float tree, either layer layout) with each QUANTIZED_PARAMS leaf replaced by
    its 8-bit kernel and a sibling `<name>_scale`: the tree `model_for(..., quant=scheme)` reads.

    One leaf at a time, each jitted onto `plan`'s shardings (a jaxserve.models.sharding
    ShardingPlan; None: where jit puts it), so no more than one float leaf's quantized copy is
    in flight. `donate`: the float leaves are deleted as they are replaced (the caller owns
    them), so the device holds the float tree less what has been quantized, never both.
    Leaves that are already quantized (a scale beside them) are kept as they are. A leaf may
    be a function of no arguments that returns it (checkpoints' lazy loader): it is called in
    its turn, so a loader's float leaves are read one at a time, each freed once quantized."""

    def walk(tree: dict, path: tuple[str, ...]) -> dict:
        out = {}
        for key, value in tree.items():
            here = (*path, key)
            axis = contracting_axis(here)
            if callable(value):  # read now, in its turn
                value = value()
            if isinstance(value, dict):
                out[key] = walk(value, here)
            elif axis is None or key + SCALE_SUFFIX in tree:
                out[key] = value
            else:
                name, w = key, value
                if scheme.block is not None and key != "kernel":
                    raise ValueError(
                        f"Param {'/'.join(here)!r} (a mixture of experts' experts) cannot be "
                        f"quantized as {scheme.label}: the grouped expert matmul applies one "
                        "scale a column after its dot, so block-scaled experts are not supported."
                    )
                if scheme.transposed and key == "kernel":  # stored [*features, in]
                    name, w, axis = "kernel_t", _transposed(value, axis), -1
                out[name], out[name + SCALE_SUFFIX] = _quantize_leaf(
                    w, scheme, axis, plan, (*path, name)
                )
                if donate and isinstance(value, jax.Array):
                    value.delete()
        return out

    return walk(params, ())


@functools.partial(jax.jit, static_argnums=(1,))
def _transposed(w: jax.Array, axis: int) -> jax.Array:
    """w with its contracting `axis` moved last (a float kernel, for QuantScheme.transposed)."""
    return jnp.moveaxis(w, axis, -1)


def _quantize_leaf(value, scheme: QuantScheme, axis: int, plan, path: tuple[str, ...]):
    """One leaf's (q, scale), placed as `plan` places them (the kernel's own sharding and its
    scale's rule in sharding.py)."""
    shardings = None
    if plan is not None:
        name = "/".join(path)
        ndim = len(value.shape)
        scale_ndim = ndim if scheme.block is not None else ndim - 1  # blocks keep the axis
        shardings = (
            plan.sharding(plan.param_spec(name, ndim)),
            plan.sharding(plan.param_spec(name + SCALE_SUFFIX, scale_ndim)),
        )
    return _quantizer(scheme.weights, axis, shardings, scheme.block)(value)


@functools.cache
def _quantizer(weights: str, axis: int, shardings, block: int | None = None):
    return jax.jit(
        functools.partial(quantize_weight, weights=weights, axis=axis, block=block),
        out_shardings=shardings,
    )


def transpose_kernels(
    params: dict, plan=None
) -> dict:  # kernel [.., in, *f] -> kernel_t [.., *f, in]
    """A quantized tree read in the [in, *features] layout (a pre-quantized checkpoint's) as
    QuantScheme.transposed's: each dense `kernel` becomes `kernel_t`, its contracting axis
    moved last, one 8-bit leaf at a time onto `plan`'s shardings (the old one freed); the
    scales ([*features]) are the same either way, renamed `kernel_t_scale`."""

    def walk(tree: dict, path: tuple[str, ...]) -> dict:
        out = {}
        for key, value in tree.items():
            here = (*path, key)
            axis = contracting_axis(here)
            if isinstance(value, dict):
                out[key] = walk(value, here)
            elif key == "kernel" and axis is not None:
                name = "/".join((*path, "kernel_t"))
                sharding = (
                    None if plan is None else plan.sharding(plan.param_spec(name, value.ndim))
                )
                out["kernel_t"] = _mover(axis, sharding)(value)
                if isinstance(value, jax.Array):
                    value.delete()
            elif key == "kernel" + SCALE_SUFFIX:
                out["kernel_t" + SCALE_SUFFIX] = value
            else:
                out[key] = value
        return out

    return walk(params, ())


@functools.cache
def _mover(axis: int, sharding):
    return jax.jit(lambda w: jnp.moveaxis(w, axis, -1), out_shardings=sharding)


def weight_bytes_by_dtype(shapes: Any, shardings: Any = None) -> dict[str, int]:
    """Bytes of a param tree (arrays or ShapeDtypeStructs) by dtype name, per device when a
    like-shaped tree of `shardings` says how each leaf is split."""
    leaves = jax.tree.leaves(shapes)
    split = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)
    out: dict[str, int] = {}
    for leaf, sharding in zip(leaves, split, strict=True):
        shape = leaf.shape if sharding is None else sharding.shard_shape(leaf.shape)
        size = 1
        for n in shape:
            size *= n
        name = jnp.dtype(leaf.dtype).name
        out[name] = out.get(name, 0) + size * jnp.dtype(leaf.dtype).itemsize
    return out
