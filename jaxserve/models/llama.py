"""The Llama family in Flax, as one functional step over a ragged batch and a paged KV pool.

Gemma 2 and 3 are this model with ModelConfig's switches (docs/architecture.md, "Gemma"):
(1 + w) sandwich norms, GeGLU, embeddings times sqrt(hidden), query_pre_attn_scalar, per-layer
windows and RoPE (the unrolled loop), soft caps on attention logits and on the final logits.

    hidden, kv = model.apply({"params": params}, kv, batch)          # hidden: [T, hidden_size]
    logits = model.apply({"params": params}, hidden[rows], method="logits")

q/k/v are one matmul (`qkv_proj`, kernel [hidden, num_kv_heads, group + 2, head_dim]) and gate/up
another (`gate_up_proj`, [hidden, 2, intermediate]); checkpoints/weights.py fuses them on load.

A hybrid KV pool (`kv_layout`, kv_pool.KVLayout) gives each layer of the unrolled loop a static
pool slot and its group's page tables and write slots (StepBatch.group_tables / group_slots) in
every attention path; a uniform one keeps the carried layer index and `page_tables`, so its step
is unchanged. LoRA and the experts' load keep the true layer index.

The layer loop (`layer_loop`, or $JAXSERVE_LAYER_LOOP) is a switch. "scan" (`nn.scan`, params
stacked [num_layers, ...] under "layers") compiles one layer body whatever the depth. XLA:CPU
copies each layer's weight slices out of the stacked params before every dot (a dynamic-slice
fusion per weight), so a step streams the weights about three times. "unrolled" (a Python loop,
params "layers_0" ... "layers_{n-1}", each its own array) feeds the dots the arrays themselves,
at the price of num_layers copies of the layer to compile. Either way the KV pool rides in the
carry, so each layer writes its pages in place. "auto" (`resolve_layer_loop`) unrolls on the
CPU when the decoder weights exceed 64 MiB (past the caches, where the copies cost bandwidth) or
the model has at most 8 layers (few copies of the layer to compile), and scans everywhere else.
Measured on smollm2-135m (random weights, f32) through the engine, both layouts in one process,
in CPU-seconds (the 2-core machine was shared, load 4-12, so wall times meant little; XLA uses
both cores either way):

                                  scan        unrolled
    decode step, batch 1          105 ms      59 ms      0.56x
    decode step, batch 16         389 ms      288 ms     0.74x
    prefill, one 512-token step   2.62 s      2.44 s     0.93x
    compile, 64-token bucket      31 s        108 s      3.5x
    compile, 512-token bucket     14 s        31 s       2.2x

(An earlier measurement under heavier load had unrolled prefill 1.8x slower; in one process,
interleaved, it is not.) A shallow model unrolls too: on the 4-layer `tiny` of ../shared/peers
(5M params, f32) the scan's copies are a quarter of its batch-1 decode step, while unrolling
compiles only 4 layer bodies. Both layouts in one process, interleaved, 25 rounds of 20 steps
on device-resident inputs, on the shared 2-core machine (load ~11): best round 2.19 vs 3.70 ms
(0.59x), median CPU time 2.91 vs 4.02 ms (0.72x); all ten buckets' precompile 154 vs 135
CPU-seconds (1.14x). Deep models with small weights keep the scan, where compile time is most
of their start-up.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxserve import target
from jaxserve.models.attention import (
    get_attention_fn,
    resolve_backend,
    with_attention_plan,
    write_kv,
)
from jaxserve.models.config import ModelConfig
from jaxserve.models.kv_keys import KeyTransform
from jaxserve.models.kv_pool import KVLayout, KVPages
from jaxserve.models.lora import lora_delta
from jaxserve.models.moe import SparseMoe
from jaxserve.models.quant import SCALE_SUFFIX, QuantDense
from jaxserve.models.sharding import ShardingPlan, attention_over_heads
from jaxserve.models.step_batch import StepBatch, real_tokens
from jaxserve.quantization import QuantScheme
from pallas_kernels.ragged_paged_attention import common, cpu_ffi


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as Hugging Face's Llama does; `plus_one` (Gemma): scaled by
    (1 + w) in float32 and then cast, as Hugging Face's Gemma does (w starts at zero)."""

    eps: float
    dtype: jnp.dtype = jnp.float32
    plus_one: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # x: [..., dim]
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:  # Gemma: (x * (1 + w)) in float32, then the cast
            return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
        return scale * normed.astype(x.dtype)


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: [T, heads, head_dim]; cos, sin: f32[T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos[:, None, :] + rotated.astype(jnp.float32) * sin[:, None, :]
    return out.astype(x.dtype)


def _dense(
    features: int | tuple[int, ...],
    use_bias: bool,
    dtype: jnp.dtype,
    name: str,
    packed: bool = False,
    batch: StepBatch | None = None,
    quant: QuantScheme | None = None,
) -> Callable[[jax.Array], jax.Array]:
    """x [T, in] -> [T, *features]; the kernel is [in, *features], so a fused projection's parts
    (q/k/v heads, gate/up) are axes of one matmul's output, split without a copy. `packed`
    (the runner's CPU layout, `pack_params`): the kernel is in cpu_matmul.cc's panels instead,
    where its outputs fill whole panels, and the rows past `batch`'s real tokens (its bucket's
    padding) are not computed. `quant`: the kernel is 8-bit with per-column scales
    (models/quant.py); packed too where the runner packs an int8 scheme (`packs_weights`): its
    int8 panels go through cpu_matmul_int8.cc."""
    features = (features,) if isinstance(features, int) else tuple(features)
    fills_panels = packed and math.prod(features) % cpu_ffi.PANEL == 0
    if quant is not None and not fills_panels:
        return QuantDense(features, use_bias, dtype, quant, name=name)
    if fills_panels:
        if quant is None:
            dense = PackedDense(features, use_bias, dtype, name=name)
        else:
            dense = PackedQuantDense(features, use_bias, dtype, quant, name=name)
        return dense if batch is None else functools.partial(dense, valid=real_tokens(batch))
    # float32 models ask for full-precision matmuls so accelerators do not silently drop to TF32.
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    return nn.DenseGeneral(
        features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, precision=precision, name=name
    )


class PackedDense(nn.Module):
    """nn.DenseGeneral's x [T, in] -> [T, *features] over a kernel packed once at load,
    f32[prod(features) / 64, in, 64] (cpu_ffi.pack_weight), through cpu_matmul.cc: XLA:CPU's
    dot repacks the weights on every call, which costs a decode step about as much as the
    multiply. Its params are named as DenseGeneral's, so `pack_params` maps one onto the other."""

    features: tuple[int, ...]
    use_bias: bool
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        # x: [T, in]; valid: i32[], rows of x that are real (the rest come back 0, or the bias)
        panels = math.prod(self.features) // cpu_ffi.PANEL
        shape = (panels, x.shape[-1], cpu_ffi.PANEL)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), shape, self.dtype)
        out = cpu_ffi.packed_matmul(x, kernel, valid).astype(self.dtype)
        out = out.reshape(*x.shape[:-1], *self.features)
        if self.use_bias:
            return out + self.param("bias", nn.initializers.zeros, self.features, self.dtype)
        return out


class PackedQuantDense(nn.Module):
    """QuantDense's x [T, in] -> [T, *features] over 8-bit panels, i8 | f8e4m3[prod(features)
    / 64, in, 64] (`pack_params` of its `kernel`) and f32[prod(features)] scales (its
    `kernel_scale`, flattened), through cpu_matmul_int8.cc: the weights stream from memory in
    one byte, a quarter of float32's, which bound a decode step. Weight-only schemes (int8, and
    fp8, which is weight-only on the CPU) widen them in registers; W8A8 quantizes each row of x
    on the way in (`cpu_ffi.packed_matmul_int8`), as QuantDense's dot does, with exact int32
    sums. `packs_weights` says where the runner packs them."""

    features: tuple[int, ...]
    use_bias: bool
    dtype: jnp.dtype
    scheme: QuantScheme

    @nn.compact
    def __call__(self, x: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        # x: [T, in]; valid: i32[], rows of x that are real (the rest come back 0, or the bias)
        n = math.prod(self.features)
        shape = (n // cpu_ffi.PANEL, x.shape[-1], cpu_ffi.PANEL)
        kernel = self.param("kernel", nn.initializers.zeros, shape, self.scheme.weight_dtype)
        scale = self.param("kernel" + SCALE_SUFFIX, nn.initializers.ones, (n,), jnp.float32)
        activations = "float" if self.scheme.activations is None else "int8"
        out = cpu_ffi.packed_matmul_int8(x, kernel, scale, valid, activations).astype(self.dtype)
        out = out.reshape(*x.shape[:-1], *self.features)
        if self.use_bias:
            return out + self.param("bias", nn.initializers.zeros, self.features, self.dtype)
        return out


class Attention(nn.Module):
    """One layer's attention: the fused q/k/v projection, RoPE, the pool write, the ragged
    paged attention (with the layer's own window and, for Gemma 2, its logits soft-capped) and
    o_proj. x: [T, hidden]; cos, sin: f32[T, head_dim] of this layer's RoPE."""

    config: ModelConfig
    attention_backend: str
    dtype: jnp.dtype
    plan: ShardingPlan | None = None  # tensor parallel: attention runs on each device's heads
    packed: bool = False  # the kernels in cpu_matmul.cc's panels (`_dense`)
    quant: QuantScheme | None = None  # 8-bit q/k/v and o kernels (models/quant.py)
    layer_index: int | None = None  # the unrolled loop's layer (its window); None: any layer
    kv_layout: KVLayout | None = None  # a hybrid pool's groups (kv_pool.py); None: uniform
    kv_keys: KeyTransform | None = None  # an 8-bit pool's key conditioning (models/kv_keys.py)

    def _pool_view(self, layer, batch: StepBatch):
        """Where this layer's keys and values live: (pool index i32[], page tables i32[S, P],
        write slots i32[T]). The carried layer index with group 0's table and slots for a
        uniform pool (so its step is what it always was); else the layer's static slot and its
        group's table and slots (`kv_layout`)."""
        layout = self.kv_layout
        if layout is None or layout.is_uniform:
            return layer, batch.page_tables, batch.slot_mapping
        i = self.layer_index  # static: LlamaForCausalLM refuses a hybrid layout to the scan
        group = layout.layer_group[i]
        if not group:
            return jnp.int32(layout.layer_slot[i]), batch.page_tables, batch.slot_mapping
        tables, slots = batch.group_tables[group - 1], batch.group_slots[group - 1]
        return jnp.int32(layout.layer_slot[i]), tables, slots

    @nn.compact
    def __call__(self, x, kv_pool, layer, batch: StepBatch, cos, sin):
        c = self.config
        window = c.layer_window(self.layer_index)
        # The pool index, page tables and write slots of this layer; `layer` (its true index)
        # stays what LoRA reads its per-layer weights by.
        pool_layer, page_tables, slot_mapping = self._pool_view(layer, batch)
        t = x.shape[0]
        # One matmul for q, k and v: per KV head, its group of q heads, then its k, then its v.
        g = c.q_per_kv
        qkv = _dense(
            (c.num_kv_heads, g + 2, c.head_dim),
            c.qkv_bias,
            self.dtype,
            "qkv_proj",
            self.packed,
            batch,
            self.quant,
        )(x)
        split = self.plan is not None and self.plan.tensor_parallel > 1
        if split:
            # Each device projects its KV heads' whole groups (sharding.py), so its keys and
            # values, written into its share of the pool, never cross devices.
            qkv = jax.lax.with_sharding_constraint(qkv, self.plan.qkv_out)
        q = qkv[:, :, :g].reshape(t, c.num_heads, c.head_dim)  # q head j * g + i reads KV head j
        k, v = qkv[:, :, g], qkv[:, :, g + 1]  # [T, num_kv_heads, head_dim]
        if batch.lora is not None:  # each token's adapter adds its low-rank update
            q = q + _lora(self, batch, "q_proj", layer, x).reshape(q.shape)
            k = k + _lora(self, batch, "k_proj", layer, x).reshape(k.shape)
            v = v + _lora(self, batch, "v_proj", layer, x).reshape(v.shape)
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, self.dtype, c.gemma_norms, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, self.dtype, c.gemma_norms, name="k_norm")(k)
        backend = resolve_backend(self.attention_backend)
        view = (pool_layer, page_tables, slot_mapping)
        # RoPE, the pool write and the attention as one C++ call (float32 on this CPU). The
        # call has no soft cap: a soft-capped layer (Gemma 2) takes the jnp path below.
        fusable = c.attn_logit_softcap is None
        if (
            fusable
            and not split
            and backend == "xla"
            and cpu_ffi.ragged_runs_here(q, kv_pool, c.head_dim)
        ):

            def fused(q, k, v, kv_pool):  # RoPE, the pool write and the attention, in C++
                out, kv_pool = cpu_ffi.rope_write_attention(
                    q.reshape(t, c.num_kv_heads, g, c.head_dim),
                    k,
                    v,
                    cos,
                    sin,
                    slot_mapping,
                    kv_pool,
                    pool_layer,
                    batch.query_start,
                    batch.kv_lens,
                    page_tables,
                    batch.num_seqs,
                    c.sm_scale,
                    window,
                )
                return out.reshape(t, -1).astype(q.dtype), kv_pool

            def unfused(q, k, v, kv_pool):
                return self._attend(
                    q, k, v, kv_pool, view, batch, cos, sin, backend, split, window, layer
                )

            # Chosen when the step is lowered: a step compiled for an accelerator is unfused.
            heads, kv_pool = jax.lax.platform_dependent(
                q, k, v, kv_pool, cpu=fused, default=unfused
            )
        else:
            heads, kv_pool = self._attend(
                q, k, v, kv_pool, view, batch, cos, sin, backend, split, window, layer
            )
        out = _dense(c.hidden_size, c.o_bias, self.dtype, "o_proj", self.packed, batch, self.quant)(
            heads
        )
        if batch.lora is not None:
            out = out + _lora(self, batch, "o_proj", layer, heads)
        return out, kv_pool

    def _attend(
        self, q, k, v, kv_pool, view, batch: StepBatch, cos, sin, backend, split, window, true_layer
    ):
        """RoPE, this step's keys and values into the pool, attention: heads [T, H * d].
        `view`: the layer's (pool index, page tables, write slots) from `_pool_view`;
        `true_layer` (i32[]): the decoder layer, which an 8-bit pool's key transform is of."""
        c, t = self.config, q.shape[0]
        layer, page_tables, slot_mapping = view
        # Only a soft-capped model (Gemma 2) passes the keyword; every attention path takes it.
        cap = {} if c.attn_logit_softcap is None else {"soft_cap": c.attn_logit_softcap}
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if common.is_quantized(kv_pool.dtype) and self.kv_keys is not None:
            # Keys centred, smoothed and rotated before they are quantized, queries to match:
            # each query's attention weights are unchanged (models/kv_keys.py).
            index = true_layer if self.layer_index is None else self.layer_index
            q, k = self.kv_keys.apply(q, k, index)
        kv_pool = write_kv(
            kv_pool,
            layer,
            k,
            v,
            slot_mapping,
            1 if self.plan is None else self.plan.kv_shards,
            rows_sharding=self.plan.kv_rows if split else None,
        )
        # A quantized pool's scale lanes end each device's block: read per device, as a kernel.
        per_device = backend.startswith("pallas") or common.is_quantized(kv_pool.dtype)
        out = attention_over_heads(get_attention_fn(backend), self.plan, kernel=per_device)(
            q,
            kv_pool,
            layer,
            batch.query_start,
            batch.kv_lens,
            page_tables,
            batch.num_seqs,
            # The xla backend's tile list, made once per step before the layer loop.
            *(() if batch.attention_plan is None else (batch.attention_plan,)),
            sm_scale=c.sm_scale,
            num_kv_heads=c.num_kv_heads,
            sliding_window=window,
            **cap,
        )
        return out.reshape(t, -1), kv_pool


class MLP(nn.Module):
    """The gated MLP: SwiGLU (silu) or Gemma's GeGLU (gelu, tanh approximation). x: [T, hidden]."""

    config: ModelConfig
    dtype: jnp.dtype
    packed: bool = False  # the kernels in cpu_matmul.cc's panels (`_dense`)
    quant: QuantScheme | None = None  # 8-bit gate_up and down kernels (models/quant.py)

    @nn.compact
    def __call__(self, x, batch: StepBatch | None = None, layer=None):
        c = self.config
        gate_up = _dense(
            (2, c.intermediate_size),
            c.mlp_bias,
            self.dtype,
            "gate_up_proj",
            self.packed,
            batch,
            self.quant,
        )(x)
        gate, up = gate_up[:, 0], gate_up[:, 1]
        lora = batch is not None and batch.lora is not None
        if lora:  # each token's adapter adds its low-rank update
            gate = gate + _lora(self, batch, "gate_proj", layer, x)
            up = up + _lora(self, batch, "up_proj", layer, x)
        if c.hidden_act == "gelu_pytorch_tanh":  # Gemma's GeGLU
            act = jax.nn.gelu(gate, approximate=True) * up
        else:
            act = nn.silu(gate) * up
        out = _dense(
            c.hidden_size, c.mlp_bias, self.dtype, "down_proj", self.packed, batch, self.quant
        )(act)
        return out + _lora(self, batch, "down_proj", layer, act) if lora else out


def _lora(block: nn.Module, batch: StepBatch, module: str, layer, x: jax.Array) -> jax.Array:
    """What the adapters of `batch`'s tokens add to `module`'s output (x: [T, in] -> [T, out]).

    The slot arrays are laid out as the params (models/lora.py): under the decoder layer's own
    name, "layers" (stacked, the scan) or "layers_{i}" (its own arrays, the unrolled loop).
    """
    slots = batch.lora[block.parent.name]
    return lora_delta(slots, module, layer, x, batch.lora_slots)


class DecoderLayer(nn.Module):
    """One pre-norm block; its call signature is the `nn.scan` body (and the unrolled loop's).

    The carry is (hidden [T, hidden_size], the pool, the layer index i32[], and for a mixture of
    experts the tokens routed to each expert so far, i32[num_layers, num_experts], else None).
    Gemma (`gemma_norms`) wraps both the attention and the MLP in norms before and after:
    h + post_attention_layernorm(attn(input_layernorm(h))), then
    h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))); Llama's
    post_attention_layernorm is the MLP's input norm instead."""

    config: ModelConfig
    attention_backend: str
    dtype: jnp.dtype
    plan: ShardingPlan | None = None
    packed: bool = False  # the kernels in cpu_matmul.cc's panels (`_dense`)
    sparse: bool = False  # the experts (models/moe.py) in place of the dense MLP
    quant: QuantScheme | None = None  # 8-bit matmul kernels (models/quant.py)
    layer_index: int | None = None  # the unrolled loop's layer (its window); None: scanned
    kv_layout: KVLayout | None = None  # a hybrid pool's groups (kv_pool.py); None: uniform
    kv_keys: KeyTransform | None = None  # an 8-bit pool's key conditioning (models/kv_keys.py)

    @nn.compact
    def __call__(self, carry, batch: StepBatch, cos, sin):
        h, kv_pool, layer, load = carry
        c = self.config
        gemma = c.gemma_norms

        def norm(name):
            return RMSNorm(c.rms_norm_eps, self.dtype, gemma, name=name)

        attention = Attention(
            c,
            self.attention_backend,
            self.dtype,
            self.plan,
            self.packed,
            self.quant,
            self.layer_index,
            self.kv_layout,
            self.kv_keys,
            name="self_attn",
        )
        attn_out, kv_pool = attention(norm("input_layernorm")(h), kv_pool, layer, batch, cos, sin)
        if gemma:
            attn_out = norm("post_attention_layernorm")(attn_out)
        h = h + attn_out
        normed = norm("pre_feedforward_layernorm" if gemma else "post_attention_layernorm")(h)
        if self.sparse:
            out, routed = SparseMoe(c, self.dtype, self.plan, self.packed, self.quant, name="mlp")(
                normed, batch
            )
            load = load.at[layer].set(routed)
        else:
            out = MLP(c, self.dtype, self.packed, self.quant, name="mlp")(normed, batch, layer)
        if gemma:
            out = norm("post_feedforward_layernorm")(out)
        return (h + out, kv_pool, layer + 1, load), None


LAYER_LOOPS = ("auto", "scan", "unrolled")


# The fewest rows the LM head is run for when a step has more row slots than real rows.
HEAD_MIN_ROWS = 8


def head_tiers(num_rows: int) -> tuple[int, ...]:
    """The row counts `logits_of_rows` may run the LM head for in a bucket of `num_rows` rows:
    powers of two from HEAD_MIN_ROWS up, then `num_rows` itself."""
    tiers = []
    while HEAD_MIN_ROWS * 2 ** len(tiers) < num_rows:
        tiers.append(HEAD_MIN_ROWS * 2 ** len(tiers))
    return (*tiers, num_rows)


def logits_of_rows(
    logits_of: Callable[..., jax.Array],  # (hidden [N, hidden_size], valid i32[]) -> f32[N, V]
    hidden: jax.Array,  # [T, hidden_size] final hidden states of the step's tokens
    rows: jax.Array,  # i32[S] the token whose logits each row samples from (real rows first)
    num_rows: jax.Array,  # i32[] real rows; rows [num_rows, S) are padding
    skips_padding: bool = False,  # logits_of leaves out the rows from its valid on (packed)
) -> jax.Array:  # f32[S, vocab]; padding rows are 0 when a smaller tier ran
    """The LM head over each row's token, run only for the smallest tier that holds the real rows.

    A step's rows are padded to its bucket's row count, and every padding row used to pay a whole
    LM-head row: on smollm2-135m a 128-token prefill of one prompt runs in a 64-row bucket, whose
    [64, 576] x [576, 49152] head is ~3.6 GFLOP beside the prompt's ~34. Tiers are powers of two
    from HEAD_MIN_ROWS (`head_tiers`), chosen on the device (`lax.switch`) so the step keeps one
    compiled shape. Real rows come first (batch.py), so a tier is a prefix of the rows.
    Measured there (the step alone, both heads compiled in one process and interleaved, shared
    2-core machine): 0.90x the wall time and 0.89x the CPU time of the step. Only the smallest
    tier runs in precompile's batches; a first step in a larger tier showed no set-up cost
    beyond the noise (decode steps of 12-64 rows in a 64-row bucket).
    """
    if skips_padding:  # the packed head computes the real rows alone: no tiers to choose
        return logits_of(hidden[rows], num_rows)
    tiers = head_tiers(rows.shape[0])
    if len(tiers) == 1:
        return logits_of(hidden[rows])

    def tier(n: int) -> Callable[[], jax.Array]:
        def run():
            logits = logits_of(hidden[rows[:n]])
            return jnp.pad(logits, ((0, rows.shape[0] - n), (0, 0)))

        return run

    index = jnp.sum(jnp.asarray(tiers[:-1]) < num_rows)  # the first tier >= num_rows
    return jax.lax.switch(index, [tier(n) for n in tiers])


def _rope_angles(rope, head_dim: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin f32[T, head_dim] of `rope` (a RopeConfig) at `positions` i32[T]."""
    inv_freq = jnp.asarray(rope.inv_freq(head_dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


# Decoder weights above which the CPU unrolls the layer loop: past the caches, the scan's copy of
# each weight slice streams the weights from memory twice more per step (see the docstring).
UNROLL_MIN_LAYER_BYTES = 64 * 2**20
# Layers up to which the CPU unrolls whatever the weights: the copies still cost a small model's
# step a quarter of its time, and so few layer bodies compile in about the time of the scan.
UNROLL_MAX_SHALLOW_LAYERS = 8


def layer_weight_bytes(config: ModelConfig, dtype) -> int:
    """Bytes of the decoder layers' matmul weights (what a decode step streams), for
    `resolve_layer_loop`."""
    c = config
    q_kv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    attention = c.hidden_size * q_kv + c.num_heads * c.head_dim * c.hidden_size
    dense = 3 * c.hidden_size * c.intermediate_size
    if c.moe is not None:  # every expert, and the router
        m = c.moe
        dense = m.num_experts * (3 * c.hidden_size * m.intermediate_size + c.hidden_size)
    return c.num_layers * (attention + dense) * jnp.dtype(dtype).itemsize


def resolve_layer_loop(
    layer_loop: str = "auto", config: ModelConfig | None = None, dtype=jnp.float32
) -> str:
    """The layer loop to build, "scan" or "unrolled".

    "auto" is $JAXSERVE_LAYER_LOOP when set; else "unrolled" on the CPU for a model whose decoder
    weights exceed UNROLL_MIN_LAYER_BYTES (there the scan's weight-slice copies cost a decode
    step up to half its time) or that has at most UNROLL_MAX_SHALLOW_LAYERS layers (a quarter
    of a small model's step, for little more compile time), and the scan everywhere else: on
    accelerators and for deep models with small weights, where compile time (one layer body
    instead of num_layers) matters more. Without a `config` "auto" means the scan. Loaders and
    `LlamaForCausalLM` resolve it the same way, so the params' layout and the module agree.

    A model whose layers differ in window or RoPE (Gemma: `ModelConfig.layers_differ`) is
    unrolled whatever was asked: each layer's window is a static argument of the attention, and
    one scanned body cannot hold two (docs/architecture.md, "Gemma").
    """
    if layer_loop in LAYER_LOOPS and config is not None and config.layers_differ:
        return "unrolled"
    if layer_loop == "auto":
        unroll = config is not None and (
            layer_weight_bytes(config, dtype) > UNROLL_MIN_LAYER_BYTES
            or config.num_layers <= UNROLL_MAX_SHALLOW_LAYERS
        )
        by_size = "unrolled" if unroll and target.current().platform == "cpu" else "scan"
        layer_loop = os.environ.get("JAXSERVE_LAYER_LOOP") or by_size
    if layer_loop not in LAYER_LOOPS[1:]:
        raise ValueError(
            f"layer_loop={layer_loop!r} (or $JAXSERVE_LAYER_LOOP) is not one of {LAYER_LOOPS}."
        )
    return layer_loop


def _checked_layout(layout: KVLayout | None, config: ModelConfig, loop: str) -> KVLayout | None:
    """`layout` if it fits `config` and `loop`; None for a uniform one (the plain step)."""
    if layout is None or (layout.is_uniform and layout.group_size == config.num_layers):
        return None
    windows = tuple(layout.windows[g] for g in layout.layer_group)
    wanted = tuple(config.layer_window(i) for i in range(config.num_layers))
    if windows != wanted:
        raise ValueError(
            f"The KV layout's per-layer windows {windows} are not the model's {wanted}: it was "
            "made for another model (kv_pool.kv_layout)."
        )
    if loop == "scan":
        raise ValueError(
            f"A hybrid KV layout ({layout.num_groups} groups of {layout.group_size} layers) "
            "needs the unrolled layer loop: each layer's pool slot and page table are static, "
            "and the scanned body is one layer for all."
        )
    return layout


class LlamaForCausalLM(nn.Module):
    """Decoder-only Llama-family model over a ragged, paged batch."""

    config: ModelConfig
    attention_backend: str = "auto"
    dtype: jnp.dtype = jnp.float32
    plan: ShardingPlan | None = None  # the mesh the step is split over (None: one device)
    layer_loop: str = (
        "auto"  # "scan" | "unrolled" | "auto" (by platform and size: resolve_layer_loop)
    )
    # The matmul kernels (and a tied head's packed copy) in cpu_matmul.cc's panels: the params
    # are `pack_params` of the canonical tree. The runner's choice (`packs_weights`), CPU only.
    packed_weights: bool = False
    # 8-bit decoder matmuls (models/quant.py): the params are `quantize_params` of the float
    # tree. The embedding, the head, the norms and a router stay in `dtype`.
    quant: QuantScheme | None = None
    # The pool's layer groups (kv_pool.KVLayout): a hybrid layout indexes the pool by each
    # layer's slot and reads its group's tables (unrolled loop only). None: uniform.
    kv_layout: KVLayout | None = None
    # An 8-bit pool's keys centred, smoothed and rotated, queries to match (models/kv_keys.py;
    # calibrated at start-up by runtime/key_calibration.py). None: keys stored as computed.
    kv_keys: KeyTransform | None = None

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.dtype
        )
        quant = self.quant
        fp8 = quant is not None and quant.weights == "fp8"
        if self.packed_weights and fp8 and (quant.activations is not None or quant.transposed):
            raise ValueError(
                f"Packed e4m3 kernels run weight-only (cpu_matmul_int8.cc); {quant.label} "
                "weights need packed_weights=False."
            )
        layer_args = (c, self.attention_backend, self.dtype, self.plan, self.packed_weights)
        loop = resolve_layer_loop(self.layer_loop, c, self.dtype)
        layout = _checked_layout(self.kv_layout, c, loop)
        if loop == "scan":
            self.layers = nn.scan(
                DecoderLayer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                length=c.num_layers,
            )(*layer_args, sparse=c.moe is not None, quant=quant, kv_keys=self.kv_keys)
        else:  # params "layers_0" ... "layers_{n-1}", each its own array (see the docstring)
            sparse = c.moe is not None
            self.layers = [
                DecoderLayer(
                    *layer_args,
                    sparse=sparse,
                    quant=quant,
                    layer_index=i,
                    kv_layout=layout,
                    kv_keys=self.kv_keys,
                )
                for i in range(c.num_layers)
            ]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype, c.gemma_norms)
        if not c.tie_word_embeddings:
            self.lm_head = _dense(c.vocab_size, False, self.dtype, "lm_head", self.packed_weights)
        elif self._packs_head():
            # The tied table transposed into panels: the head's matmul without XLA's repacking
            # of a table that never changes (the lookup keeps reading `embed_tokens`).
            shape = (c.vocab_size // cpu_ffi.PANEL, c.hidden_size, cpu_ffi.PANEL)
            self.packed_head = self.param("packed_head", nn.initializers.zeros, shape, self.dtype)

    def _packs_head(self) -> bool:
        """Whether the tied head reads `packed_head` (its rows fill whole panels)."""
        c = self.config
        return self.packed_weights and c.tie_word_embeddings and c.vocab_size % cpu_ffi.PANEL == 0

    def head_skips_padding(self) -> bool:
        """Whether `logits` leaves out the rows past its `valid` (the head is a packed matmul,
        tied or not), so a step needs no row tiers (`logits_of_rows`)."""
        return self.packed_weights and self.config.vocab_size % cpu_ffi.PANEL == 0

    def __call__(self, kv: KVPages, batch: StepBatch) -> tuple[jax.Array, KVPages]:
        """Runs every token of `batch`: final hidden states [T, hidden_size] and the new pool."""
        batch = jax.tree.map(jnp.asarray, batch)  # host numpy batches work outside jit too
        batch = with_attention_plan(self.attention_backend, batch)  # once, not once per layer
        c = self.config
        h = self.embed_tokens(batch.token_ids)
        if c.gemma_norms:  # Gemma: times sqrt(hidden) rounded to the compute dtype, as HF does
            h = h * jnp.asarray(math.sqrt(c.hidden_size), self.dtype)
        moe = c.moe
        load = None if moe is None else jnp.zeros((c.num_layers, moe.num_experts), "i4")
        carry = (h, kv.kv, jnp.int32(0), load)
        # cos and sin f32[T, head_dim] of each RoPE the layers use (Gemma 3: local and global).
        ropes = {c.layer_rope(i) for i in range(c.num_layers)}
        trig = {rope: _rope_angles(rope, c.head_dim, batch.positions) for rope in ropes}
        h, kv_pool, load = self._run_layers(carry, batch, trig)
        if load is not None:  # read by the step (model_runner.step_impl) with the outputs
            self.sow("intermediates", "expert_load", load)
        return self.norm(h), KVPages(kv=kv_pool)

    def _run_layers(self, carry, batch: StepBatch, trig: dict):
        """The decoder layers over `carry` (DecoderLayer's): scanned or unrolled, each layer
        with the cos and sin of its own RoPE (`trig`: RopeConfig -> (cos, sin)); returns
        (h, kv_pool, load)."""
        if isinstance(self.layers, nn.Module):  # the scan: every layer alike
            carry, _ = self.layers(carry, batch, *trig[self.config.layer_rope()])
        else:
            for i, layer in enumerate(self.layers):
                carry, _ = layer(carry, batch, *trig[self.config.layer_rope(i)])
        h, kv_pool, _, load = carry
        return h, kv_pool, load

    def init_all(self, kv: KVPages, batch: StepBatch) -> jax.Array:
        """Touches every parameter (the forward and the head), for `init` and `eval_shape`."""
        hidden, _ = self(kv, batch)
        return self.logits(hidden)

    def logits(self, hidden: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """Float32 logits [N, vocab_size] of final hidden states [N, hidden_size]; where the
        head skips padding (`head_skips_padding`), rows from `valid` (i32[]) on are 0."""
        if self.config.tie_word_embeddings and self._packs_head():
            out = cpu_ffi.packed_matmul(hidden, self.packed_head, valid)
        elif self.config.tie_word_embeddings:
            precision = jax.lax.Precision.HIGHEST if self.dtype == jnp.float32 else None
            emb = self.embed_tokens.embedding  # [vocab, hidden]
            # Contract the embedding's own last axis, not a transpose of it: for one row XLA:CPU
            # fused `hidden @ emb.T` with a copy of the transposed table into a loop (smollm2-
            # 135m: 11 ms against 8.9 on JAX 0.10, 30 against 12 ms on 0.12, the head alone).
            out = jax.lax.dot_general(hidden, emb, (((1,), (1,)), ((), ())), precision=precision)
        elif self.head_skips_padding():
            out = self.lm_head(hidden, valid)
        else:
            out = self.lm_head(hidden)
        out = out.astype(jnp.float32)
        cap = self.config.final_logit_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap)
            out = cap * jnp.tanh(out / cap)
        return out
