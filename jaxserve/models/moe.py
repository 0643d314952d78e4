"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral): exact routing, a grouped matmul, experts split
over the mesh.

    out, load = SparseMoe(config, dtype, plan, packed)(x, batch)   # x, out: [T, hidden]

Routing is the families' own, in float32: softmax over the router's logits, the top k, divided
by their sum where the family renormalises. Nothing is dropped: every real token reaches all of
its k experts whatever the balance (no capacity factor). A step's T * k (token, expert) rows are
sorted by expert, so each expert's rows are one contiguous run, and the experts run as a grouped
matmul over those runs, the group sizes being data: the shapes are the bucket's (T * k rows)
whatever the routing, so nothing recompiles. The bucket's padding tokens are routed to no expert
(sorted past every group), so they cost nothing and count in no expert's load.

The grouped matmul is chosen by where the step runs: on one CPU device with packed weights,
cpu_matmul.cc's grouped kernel (each expert's weights read once, only the experts a step uses:
`jax.lax.ragged_dot` lowers on the CPU to a dense masked dot of num_experts times the flops);
elsewhere pallas_kernels/grouped_matmul (megablox's gmm on TPU, ragged_dot on GPU).

Expert parallelism: under tensor parallelism N the experts are split over the model axis, E / N
per device (sharding.py), and every device's memory holds its own experts only. Activations are
replicated between the layers of a tensor-parallel step anyway (the attention's all-reduce), so
the routing is computed on every device, no token is sent anywhere, and each device runs the rows
of its own experts (`group_offset`); the combine is one all-reduce of the [T, hidden] output, the
same collective the dense MLP's row-split down projection ends with. When E is not a multiple of
N the experts are replicated and every device runs them all (logged by the plan).

The output combines each token's k rows in its top-k order, gathered back from the sorted rows
(no scatter-add, whose order is not fixed on accelerators), so a token's output does not depend
on the other tokens of the step (batch invariance).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve.models.config import ModelConfig
from jaxserve.models.quant import SCALE_SUFFIX
from jaxserve.models.step_batch import StepBatch, real_tokens
from jaxserve.quantization import QuantScheme
from pallas_kernels.grouped_matmul.ops import grouped_matmul
from pallas_kernels.ragged_paged_attention import cpu_ffi


def route(
    logits: jax.Array,  # f32[T, E] the router's logits
    top_k: int,
    renormalize: bool,
    valid: jax.Array,  # i32[] real tokens (the rest are the bucket's padding)
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The routing of a step: weights f32[T, k], order i32[T * k], sizes i32[E] and inverse
    i32[T * k].

    Row r of the sorted rows is (token order[r] // k, its (order[r] % k)-th expert); sizes counts
    each expert's rows among the real tokens; inverse puts the sorted rows back in token order.
    """
    num_tokens, num_experts = logits.shape
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)  # [T, k], in descending order as torch.topk
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    real = jnp.arange(num_tokens) < valid
    # Padding tokens go to expert E, past every group: sorted last, computed by no one.
    flat = jnp.where(real[:, None], experts, num_experts).reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    return weights, order, sizes, inverse


class SparseMoe(nn.Module):
    """The experts in place of the MLP: (out [T, hidden], load i32[E] real tokens per expert)."""

    config: ModelConfig
    dtype: jnp.dtype
    plan: object | None = None  # jaxserve.models.sharding.ShardingPlan
    packed: bool = False  # the experts in cpu_matmul.cc's panels (one CPU device)
    # 8-bit experts (models/quant.py), weight-only whatever the scheme's activations: the
    # grouped matmul widens them to `dtype` and each row's expert's scales follow it.
    quant: QuantScheme | None = None

    @nn.compact
    def __call__(self, x: jax.Array, batch: StepBatch | None = None):  # x: [T, hidden]
        c, m = self.config, self.config.moe
        e, h, i = m.num_experts, c.hidden_size, m.intermediate_size
        router = self.param("router", nn.initializers.lecun_normal(), (h, e), self.dtype)
        quant = self.quant
        if quant is not None and quant.block is not None:
            raise ValueError(
                f"A mixture of experts cannot run {quant.label}: the grouped expert matmul "
                "applies one scale a column after its dot, so block-scaled experts are not "
                "supported."
            )
        # Packed (one CPU device): float32 experts, or 8-bit ones (cpu_matmul_int8.cc's
        # grouped kernel, weight-only, the scales applied inside it).
        packable = self.packed
        pack_up = packable and (2 * i) % cpu_ffi.PANEL == 0
        pack_down = packable and h % cpu_ffi.PANEL == 0
        up_shape = (e, 2 * i // cpu_ffi.PANEL, h, cpu_ffi.PANEL) if pack_up else (e, h, 2, i)
        down_shape = (e, h // cpu_ffi.PANEL, i, cpu_ffi.PANEL) if pack_down else (e, i, h)
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        kind = self.dtype if quant is None else quant.weight_dtype
        if quant is not None:
            init = nn.initializers.zeros
        gate_up = self.param("experts_gate_up", init, up_shape, kind)
        down = self.param("experts_down", init, down_shape, kind)
        scales = ()
        if quant is not None:  # one per expert and output column: f32[E, 2, i], f32[E, h]
            ones = nn.initializers.ones
            up_scale_shape = (e, 2 * i) if pack_up else (e, 2, i)  # packed: flattened
            scales = (
                self.param("experts_gate_up" + SCALE_SUFFIX, ones, up_scale_shape, jnp.float32),
                self.param("experts_down" + SCALE_SUFFIX, ones, (e, h), jnp.float32),
            )

        logits = jax.lax.dot(
            x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
        )
        valid = jnp.int32(x.shape[0]) if batch is None else real_tokens(batch)
        renorm = m.normalization == "softmax_topk_renorm"
        weights, order, sizes, inverse = route(logits, m.top_k, renorm, valid)
        rows = x[order // m.top_k]  # [T * k, hidden], sorted by expert

        def experts(rows, gate_up, down, sizes, offset, *scales):
            """The rows of experts [offset, offset + local) through their MLPs; others 0.
            `scales`: the local experts' (gate_up f32[local, 2, i], down f32[local, h]) when
            quantized, each row's expert's scales applied to its outputs."""
            row_scale = _row_scales(sizes, offset, rows.shape[0], gate_up.shape[0])
            if pack_up and scales:  # weight-only, as every scheme's experts (models/quant.py)
                up = cpu_ffi.grouped_packed_matmul_int8(rows, gate_up, scales[0], sizes)
            elif pack_up:
                up = cpu_ffi.grouped_packed_matmul(rows, gate_up, sizes)
            else:
                flat = gate_up.reshape(gate_up.shape[0], h, 2 * i).astype(self.dtype)
                up = grouped_matmul(rows, flat, sizes, offset, precision=self._precision())
                if scales:
                    up = up * row_scale(scales[0].reshape(-1, 2 * i))
            up = up.reshape(-1, 2, i)
            act = (nn.silu(up[:, 0].astype(jnp.float32)) * up[:, 1]).astype(self.dtype)
            if pack_down and scales:
                return cpu_ffi.grouped_packed_matmul_int8(act, down, scales[1], sizes)
            if pack_down:
                return cpu_ffi.grouped_packed_matmul(act, down, sizes)
            out = grouped_matmul(
                act, down.astype(self.dtype), sizes, offset, precision=self._precision()
            )
            return out * row_scale(scales[1]) if scales else out

        plan = self.plan
        if plan is not None and plan.tensor_parallel > 1 and plan.experts_split:
            from jaxserve.models.sharding import MODEL

            local = e // plan.tensor_parallel

            def shard(rows, gate_up, down, sizes, inverse, weights, *scales):
                offset = jax.lax.axis_index(MODEL) * local
                part = experts(rows, gate_up, down, sizes, offset, *scales)
                return jax.lax.psum(_combine(part, inverse, weights, m.top_k), MODEL)

            out = jax.shard_map(
                shard,
                mesh=plan.mesh,
                in_specs=(P(), P(MODEL), P(MODEL), P(), P(), P(), *[P(MODEL)] * len(scales)),
                out_specs=P(),
                check_vma=False,  # Pallas kernels carry no varying-axes types
            )(rows, gate_up, down, sizes, inverse, weights, *scales)
        else:
            part = experts(rows, gate_up, down, sizes, None, *scales)
            out = _combine(part, inverse, weights, m.top_k)
        return out.astype(self.dtype), sizes

    def _precision(self):
        # float32 models ask for full-precision matmuls so accelerators do not drop to TF32.
        return jax.lax.Precision.HIGHEST if self.dtype == jnp.float32 else None


def _row_scales(sizes: jax.Array, offset, num_rows: int, num_local: int):
    """A function of per-expert scales f32[local, N] -> f32[num_rows, N], each sorted row's
    expert's (sizes: i32[E] rows per expert; offset: the first local expert or None). Rows of
    other devices' experts and padding rows take some local expert's: the grouped matmul gave
    them 0, which any scale keeps 0."""
    ends = jnp.cumsum(sizes)
    expert = jnp.searchsorted(ends, jnp.arange(num_rows, dtype=ends.dtype), side="right")
    local = jnp.clip(expert - (0 if offset is None else offset), 0, num_local - 1)
    return lambda scales: scales[local]


def _combine(
    out_rows: jax.Array,  # [T * k, hidden] the experts' outputs, sorted by expert
    inverse: jax.Array,  # i32[T * k] (route)
    weights: jax.Array,  # f32[T, k] (route)
    top_k: int,
) -> jax.Array:  # f32[T, hidden]
    """Each token's k expert outputs weighted and summed in its top-k order."""
    t = weights.shape[0]
    by_token = out_rows[inverse].reshape(t, top_k, -1).astype(jnp.float32)
    return jnp.sum(by_token * weights[:, :, None], axis=1)
