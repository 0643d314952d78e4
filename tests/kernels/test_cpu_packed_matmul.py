"""The CPU's matmul over packed weights (cpu_matmul.cc through cpu_ffi) and the packed model.

The kernel against float64 numpy and, on integer-valued inputs where float32 sums are exact,
element for element (a misplaced panel, row or column shows as a wrong value, not as rounding);
each row's result the same bits alone as in any batch (one chain of fused multiply-adds per
element, whatever the row blocks and threads). Then the model: `pack_params` of a canonical tree
through the packed module gives the canonical module's hidden states and logits, in both layer
layouts, tied and untied heads, with kernels that pack and kernels that do not.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.random_weights import NAMED_SHAPES
from jaxserve.models.kv_pool import init_kv_pages
from jaxserve.models.loaded import abstract_params, model_for, pack_params
from jaxserve.models.quant import quantize_params, quantize_weight
from jaxserve.models.step_batch import SeqChunk, pack_chunks
from jaxserve.quantization import QuantScheme
from pallas_kernels.ragged_paged_attention import cpu_ffi

# Skipped only where there is no compiler: where there is one, a library that fails to build
# fails here (test_the_library_builds_here) rather than skipping every case.
pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler (g++ or $CXX)"
)


def test_the_library_builds_here():
    """The build's own error (the compiler's message) rather than a skip of every case."""
    cpu_ffi._build()
    assert cpu_ffi.available()


# Rows across the 6-row register tiles and the 48-row work items; K odd and even; 1-48 panels.
SHAPES = [(1, 64, 64), (5, 7, 128), (6, 576, 960), (13, 33, 192), (49, 100, 320), (97, 64, 3072)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_packed_matmul_is_the_matmul(m, k, n):
    rng = np.random.default_rng(m * 1000 + k)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    out = np.asarray(jax.jit(cpu_ffi.packed_matmul)(x, cpu_ffi.pack_weight(jnp.asarray(w))))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert out.shape == (m, n) and out.dtype == np.float32
    assert np.all(np.abs(out - ref) <= 1e-6 * scale + 1e-30)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_every_element_lands_in_its_place(m, k, n):
    """Small integers: every partial sum is exact in float32, so the result must equal numpy's
    bit for bit; any mix-up of panels, rows, columns or k shows."""
    rng = np.random.default_rng(k)
    x = rng.integers(-4, 5, (m, k)).astype(np.float32)
    w = rng.integers(-4, 5, (k, n)).astype(np.float32)
    out = np.asarray(cpu_ffi.packed_matmul(jnp.asarray(x), cpu_ffi.pack_weight(jnp.asarray(w))))
    np.testing.assert_array_equal(out, x @ w)


def test_a_rows_result_does_not_depend_on_its_batch():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((100, 576), np.float32)
    wp = cpu_ffi.pack_weight(jnp.asarray(rng.standard_normal((576, 1536), np.float32)))
    whole = np.asarray(cpu_ffi.packed_matmul(jnp.asarray(x), wp))
    for rows in ([0], [5, 6, 7], list(range(40, 89)), [99]):
        part = np.asarray(cpu_ffi.packed_matmul(jnp.asarray(x[rows]), wp))
        np.testing.assert_array_equal(part, whole[rows])


@pytest.mark.parametrize("valid", [0, 1, 5, 6, 47, 48, 49, 96, 97, 200])
def test_rows_past_the_real_ones_come_back_zero_and_the_rest_are_unchanged(valid):
    """A step's padding rows (from `valid` on) are not computed; the real rows' bits are those of
    the whole call's, whichever tile or work item the cut falls in; `valid` past the end clamps."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((97, 100), np.float32))
    wp = cpu_ffi.pack_weight(jnp.asarray(rng.standard_normal((100, 192), np.float32)))
    whole = np.asarray(cpu_ffi.packed_matmul(x, wp))
    out = np.asarray(jax.jit(cpu_ffi.packed_matmul)(x, wp, jnp.int32(valid)))
    cut = min(valid, 97)
    np.testing.assert_array_equal(out[:cut], whole[:cut])
    assert not out[cut:].any()


def test_no_k_is_zeros():
    """K = 0: every sum is empty, so every row is 0, not what the output's memory last held (a
    freed full-size result just before makes that memory likely to be reused)."""
    cpu_ffi.packed_matmul(jnp.ones((300, 5)), jnp.ones((2, 5, 64))).block_until_ready()
    out = np.asarray(cpu_ffi.packed_matmul(jnp.ones((300, 0)), jnp.ones((2, 0, 64))))
    assert out.shape == (300, 128) and not out.any()


def test_pack_and_unpack_are_inverse_and_leading_axes_stay():
    w = jnp.arange(3 * 5 * 128, dtype=jnp.float32).reshape(3, 5, 128)  # [layers, K, N]
    wp = cpu_ffi.pack_weight(w)
    assert wp.shape == (3, 2, 5, 64)
    assert float(wp[1, 1, 2, 3]) == float(w[1, 2, 64 + 3])  # panel 1, row 2, column 3
    np.testing.assert_array_equal(cpu_ffi.unpack_weight(wp), w)


def test_bad_shapes_are_sentences_naming_them():
    with pytest.raises(ValueError, match="100 output columns"):
        cpu_ffi.pack_weight(jnp.zeros((4, 100)))
    with pytest.raises(ValueError, match=r"got x \(2, 8\) and weights \(1, 9, 64\)"):
        cpu_ffi.packed_matmul(jnp.zeros((2, 8)), jnp.zeros((1, 9, 64)))
    with pytest.raises(ValueError, match=r"one int32; got \(2,\)"):
        cpu_ffi.packed_matmul(jnp.zeros((2, 8)), jnp.zeros((1, 8, 64)), jnp.zeros(2, jnp.int32))


def _forward(module, params, config):
    """Hidden states and logits of a 7-token prompt and a 1-token decode in one step, the 8 real
    tokens' (the bucket's 5 padding tokens after them are the packed matmul's zeros)."""
    page_size, pages = 4, 8
    kv = init_kv_pages(config, num_pages=pages, page_size=page_size, dtype=jnp.float32)
    batch = pack_chunks(
        [SeqChunk(list(range(3, 10)), 0, [0, 1]), SeqChunk([11], 0, [2])],
        page_size=page_size,
        num_tokens=13,
        num_seqs=3,
        pages_per_seq=2,
        num_pages=pages,
    )
    hidden, _ = module.apply({"params": params}, kv, batch)
    hidden = hidden[:8]
    return hidden, module.apply({"params": params}, hidden, method=module.logits)


# llama-tiny's intermediate 176 (gate/up 352 columns) does not pack; 192 does.
CONFIGS = {
    "tied_partly_packed": dataclasses.replace(NAMED_SHAPES["llama-tiny"], tie_word_embeddings=True),
    "untied_all_packed": dataclasses.replace(
        NAMED_SHAPES["llama-tiny"], intermediate_size=192, tie_word_embeddings=False
    ),
    # Llama's attention_bias and mlp_bias: a packed kernel's bias is added after the call.
    "biased": dataclasses.replace(
        NAMED_SHAPES["llama-tiny"], intermediate_size=192, qkv_bias=True, o_bias=True, mlp_bias=True
    ),
}


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_packed_model_computes_the_canonical_one(name, layer_loop):
    config = CONFIGS[name]
    canonical = model_for(config, jnp.float32, "reference", layer_loop=layer_loop)
    packed = model_for(config, jnp.float32, "reference", layer_loop=layer_loop, packed_weights=True)
    shapes = abstract_params(config, jnp.float32, layer_loop)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(shapes))))
    params = jax.tree.map(lambda s: 0.05 * jax.random.normal(next(keys), s.shape), shapes)
    packed_params = pack_params(params, config, jnp.float32)
    # The tree the packed module declares, leaf for leaf; the kernels that pack did.
    want = abstract_params(config, jnp.float32, layer_loop, packed=True)
    assert jax.tree.map(jnp.shape, packed_params) == jax.tree.map(lambda s: s.shape, want)
    layer = packed_params["layers_0" if layer_loop == "unrolled" else "layers"]
    assert layer["self_attn"]["o_proj"]["kernel"].shape[-1] == cpu_ffi.PANEL
    gate_up = layer["mlp"]["gate_up_proj"]["kernel"]
    assert (gate_up.shape[-1] == cpu_ffi.PANEL) == (config.intermediate_size % 32 == 0)
    assert ("packed_head" in packed_params) == config.tie_word_embeddings
    lowered = jax.jit(lambda p: _forward(packed, p, config)).lower(packed_params).as_text()
    assert "jaxserve_packed_matmul" in lowered
    hidden, logits = _forward(canonical, params, config)
    packed_hidden, packed_logits = _forward(packed, packed_params, config)
    np.testing.assert_allclose(packed_hidden, hidden, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed_logits, logits, rtol=1e-5, atol=1e-5)


# Quantized (models/quant.py) and packed for cpu_matmul_int8.cc: the same module with its int8
# panels, the scales flattened; a mixture of experts' experts through the grouped int8 kernel.
QUANT_CONFIGS = {
    **CONFIGS,
    "moe": dataclasses.replace(NAMED_SHAPES["qwen3-moe-tiny"], num_layers=2),
}


@pytest.mark.parametrize("layer_loop", ["unrolled", "scan"])
@pytest.mark.parametrize("name", sorted(QUANT_CONFIGS))
@pytest.mark.parametrize(
    "weights, activations", [("int8", None), ("int8", "int8"), ("fp8", None)],
    ids=["int8", "int8-w8a8", "fp8"],
)  # fmt: skip
def test_the_packed_int8_model_computes_the_quantized_one(name, layer_loop, weights, activations):
    if not cpu_ffi.int8_matmul_available("float" if activations is None else "int8"):
        pytest.skip("this CPU has no AVX-512 (VNNI for W8A8): the int8 kernels are not used")
    config = QUANT_CONFIGS[name]
    scheme = QuantScheme(weights=weights, activations=activations)
    quantized = model_for(config, jnp.float32, "reference", layer_loop=layer_loop, quant=scheme)
    packed = model_for(
        config, jnp.float32, "reference", layer_loop=layer_loop, packed_weights=True, quant=scheme
    )
    shapes = abstract_params(config, jnp.float32, layer_loop)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(shapes))))
    params = jax.tree.map(lambda s: 0.05 * jax.random.normal(next(keys), s.shape), shapes)
    params = quantize_params(params, scheme)
    packed_params = pack_params(params, config, jnp.float32, scheme)
    want = abstract_params(config, jnp.float32, layer_loop, packed=True, quant=scheme)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), packed_params) == jax.tree.map(
        lambda s: (s.shape, s.dtype), want
    )
    layer = packed_params["layers_0" if layer_loop == "unrolled" else "layers"]
    o_proj = layer["self_attn"]["o_proj"]
    assert o_proj["kernel"].dtype == scheme.weight_dtype
    assert o_proj["kernel"].shape[-1] == cpu_ffi.PANEL
    assert o_proj["kernel_scale"].shape[-1] == config.hidden_size  # one per output column
    lowered = jax.jit(lambda p: _forward(packed, p, config)).lower(packed_params).as_text()
    assert "jaxserve_packed_matmul_int8" in lowered
    assert ("jaxserve_grouped_packed_matmul_int8" in lowered) == (config.moe is not None)
    hidden, logits = _forward(quantized, params, config)
    packed_hidden, packed_logits = _forward(packed, packed_params, config)
    # Weight-only: the same products summed in another order. W8A8: the same int32 sums; a row's
    # activation scale may differ in its last bit (XLA's division), moving a tie's rounding.
    tol = 1e-5 if activations is None else 2e-4
    np.testing.assert_allclose(packed_hidden, hidden, rtol=tol, atol=tol)
    np.testing.assert_allclose(packed_logits, logits, rtol=tol, atol=tol)


@pytest.mark.parametrize("scheme", [None, QuantScheme(weights="int8")], ids=["float32", "int8"])
def test_a_packed_projection_leaves_the_bucket_s_padding_rows_uncomputed(scheme):
    """`_dense` over packed panels computes the step's real tokens alone: the bucket's padding
    rows come back 0 (the work a padded bucket skips), the real ones as the unpacked layer's."""
    from jaxserve.models.llama import _dense

    if scheme is not None and not cpu_ffi.int8_matmul_available():
        pytest.skip("this CPU has no AVX-512: the int8 kernel is not used")
    batch = pack_chunks(
        [SeqChunk(list(range(3, 8)), 0, [0, 1])],
        page_size=4,
        num_tokens=8,
        num_seqs=2,
        pages_per_seq=2,
        num_pages=4,
    )  # 5 real tokens, 3 of padding
    x = jax.random.normal(jax.random.key(2), (8, 64))
    plain = _dense(128, False, jnp.float32, "p", quant=scheme)
    w = 0.1 * jax.random.normal(jax.random.key(3), (64, 128))
    params = {"kernel": w}
    if scheme is not None:
        params = dict(zip(("kernel", "kernel_scale"), quantize_weight(w, "int8", -2), strict=True))
    packed = _dense(128, False, jnp.float32, "p", packed=True, batch=batch, quant=scheme)
    packed_params = {"kernel": cpu_ffi.pack_weight(params["kernel"])}
    if scheme is not None:
        packed_params["kernel_scale"] = params["kernel_scale"]
    got = packed.func.apply({"params": packed_params}, x, **packed.keywords)
    want = plain.apply({"params": params}, x)
    np.testing.assert_allclose(got[:5], want[:5], rtol=1e-5, atol=1e-5)
    assert bool(jnp.all(got[5:] == 0)) and bool(jnp.all(want[5:] != 0))


def _runner():
    from checkpoints import load_model
    from jaxserve.runtime.model_runner import ModelRunner, RunnerConfig

    config = RunnerConfig(
        num_pages=8, page_size=4, max_model_len=32, token_buckets=(8,), seq_buckets=(2,)
    )
    return ModelRunner(load_model(None, dtype=jnp.float32), config)


@pytest.mark.skipif(not cpu_ffi.packed_matmul_available(), reason="this CPU has no AVX-512")
def test_the_runner_steps_on_packed_weights_and_repacks_what_it_is_given(monkeypatch):
    """stories260k on this CPU: the step's tree is the params' packed (o_proj [1, 64, 64]), the
    canonical tree stays what trainers read, and new params (a swap, a wake-up) are packed again
    before the next step; $JAXSERVE_CPU_PACKED_WEIGHTS=0 keeps XLA's dot."""
    runner = _runner()
    assert runner.module.packed_weights
    canonical = runner.params["layers_0"]["self_attn"]["o_proj"]["kernel"]
    stepped = runner.step_params["layers_0"]["self_attn"]["o_proj"]["kernel"]
    assert canonical.shape == (64, 64) and stepped.shape == (1, 64, 64)
    new = jax.tree.map(lambda a: a * 2, runner.params)
    runner.params = new
    stepped = runner.step_params["layers_0"]["self_attn"]["o_proj"]["kernel"]
    np.testing.assert_array_equal(stepped, cpu_ffi.pack_weight(canonical * 2))
    runner.params = None  # asleep at level 2: nothing on the device to step on
    assert runner.step_params is None
    monkeypatch.setenv("JAXSERVE_CPU_PACKED_WEIGHTS", "0")
    plain = _runner()
    assert not plain.module.packed_weights and plain.step_params is plain.params


@pytest.mark.skipif(not cpu_ffi.packed_matmul_available(), reason="this CPU has no AVX-512")
def test_only_float32_on_one_cpu_device_packs():
    """bfloat16 and a tensor-parallel mesh keep XLA's dot: the kernel is float32, and the packed
    layout has no sharding rules for a split weight."""
    from types import SimpleNamespace

    from jaxserve.runtime.model_runner import packs_weights

    def plan(platform="cpu", devices=1):
        return SimpleNamespace(platform=platform, mesh=SimpleNamespace(size=devices))

    assert packs_weights(jnp.float32, plan())
    assert not packs_weights(jnp.bfloat16, plan())
    assert not packs_weights(jnp.float32, plan(devices=2))
    assert not packs_weights(jnp.float32, plan(platform="tpu"))


def test_the_call_returns_only_once_every_chunk_is_written():
    """The op after the matmul reads its output at once: a call that returned while a pool
    thread still wrote its last chunk would hand that op unwritten columns (cpu_pool.h)."""
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.integers(-4, 5, (64, 576)).astype(np.float32))
    w = rng.integers(-4, 5, (576, 1536)).astype(np.float32)
    want = (np.asarray(x) @ w).sum(axis=0)  # exact: integers well inside float32's 24 bits
    wp = cpu_ffi.pack_weight(jnp.asarray(w))
    column_sums = jax.jit(lambda x, wp: cpu_ffi.packed_matmul(x, wp).sum(axis=0))
    for _ in range(40):
        np.testing.assert_array_equal(np.asarray(column_sums(x, wp)), want)


@pytest.mark.parametrize("k_block", [0, 1, 64, 100, 576])
def test_every_k_block_gives_the_same_bits(k_block):
    """How a panel is cut along k is a CPU's speed choice (cpu_ffi.matmul_k_block): every cut,
    whole-K tiles (0) included, runs each element's chain of FMAs in the same order."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((53, 576), np.float32))
    wp = cpu_ffi.pack_weight(jnp.asarray(rng.standard_normal((576, 192), np.float32)))
    want = np.asarray(cpu_ffi.packed_matmul(x, wp, k_block=64))
    got = np.asarray(jax.jit(lambda x, wp: cpu_ffi.packed_matmul(x, wp, k_block=k_block))(x, wp))
    np.testing.assert_array_equal(got, want)
    ref = np.asarray(x, np.float64) @ np.asarray(cpu_ffi.unpack_weight(wp), np.float64)
    assert np.abs(got - ref).max() < 1e-3


def test_a_negative_k_block_is_refused():
    x, wp = jnp.ones((2, 64), jnp.float32), jnp.ones((1, 64, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"k_block is 0 .* got -1"):
        cpu_ffi.packed_matmul(x, wp, k_block=-1)


def test_this_cpus_k_block_follows_its_vendor(monkeypatch):
    cpu_ffi.matmul_k_block.cache_clear()
    try:
        monkeypatch.delenv("JAXSERVE_CPU_MATMUL_K_BLOCK", raising=False)
        monkeypatch.setattr(cpu_ffi, "_cpu_vendor", lambda: "AuthenticAMD")
        assert cpu_ffi.matmul_k_block() == 0
        cpu_ffi.matmul_k_block.cache_clear()
        monkeypatch.setattr(cpu_ffi, "_cpu_vendor", lambda: "GenuineIntel")
        assert cpu_ffi.matmul_k_block() == 64
        cpu_ffi.matmul_k_block.cache_clear()
        monkeypatch.setenv("JAXSERVE_CPU_MATMUL_K_BLOCK", "32")
        assert cpu_ffi.matmul_k_block() == 32
        cpu_ffi.matmul_k_block.cache_clear()
        monkeypatch.setenv("JAXSERVE_CPU_MATMUL_K_BLOCK", "-4")
        with pytest.raises(ValueError, match="got '-4'"):
            cpu_ffi.matmul_k_block()
    finally:
        cpu_ffi.matmul_k_block.cache_clear()
