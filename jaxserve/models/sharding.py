"""Every `NamedSharding` of the engine, decided in one place: the mesh, the params, the KV pool.

    mesh = make_mesh(tensor_parallel=4)            # axes ("data", "model"), shape (1, 4)
    plan = ShardingPlan.create(mesh, model_config)
    params = plan.place(params)                    # or load straight into plan.params(abstract)
    kv = init_kv_pages(..., sharding=plan.kv_pages)

Tensor parallelism over the "model" axis, Megatron-style: the fused qkv and gate/up projections
are split by output columns (whole KV heads with their query groups; intermediate columns), o and
down by input rows, so each layer needs one all-reduce after attention and one after the MLP,
and XLA's SPMD partitioner inserts them: the step stays one jitted function, with no
communication code of ours. The embedding and the LM head are split by
vocabulary rows, so the logits arrive split by vocabulary; sampling reduces over it.

The KV pool is split by KV head, and each device must hold the KV heads its query heads read.
Query head h reads KV head h // g (g = num_heads // num_kv_heads), and the q heads are split into
N contiguous blocks, so:
- num_kv_heads % N == 0: each device holds num_kv_heads / N whole GQA groups.
- N % num_kv_heads == 0 (N exceeds the KV heads): each KV head is replicated on N / num_kv_heads
  devices, each attending with a slice of that head's group of query heads. The fused qkv kernel
  holds a KV head's whole group, so these devices each project the group's queries and keep their
  slice: q's share of the projection is computed N / num_kv_heads times, in exchange for one
  matmul per layer instead of three.
- otherwise: the pool (and the qkv projection) is replicated on every device, and every device
  runs attention over all heads (smollm2-135m's 3 KV heads at tensor parallel 2 or 4). A Pallas
  kernel cannot be split by XLA, so `attention_over_heads` runs it under shard_map on replicated
  operands: the same work and memory the XLA backend's replicated attention costs, and no
  communication (q comes out of the replicated projection already replicated; an o_proj split by
  rows slices the replicated output locally).
To say this with NamedShardings the plan factors the model axis into ("model_kv", "model_rep"):
KV tensors are split over "model_kv" only, everything else over both (in row-major order, so the
query block of device (i, j) is i * rep + j, which reads KV block i).

The "data" axis is kept in the mesh's name and shape for what comes later, but must be 1: data
parallelism inside one engine would need a scheduler that keeps each request's pages on its data
shard. More throughput comes from replicas behind a load balancer (docs/architecture.md,
"Scale-out").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.models.config import ModelConfig
from jaxserve.models.kv_pool import kv_lanes

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "model")
KV_AXIS, REP_AXIS = "model_kv", "model_rep"
MODEL = (KV_AXIS, REP_AXIS)  # split over both: the whole model axis, device order preserved


def parse_mesh_shape(text: str) -> tuple[int, int]:
    """'1x4' or '1,4' (data x model) -> (1, 4); ValueError with the text otherwise."""
    parts = re.split(r"[x,]", text.strip().lower())
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"Mesh shape {text!r} must be DATAxMODEL with positive sizes, e.g. 1x4.")
    return shape


def make_mesh(
    tensor_parallel: int = 1,
    mesh_shape: Sequence[int] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A ("data", "model") mesh over the first data * model devices (all of them when multi-host).

    `mesh_shape` (data, model) wins over `tensor_parallel` (which means (1, tensor_parallel)).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(mesh_shape) if mesh_shape is not None else (1, tensor_parallel)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"mesh_shape={shape} must be (data, model) with positive sizes.")
    data, model = shape
    if data != 1:
        raise ValueError(
            f"mesh_shape={shape}: a data axis of {data} is not supported inside one engine (its "
            "scheduler would have to keep each request's KV pages on its data shard); run "
            f"{data} engines of (1, {model}) behind a load balancer instead."
        )
    n = data * model
    if n > len(devices):
        raise ValueError(
            f"The mesh {shape} needs {n} devices but JAX sees {len(devices)}: "
            f"{sorted({d.platform for d in devices})}."
        )
    if jax.process_count() > 1 and n != len(devices):
        raise ValueError(
            f"With {jax.process_count()} processes the mesh must span all {len(devices)} devices "
            f"(every process drives its own), not {n}."
        )
    try:
        # Topology-aware order on TPU slices (neighbours on the interconnect are neighbours here).
        grid = _topology_grid(shape, devices[:n])
    except Exception:  # e.g. a subset of a slice it cannot lay out: any order is correct
        grid = np.asarray(devices[:n], dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES)


def _topology_grid(shape: tuple[int, int], devices: Sequence[jax.Device]) -> np.ndarray:
    from jax.experimental import mesh_utils

    return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)


def kv_split(tensor_parallel: int, num_kv_heads: int) -> int:
    """Over how many devices the KV heads are split (the rest of the model axis replicates them)."""
    if num_kv_heads % tensor_parallel == 0:
        return tensor_parallel
    if tensor_parallel % num_kv_heads == 0:
        return num_kv_heads
    return 1


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """The shardings of one model on one mesh. Hashable, so the model may hold its mesh."""

    mesh: Mesh  # axes ("data", "model_kv", "model_rep")
    config: ModelConfig

    @staticmethod
    def create(mesh: Mesh, config: ModelConfig) -> ShardingPlan:
        """Factors `mesh`'s model axis for `config`'s KV heads (see the module docstring)."""
        if tuple(mesh.axis_names) != MESH_AXES:
            raise ValueError(f"The mesh has axes {mesh.axis_names}; expected {MESH_AXES}.")
        data, tp = mesh.devices.shape
        kv = kv_split(tp, config.num_kv_heads)
        devices = mesh.devices.reshape(data, kv, tp // kv)
        plan = ShardingPlan(Mesh(devices, ("data", KV_AXIS, REP_AXIS)), config)
        if tp > 1 and config.moe is not None:
            logger.info(
                "tensor parallel %d: %s",
                tp,
                f"experts split {tp} ways ({config.moe.num_experts // tp} a device)"
                if plan.experts_split
                else f"all {config.moe.num_experts} experts on every device (not a multiple "
                f"of {tp})",
            )
        if tp > 1:
            logger.info(
                "tensor parallel %d: KV heads split %d ways, each replicated %d times; %s",
                tp,
                kv,
                tp // kv,
                "attention local" if plan.attention_is_local else "attention resharded by XLA",
            )
        return plan

    @property
    def tensor_parallel(self) -> int:
        return self.mesh.shape[KV_AXIS] * self.mesh.shape[REP_AXIS]

    @property
    def experts_split(self) -> bool:
        """Whether a mixture of experts' experts are split over the model axis (expert
        parallelism: each device holds num_experts / tensor_parallel of them, models/moe.py);
        otherwise every device holds and runs them all."""
        moe = self.config.moe
        return moe is not None and moe.num_experts % self.tensor_parallel == 0

    @property
    def kv_shards(self) -> int:
        """Distinct KV-head shards: each device holds num_kv_heads / kv_shards heads."""
        return self.mesh.shape[KV_AXIS]

    @property
    def attention_is_local(self) -> bool:
        """Each device's query heads read only the KV heads it holds (no resharding needed)."""
        c, tp = self.config, self.tensor_parallel
        return c.num_heads % tp == 0 and (self.kv_shards == tp or self.kv_shards == c.num_kv_heads)

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> NamedSharding:
        return self.sharding(P())

    @property
    def platform(self) -> str:
        """The platform of the mesh's devices ('tpu', 'gpu', 'cpu'), abstract ones included."""
        return self.mesh.devices.flat[0].platform

    @property
    def kv_lanes(self) -> int:
        """The pool's minor dimension on this mesh: each KV shard's heads' keys and values, padded
        to whole 128-lane tiles on TPU (jaxserve/models/kv_pool.py)."""
        return kv_lanes(self.config, self.kv_shards, self.platform)

    def pool_lanes(self, kv_dtype) -> int:
        """`kv_lanes` for a pool of `kv_dtype`: a quantized one (int8 / e4m3) adds each shard's
        2 * heads scale exponents before the padding (jaxserve/models/kv_pool.py)."""
        return kv_lanes(self.config, self.kv_shards, self.platform, kv_dtype)

    @property
    def qkv_out(self) -> NamedSharding:
        """The fused projection's output [T, num_kv_heads, group + 2, head_dim]: by KV head, each
        device of a KV shard holding its heads' whole query groups, keys and values."""
        return self.sharding(P(None, KV_AXIS, None, None))

    @property
    def kv_rows(self) -> NamedSharding:
        """A step's new keys and values, [T, lanes]: split as the pool's lanes are."""
        return self.sharding(P(None, KV_AXIS))

    @property
    def kv_pages(self) -> NamedSharding:
        # [num_layers, num_pages, page_size, lanes]: the lanes hold each KV shard's heads
        # contiguously (kv_pages.py), so splitting them splits by KV head.
        return self.sharding(P(None, None, None, KV_AXIS))

    def param_spec(self, path: str, ndim: int) -> P:
        """The PartitionSpec of the param at `path` ('layers/self_attn/qkv_proj/kernel', or
        'layers_3/...' for one layer of the unrolled layout: dims count from the end)."""
        c, tp = self.config, self.tensor_parallel
        heads_split = c.num_heads % tp == 0
        for pattern, dim, axes, ok in (
            # Vocabulary-parallel embedding [V, H] and head [H, V].
            (r"embed_tokens/embedding", 0, MODEL, c.vocab_size % tp == 0),
            (r"lm_head/kernel", -1, MODEL, c.vocab_size % tp == 0),
            # Column-split (output features; biases follow their kernel's columns). The fused
            # qkv [.., num_kv_heads, group + 2, head_dim] is split by KV head: a device holds its
            # KV heads' k, v and whole q groups (see the module docstring for replicated KV heads).
            # A quantized kernel's scales (models/quant.py: [..., *features], one per output
            # column) are split as its columns are: at the same axis from the end.
            (r"self_attn/qkv_proj/(kernel|bias|kernel_scale)", -3, KV_AXIS, self.kv_shards > 1),
            (
                r"mlp/gate_up_proj/(kernel|bias|kernel_scale)",
                -1,
                MODEL,
                c.intermediate_size % tp == 0,
            ),
            # Row-split (input features): the partial sums meet in one all-reduce.
            (r"self_attn/o_proj/kernel", -2, MODEL, heads_split),
            (r"mlp/down_proj/kernel", -2, MODEL, c.intermediate_size % tp == 0),
            # The same kernels stored [*features, in] (models/quant.py's `kernel_t`, fp8 W8A8 on
            # GPUs): the same split, its axis counted from the end of that layout; their scales
            # [*features] as the plain kernels' scales.
            (r"self_attn/qkv_proj/kernel_t", -4, KV_AXIS, self.kv_shards > 1),
            (r"self_attn/qkv_proj/kernel_t_scale", -3, KV_AXIS, self.kv_shards > 1),
            (r"mlp/gate_up_proj/kernel_t", -2, MODEL, c.intermediate_size % tp == 0),
            (r"mlp/gate_up_proj/kernel_t_scale", -1, MODEL, c.intermediate_size % tp == 0),
            (r"self_attn/o_proj/kernel_t", -1, MODEL, heads_split),
            (r"mlp/down_proj/kernel_t", -1, MODEL, c.intermediate_size % tp == 0),
            (r"(o_proj|down_proj)/kernel_t_scale", None, None, True),
            # Expert parallel: a mixture of experts' experts [.., E, ...] split by expert (their
            # scales [.., E, 2, i] and [.., E, hidden] with them); the router [hidden, E] is
            # replicated (every device routes every token).
            (r"mlp/experts_gate_up", -4, MODEL, self.experts_split),
            (r"mlp/experts_down", -3, MODEL, self.experts_split),
            (r"mlp/experts_gate_up_scale", -3, MODEL, self.experts_split),
            (r"mlp/experts_down_scale", -2, MODEL, self.experts_split),
            (r"mlp/router", None, None, True),
            # Replicated: norms, biases added after a row-split matmul's all-reduce, and the
            # scales of a row-split kernel (its output columns are whole on every device).
            (r"\w*norm/scale|(o_proj|down_proj)/(bias|kernel_scale)", None, None, True),
            # The CPU's packed copy of a tied head (llama.py): packed only on one device.
            (r"packed_head", None, None, True),
        ):
            if re.search(rf"(^|/)({pattern})$", path):
                if dim is None or not ok or tp == 1:
                    return P()
                spec = [None] * ndim
                spec[dim] = axes
                return P(*spec)
        raise ValueError(
            f"No sharding rule for param {path!r}; add one to jaxserve/models/sharding.py."
        )

    def params(self, abstract_params: Any) -> Any:
        """A NamedSharding for every leaf of a param tree (arrays or ShapeDtypeStructs)."""

        def one(keypath, leaf):
            path = "/".join(str(getattr(k, "key", k)) for k in keypath)
            return self.sharding(self.param_spec(path, len(leaf.shape)))

        return jax.tree_util.tree_map_with_path(one, abstract_params)

    def place(self, params: Any) -> Any:
        """Moves params into their shardings (a no-op for params loaded straight into them)."""
        return jax.device_put(params, self.params(params))


def attention_over_heads(
    fn: Callable[..., jax.Array], plan: ShardingPlan | None, *, kernel: bool = False
):
    """`fn` (a ragged paged attention) run by each device on its own heads, with `shard_map`.

    Heads are independent, so nothing crosses devices. When the plan's split is head-local, each
    device runs its own query heads over its own KV heads. When it is not (query heads that do
    not divide by the devices, as smollm2-135m's 9 heads over 2 or 4), the XLA attention is left
    to XLA's partitioner, but a Pallas kernel (`kernel`) cannot be partitioned by it (a custom
    call: "Mosaic kernels cannot be automatically partitioned"), so each device runs the query
    heads of the KV heads it holds: q resharded to the KV split, the devices that share a KV
    shard computing the same heads (issue 28, defect 1). Callers treat attention over a
    quantized pool as a `kernel` too: its scale lanes end each shard's block, so only a
    device's own block reads as a pool (common.split_kv).
    """
    if plan is None or plan.tensor_parallel == 1:
        return fn
    if plan.attention_is_local:
        heads = P(None, MODEL, None)  # q and the output: [T, num_heads, head_dim]
    elif kernel:
        heads = P(None, KV_AXIS, None)  # whole GQA groups of the KV heads this device holds
    else:
        return fn
    pool = P(None, None, None, KV_AXIS)  # [num_layers, num_pages, page_size, lanes]

    def call(q, kv_pool, layer, query_start, kv_lens, page_tables, num_seqs, *extra, **static):
        # `extra`: per-step metadata of a backend (the xla tile list), the same on every device.
        # Called with the model's num_kv_heads; each device holds its KV shard's share of them.
        if static.get("num_kv_heads") is not None:
            static["num_kv_heads"] //= plan.kv_shards
        local = jax.shard_map(
            functools.partial(fn, **static),
            mesh=plan.mesh,
            in_specs=(heads, pool, P(), P(), P(), P(), P(), *[P()] * len(extra)),
            out_specs=heads,
            check_vma=False,  # Pallas kernels carry no varying-axes types
        )
        return local(q, kv_pool, layer, query_start, kv_lens, page_tables, num_seqs, *extra)

    return call
