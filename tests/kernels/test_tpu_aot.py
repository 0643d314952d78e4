"""The TPU kernel's block planning, and the kernel compiled ahead of time for real TPU generations.

With libtpu installed, `jax.experimental.topologies.get_topology_desc` gives abstract devices of
a TPU topology on this CPU machine, and `jit(...).trace(...).lower().compile()` runs the real
XLA:TPU and Mosaic compilers for them. That catches what interpret mode cannot: VMEM overflow,
Mosaic's layout and alignment rules, DMA shapes. Run with JAX_PLATFORMS=cpu (or unset): the
topology API needs no TPU, while JAX_PLATFORMS=tpu or "cpu,tpu" makes JAX open a TPU backend and
fail where there is none. Without libtpu the compile tests skip; the planning tests and the
interpret-mode check of a KV-head split still run.

Each compile takes about 1-10 s on 2 cores, so the cases vary one axis at a time around a base
shape (bf16, head_dim 128, pages of 16, GQA 4, 64 query tokens, on v5e) rather than the cross
product: chips v5e/v6e/v5p/TPU7x in both dtypes, head dims 64/256, pages of 32-128, GQA 1-3, a
sliding window, 1 and 512 query tokens, and the two shapes of issue 28 that overflowed VMEM on
v4/v5e/v5p (32 query/32 KV heads, head_dim 128, f32; 16/16 heads, head_dim 256, bf16).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from pallas_kernels import chips
from pallas_kernels.ragged_paged_attention import common, reference, tpu_kernel, tuning
from tests.kernels.test_ragged_paged_attention import tpu_interpret

# Single-chip topologies (v4, v5p and TPU7x name three axes).
TOPOLOGIES = {
    "v4": "v4:1x1x1",
    "v5e": "v5e:1x1",
    "v5p": "v5p:1x1x1",
    "v6e": "v6e:1x1",
    "tpu7x": "tpu7x:1x1x1",
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A bucket: T query tokens over S sequence slots of P pages each, in a 2-layer pool."""

    num_tokens: int = 64
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 128
    dtype: str = "bfloat16"
    page_size: int = 16
    pages_per_seq: int = 16
    num_slots: int = 8
    sliding_window: int | None = None
    kv_dtype: str | None = None  # the pool's; None: dtype. "int8" / "float8_e4m3fn": quantized

    @property
    def pool_dtype(self):
        return jnp.dtype(self.kv_dtype or self.dtype)

    def plan(self, chip: str) -> tuning.TpuBlockPlan:
        return tuning.plan_tpu_blocks(
            num_tokens=self.num_tokens,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            page_size=self.page_size,
            pages_per_seq=self.pages_per_seq,
            q_dtype=self.dtype,
            kv_dtype=self.pool_dtype,
            lanes=self.lanes,
            chip=chip,
        )

    @property
    def lanes(self) -> int:
        """The pool's minor dimension as the engine lays it out on TPU (whole 128-lane tiles)."""
        quantized = common.is_quantized(self.pool_dtype)
        return common.kv_lanes(self.num_kv_heads, self.head_dim, 1, common.LANES, quantized)


BASE = Shape()
# Issue 28's shapes: a 32-head MHA model in f32 and a 16-head, head_dim-256 model in bf16, with
# prefill-sized buckets (512 tokens) and contexts of 1024 keys.
MHA32_F32 = Shape(512, 32, 32, 128, "float32", 16, 64, 8)
MHA16_D256 = Shape(512, 16, 16, 256, "bfloat16", 16, 64, 8)

AOT_CASES = {
    "v5e-base": ("v5e", BASE),
    "v5e-f32": ("v5e", dataclasses.replace(BASE, dtype="float32")),
    "v6e-bf16": ("v6e", BASE),
    "v6e-f32": ("v6e", dataclasses.replace(BASE, dtype="float32")),
    "v5p-bf16": ("v5p", BASE),
    "v5p-f32": ("v5p", dataclasses.replace(BASE, dtype="float32")),
    "tpu7x-bf16": ("tpu7x", BASE),
    "tpu7x-f32": ("tpu7x", dataclasses.replace(BASE, dtype="float32")),
    "v5e-head_dim64": ("v5e", dataclasses.replace(BASE, head_dim=64)),
    "v5e-head_dim256": ("v5e", dataclasses.replace(BASE, head_dim=256)),
    "v5e-page32": ("v5e", dataclasses.replace(BASE, page_size=32, pages_per_seq=8)),
    "v5e-page64": ("v5e", dataclasses.replace(BASE, page_size=64, pages_per_seq=4)),
    "v5e-page128": ("v5e", dataclasses.replace(BASE, page_size=128, pages_per_seq=2)),
    "v5e-gqa1": ("v5e", dataclasses.replace(BASE, num_heads=2)),
    "v5e-gqa2": ("v5e", dataclasses.replace(BASE, num_heads=4)),
    "v5e-gqa3": ("v5e", dataclasses.replace(BASE, num_heads=6)),
    "v5e-window": ("v5e", dataclasses.replace(BASE, sliding_window=64)),
    "v5e-decode1": ("v5e", dataclasses.replace(BASE, num_tokens=1, num_slots=1)),
    "v5e-tokens512": ("v5e", dataclasses.replace(BASE, num_tokens=512)),
    # 8-bit pools (--kv-cache-dtype): int8 and e4m3 pages with their scale lanes, dequantized
    # per key block; llama3.1-8b's 8 KV heads of 128 among them, and short pages of int8.
    "v5e-kv_int8": ("v5e", dataclasses.replace(BASE, kv_dtype="int8")),
    "v6e-kv_int8": ("v6e", dataclasses.replace(BASE, kv_dtype="int8")),
    "v5e-kv_fp8": ("v5e", dataclasses.replace(BASE, kv_dtype="float8_e4m3fn")),
    "v6e-kv_fp8": ("v6e", dataclasses.replace(BASE, kv_dtype="float8_e4m3fn")),
    "v5e-kv_int8_8b": (
        "v5e",
        dataclasses.replace(BASE, num_heads=32, num_kv_heads=8, num_tokens=256, kv_dtype="int8"),
    ),
    "v6e-kv_int8_page32": (
        "v6e",
        dataclasses.replace(BASE, page_size=32, pages_per_seq=8, kv_dtype="int8"),
    ),
    "v5e-kv_int8_f32_decode1": (
        "v5e",
        dataclasses.replace(BASE, dtype="float32", num_tokens=1, num_slots=1, kv_dtype="int8"),
    ),
}
BIG_CASES = {
    f"{chip}-{name}": (chip, shape)
    for chip in ("v5e", "v5p", "v4")
    for name, shape in (("mha32_f32", MHA32_F32), ("mha16_d256_bf16", MHA16_D256))
}


def _inputs(shape: Shape, sharding) -> tuple:
    """Abstract arguments (ShapeDtypeStructs) of the kernel for `shape`, placed by `sharding`."""
    dtype = jnp.dtype(shape.dtype)
    num_pages = shape.num_slots * shape.pages_per_seq + 1
    pool = (2, num_pages, shape.page_size, shape.lanes)
    specs = [
        ((shape.num_tokens, shape.num_heads, shape.head_dim), dtype),
        (pool, shape.pool_dtype),
        ((), jnp.int32),
        ((shape.num_slots + 1,), jnp.int32),
        ((shape.num_slots,), jnp.int32),
        ((shape.num_slots, shape.pages_per_seq), jnp.int32),
        ((), jnp.int32),
    ]
    return tuple(jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in specs)


@functools.cache
def _device(chip: str):
    """An abstract device of a one-chip `chip` topology (skips the test without libtpu).

    libtpu takes /tmp/libtpu_lockfile when it starts, so that two processes never drive one TPU;
    any other JAX process on the machine that started libtpu (JAX_PLATFORMS unset) would then make
    this fail with "Internal error when accessing libtpu multi-process lockfile". There is no TPU
    to protect here, so libtpu is told to skip the lock (ALLOW_MULTIPLE_LIBTPU_LOAD, read when it
    starts), and the variable is put back afterwards so that no subprocess inherits it.
    """
    pytest.importorskip("libtpu", reason="libtpu (jax[tpu]) is needed to compile for TPUs.")
    from jax.experimental import topologies

    previous = os.environ.get(_NO_LOCK)
    os.environ[_NO_LOCK] = "1"
    try:
        topology = topologies.get_topology_desc(
            topology_name=TOPOLOGIES[chip], platform="tpu", chips_per_host_bounds=(1, 1, 1)
        )
    finally:
        if previous is None:
            del os.environ[_NO_LOCK]
        else:
            os.environ[_NO_LOCK] = previous
    return topology.devices[0]


_NO_LOCK = "ALLOW_MULTIPLE_LIBTPU_LOAD"


_HLO_DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32, "pred": jnp.bool_}  # others: 32-bit


def _vmem_array_bytes(hlo_shape: str) -> int:
    """Padded bytes of an HLO array that XLA placed in VMEM (memory space S(1)), else 0."""
    if "S(1)" not in hlo_shape:
        return 0
    dtype, dims = hlo_shape.split("[", 1)
    dims = tuple(int(d) for d in dims.split("]", 1)[0].split(",") if d)
    return tuning.padded_bytes(dims or (1,), _HLO_DTYPES.get(dtype, jnp.int32))


def _scoped_vmem(compiled) -> tuple[int, int, int]:
    """(used, limit, placed) bytes of VMEM of the kernel's custom call in the compiled HLO.

    `used` and `limit` are the call's scoped VMEM; `placed` is what of its operands and result
    XLA itself chose to keep in VMEM (memory space S(1)), which it does when the raised limit
    leaves room (small test pools, whole q and out arrays). `used` counts some of that and not
    the rest (both seen), so the kernel's own need is at least `used - placed`.
    """
    lines = compiled.as_text().splitlines()
    shapes = {}
    for line in lines:
        name, _, rest = line.strip().removeprefix("ROOT ").partition(" = ")
        if name.startswith("%") and rest:
            shapes[name] = rest.split(" ", 1)[0]
    for line in lines:
        if 'custom_call_target="tpu_custom_call"' in line:
            config, _ = json.JSONDecoder().raw_decode(line[line.index("backend_config=") + 15 :])
            used = sum(int(c["size"]) for c in config["used_scoped_memory_configs"])
            limit = sum(int(c["size"]) for c in config["scoped_memory_configs"])
            result = line.split(" = ", 1)[1].split(" ", 1)[0]
            operands = line.split("custom-call(", 1)[1].split(")", 1)[0]
            arrays = [result] + [
                shapes.get(op.split("*/")[-1].strip(), "") for op in operands.split(",")
            ]
            return used, limit, sum(_vmem_array_bytes(a) for a in arrays)
    raise AssertionError("No tpu_custom_call in the compiled HLO.")


def _compile_and_check(chip: str, shape: Shape) -> None:
    """Compiles the kernel for `chip` and checks its VMEM and cost against the plan."""
    device = _device(chip)
    assert chips.tpu_chip(device.device_kind).name == chip
    fn = functools.partial(
        tpu_kernel.ragged_paged_attention,
        sm_scale=shape.head_dim**-0.5,
        num_kv_heads=shape.num_kv_heads,
        sliding_window=shape.sliding_window,
        chip=device.device_kind,
    )
    compiled = jax.jit(fn).trace(*_inputs(shape, SingleDeviceSharding(device))).lower().compile()
    plan = shape.plan(chip)
    used, limit, placed = _scoped_vmem(compiled)
    assert limit == plan.vmem_limit_bytes <= chips.tpu_chip(chip).vmem_bytes
    assert used <= limit and plan.vmem_bytes <= limit
    assert used - placed <= plan.vmem_bytes, (
        f"{chip} {shape}: the compiler allocated {used} bytes of scoped VMEM ({placed} of them "
        f"arrays XLA placed in VMEM), the plan estimated {plan.vmem_bytes}: the estimate must "
        "bound the kernel's own need."
    )
    memory = compiled.memory_analysis()
    assert memory is not None
    hbm = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    assert hbm <= chips.tpu_chip(chip).hbm_bytes_per_device
    # The CostEstimate reaches XLA's cost analysis: flops of QK^T and PV over every key of the
    # context (or the window), an upper bound.
    keys = shape.pages_per_seq * shape.page_size
    if shape.sliding_window is not None:
        keys = min(keys, shape.sliding_window)
    cost = compiled.cost_analysis()
    attention_flops = 4 * shape.num_tokens * shape.num_heads * keys * shape.head_dim
    assert attention_flops <= cost["flops"] < 1.01 * attention_flops + 1e6
    assert cost["transcendentals"] >= shape.num_tokens * shape.num_heads * keys


@pytest.mark.parametrize("case", list(AOT_CASES), ids=str)
def test_compiles_for_tpu(case: str):
    _compile_and_check(*AOT_CASES[case])


@pytest.mark.parametrize("case", list(BIG_CASES), ids=str)
def test_issue_28_shapes_fit_vmem(case: str):
    """These overflowed VMEM before the budgeting: 24.7 MiB (f32) and 16.8 MiB (bf16) of scoped
    allocation against the 16 MiB default on v5e and v5p; the f32 shape 17.9 MiB on v4."""
    _compile_and_check(*BIG_CASES[case])


# Planning: no compiler needed.


def test_blocks_follow_the_chip_argument_not_the_devices(monkeypatch):
    def no_devices(*args, **kwargs):
        raise AssertionError("the plan read jax.devices() although a chip was given")

    monkeypatch.setattr(jax, "devices", no_devices)
    by_kind, by_name = BASE.plan("TPU v5 lite"), BASE.plan("v5e")
    assert by_kind == by_name and by_name.chip == "v5e"
    assert BASE.plan("v6e").chip == "v6e"
    assert tuning.tpu_block_sizes("TPU v6 lite") == tuning.TPU_TABLE["v6e"]
    wide = dataclasses.replace(BASE, num_tokens=512)
    assert wide.plan("v6e").rows == 256 and wide.plan("v5e").rows == 128  # the table's rows


def test_off_a_tpu_the_default_chip_is_the_interpret_chip():
    assert jax.default_backend() != "tpu"
    assert tuning.resolve_tpu_chip().name == tuning.INTERPRET_CHIP
    assert BASE.plan(None) == BASE.plan(tuning.INTERPRET_CHIP)


def test_scoped_vmem_limit_per_chip():
    limits = {name: tuning.tpu_vmem_limit_bytes(chips.tpu_chip(name)) for name in chips.TPU_CHIPS}
    mib = 2**20
    # v4's 16 MiB is all its VMEM and already the default; elsewhere 3/4 of the VMEM.
    want = {"v4": 16 * mib, "v5e": 96 * mib, "v5p": 48 * mib, "v6e": 96 * mib, "tpu7x": 48 * mib}
    assert limits == want


@pytest.mark.parametrize("chip", list(chips.TPU_CHIPS))
@pytest.mark.parametrize("shape", [MHA32_F32, MHA16_D256], ids=["mha32_f32", "mha16_d256"])
def test_plans_fit_the_budget(chip: str, shape: Shape):
    plan = shape.plan(chip)
    assert plan.vmem_bytes <= 0.9 * plan.vmem_limit_bytes
    assert shape.num_kv_heads % plan.heads_per_block == 0
    assert plan.rows == plan.block_tokens * (shape.num_heads // shape.num_kv_heads)


def test_v4_splits_the_kv_heads_of_the_f32_shape():
    plan = MHA32_F32.plan("v4")
    assert plan.heads_per_block < 32 and plan.heads_per_block % 8 == 0


def test_a_shape_that_fits_gets_the_table_s_blocks_cut_to_the_bucket():
    """Plans worked from the rule (no shrinking where the targets fit):
    - BASE (64 tokens, GQA 4, 2 KV heads of 128, bf16, pages of 16, 16 per sequence) on v6e:
      the row's 256 rows are 64 tokens, the whole bucket; its 512 keys would be 32 pages, but
      a sequence has only 16; both KV heads (2 has no divisor that is a multiple of 8).
    - GQA 3 on v5e: 128 rows are 42 tokens, rounded up to whole bf16 tiles of 16 rows: a tile
      is 16 / gcd(16, 3) = 16 tokens, so 48 tokens, 144 rows (9 tiles); 256 keys, 16 pages.
    """
    plan = BASE.plan("v6e")
    assert (plan.block_tokens, plan.rows, plan.heads_per_block, plan.pages_per_block) == (
        64,
        256,
        2,
        16,
    )
    gqa3 = dataclasses.replace(BASE, num_heads=6).plan("v5e")
    assert (gqa3.block_tokens, gqa3.rows, gqa3.heads_per_block, gqa3.pages_per_block) == (
        48,
        144,
        2,
        16,
    )
    assert gqa3.vmem_limit_bytes == 96 * 2**20 and gqa3.chip == "v5e"


def test_the_f32_mha_shape_on_v4_shrinks_heads_then_pages():
    """MHA32_F32 on v4 (16 MiB limit, budget 0.9 of it: 14.4 MiB; temporaries count double),
    worked from `tpu_vmem_bytes` in MiB, group 1, rows = tokens:
    - 32 heads, 128 rows, 16 pages: the page buffers alone, 2 x 16 x 16 x 8192 lanes x 4 B, are
      16 MiB. Split the heads (32 -> 16): 4 (q, out) + 8 (pages) + 4 (heads-first copy) = 16.
    - 8 heads: 2 + 4 + 2 + 0.5 (acc) + 1 (stats) + 2 x 3.875 (temps) = 17.25 MiB, and 8 is the
      last head choice. Halving the rows would leave 14.625 MiB, halving the pages 10.5 MiB:
      the pages go (16 -> 8), and 10.5 MiB fits.
    """
    plan = MHA32_F32.plan("v4")
    assert (plan.block_tokens, plan.rows, plan.heads_per_block, plan.pages_per_block) == (
        128,
        128,
        8,
        8,
    )
    assert plan.vmem_limit_bytes == 16 * 2**20
    assert plan.vmem_bytes == 10.5 * 2**20


def test_padding_to_tpu_tiles():
    assert tuning.padded_bytes((16, 100), jnp.float32) == 16 * 128 * 4
    assert tuning.padded_bytes((3, 8, 1), jnp.float32) == 3 * 8 * 128 * 4  # a column: 128 lanes
    assert tuning.padded_bytes((20, 128), jnp.bfloat16) == 32 * 128 * 2  # bf16 tiles of 16 rows
    assert tuning.padded_bytes((20, 128), jnp.float32) == 24 * 128 * 4
    # Fewer rows than a tile take a power-of-two tile, at least one packed row.
    assert tuning.padded_bytes((4, 2, 128), jnp.bfloat16) == 4 * 2 * 128 * 2
    assert tuning.padded_bytes((4, 1, 128), jnp.bfloat16) == 4 * 2 * 128 * 2
    assert tuning.padded_bytes((4, 3, 128), jnp.float32) == 4 * 4 * 128 * 4


def test_nothing_fits_raises_a_sentence_with_the_shape_and_chip():
    # One page of 1024 tokens x 8 KV heads x 256 f32 is 8 MiB; K and V, double-buffered: 32 MiB.
    shape = Shape(16, 8, 8, 256, "float32", 1024, 2, 4)
    with pytest.raises(
        ValueError, match=r"No blocks .* fit the 16\.0 MiB .* of a v4: .*q \[16, 8, "
    ):
        shape.plan("v4")
    assert shape.plan("v5e").pages_per_block == 1  # 128 MiB of VMEM: it fits there


def test_a_limit_beyond_the_chip_raises():
    sizes = tuning.TpuBlockSizes(q_rows=128, kv_tokens=256, vmem_limit_bytes=64 * 2**20)
    with pytest.raises(ValueError, match="exceeds the 16777216 bytes of VMEM of a v4"):
        tuning.plan_tpu_blocks(
            num_tokens=8,
            num_heads=2,
            num_kv_heads=2,
            head_dim=128,
            page_size=16,
            pages_per_seq=4,
            q_dtype=jnp.float32,
            kv_dtype=jnp.float32,
            chip="v4",
            block_sizes=sizes,
        )


def test_a_kv_head_split_matches_the_reference_in_interpret_mode():
    """16 KV heads with a VMEM limit too small for all of them per step: two head blocks."""
    rng = np.random.default_rng(0)
    num_kv_heads, head_dim, page_size = 16, 8, 4
    kv_lens, q_lens = np.array([9, 5]), np.array([3, 1])
    pages_per_seq, num_tokens = 3, 6  # 4 real tokens, 2 of padding
    all_heads = tuning.tpu_vmem_bytes(
        rows=8,
        heads=num_kv_heads,
        pages_per_block=2,
        page_size=page_size,
        head_dim=head_dim,
        q_dtype=jnp.float32,
        kv_dtype=jnp.float32,
        chip="v5e",
    )
    sizes = tuning.TpuBlockSizes(q_rows=8, kv_tokens=8, vmem_limit_bytes=all_heads)
    pool_shape = (2, 7, page_size, 2 * num_kv_heads * head_dim)
    kv_pool = jnp.asarray(rng.normal(size=pool_shape), jnp.float32)
    args = (
        jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads, head_dim)), jnp.float32),
        kv_pool,
        jnp.int32(1),
        jnp.array([0, 3, 4], jnp.int32),
        jnp.asarray(kv_lens, jnp.int32),
        jnp.array([[5, 0, 3], [6, 2, 1]], jnp.int32),
        jnp.int32(2),
    )
    plan = tuning.plan_tpu_blocks(
        num_tokens=num_tokens,
        num_heads=num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        q_dtype=jnp.float32,
        kv_dtype=jnp.float32,
        chip="v5e",
        block_sizes=sizes,
    )
    assert plan.heads_per_block == 8
    assert q_lens.sum() == 4
    want = reference.ragged_paged_attention(*args, sm_scale=0.3)
    got = tpu_interpret(*args, sm_scale=0.3, block_sizes=sizes, chip="v5e")  # races checked
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
