"""8-bit weights (jaxserve/models/quant.py): the quantization's bounds, the dots that read it, and
the quantized model's logits against the float model's, on stories260k's real weights and on
a mixture of experts."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import load_model
from jaxserve.models.kv_pool import KVPages, kv_lanes
from jaxserve.models.loaded import abstract_params, layer_loop_of, model_for
from jaxserve.models.quant import (
    contracting_axis,
    dequantize_weight,
    qdot,
    quantize_activations,
    quantize_params,
    quantize_weight,
)
from jaxserve.models.step_batch import SeqChunk, pack_chunks
from jaxserve.quantization import QuantScheme

INT8 = QuantScheme(weights="int8")
FP8 = QuantScheme(weights="fp8")
W8A8 = QuantScheme(weights="int8", activations="int8")
FP8_W8A8 = QuantScheme(weights="fp8", activations="fp8")
FP8_W8A8_T = QuantScheme(weights="fp8", activations="fp8", transposed=True)  # GPUs' layout
SCHEMES = {"int8": INT8, "fp8": FP8, "int8-w8a8": W8A8, "fp8-w8a8": FP8_W8A8}


def _weights(shape, seed=0) -> jax.Array:
    # Columns of very different magnitudes: one shared scale would fail the per-column bounds.
    w = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    return w * jnp.logspace(-3, 1, shape[-1])


@pytest.mark.parametrize("axis", [-2, -3])
def test_int8_round_trip_is_within_half_a_step_of_each_column(axis):
    w = _weights((2, 40, 3, 24))
    q, scale = quantize_weight(w, "int8", axis)
    assert q.dtype == jnp.int8 and q.shape == w.shape
    assert scale.shape == tuple(np.delete(w.shape, axis))
    np.testing.assert_allclose(scale, jnp.max(jnp.abs(w), axis=axis) / 127, rtol=1e-6)
    err = jnp.abs(dequantize_weight(q, scale, axis) - w)
    step = jnp.expand_dims(scale, axis)
    assert bool(jnp.all(err <= step / 2 * (1 + 1e-5)))
    # Each column's largest weight lands on +-127 exactly: the whole range is used.
    assert bool(jnp.all(jnp.max(jnp.abs(q.astype(jnp.int32)), axis=axis) == 127))


def test_fp8_round_trip_keeps_e4m3_relative_precision():
    w = _weights((64, 48))
    q, scale = quantize_weight(w, "fp8", -2)
    assert q.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(scale, jnp.max(jnp.abs(w), axis=0) / 448, rtol=1e-6)
    back = dequantize_weight(q, scale, -2)
    # e4m3's 3 mantissa bits: a relative error of at most 2^-4 for normal values; below its
    # smallest normal (2^-6 of the scale) the subnormals' absolute step 2^-9, half of it.
    bound = jnp.maximum(jnp.abs(w) * 2.0**-4, scale * 2.0**-10)
    assert bool(jnp.all(jnp.abs(back - w) <= bound * (1 + 1e-5)))
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == 448.0


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_zero_column_quantizes_to_zeros_with_no_nan(kind):
    w = _weights((16, 8)).at[:, 3].set(0.0)
    q, scale = quantize_weight(w, kind, -2)
    assert float(scale[3]) == 0.0 and not bool(jnp.any(q[:, 3].astype(jnp.float32)))
    back = dequantize_weight(q, scale, -2)
    assert bool(jnp.all(jnp.isfinite(back))) and not bool(jnp.any(back[:, 3]))
    x = jnp.ones((2, 16)).at[1].set(0.0)  # a zero row of activations too
    y = qdot(x, q, scale, QuantScheme(weights=kind, activations=kind), jnp.float32)
    assert bool(jnp.all(jnp.isfinite(y))) and not bool(jnp.any(y[:, 3])) and not bool(jnp.any(y[1]))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_activations_are_quantized_per_token_within_their_format_s_step(kind):
    x = jax.random.normal(jax.random.key(4), (6, 40)) * jnp.logspace(-2, 2, 6)[:, None]
    xq, x_scale = quantize_activations(x, kind)
    qmax = 127 if kind == "int8" else 448
    np.testing.assert_allclose(x_scale[:, 0], jnp.max(jnp.abs(x), axis=1) / qmax, rtol=1e-6)
    back = xq.astype(jnp.float32) * x_scale
    if kind == "int8":  # rounded: within half a step of the token's scale
        assert bool(jnp.all(jnp.abs(back - x) <= x_scale / 2 * (1 + 1e-5)))
    else:  # e4m3: 2^-4 relative, or half a subnormal step near 0
        bound = jnp.maximum(jnp.abs(x) * 2.0**-4, x_scale * 2.0**-10)
        assert bool(jnp.all(jnp.abs(back - x) <= bound * (1 + 1e-5)))
    assert bool(jnp.all(jnp.max(jnp.abs(xq.astype(jnp.float32)), axis=1) == qmax))


def test_weight_only_dot_is_the_float_dot_of_the_dequantized_weight():
    """The scale after the dot equals it before (linear), to float32 rounding."""
    x = jax.random.normal(jax.random.key(1), (5, 40))
    w = _weights((40, 3, 24))
    for kind in ("int8", "fp8"):
        q, scale = quantize_weight(w, kind, -3)
        got = qdot(x, q, scale, QuantScheme(weights=kind), jnp.float32, jax.lax.Precision.HIGHEST)
        want = jnp.einsum("ti,ijk->tjk", x, dequantize_weight(q, scale, -3), precision="highest")
        assert got.shape == (5, 3, 24)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_w8a8_dot_is_the_product_of_both_dequantized_operands(kind):
    x = jax.random.normal(jax.random.key(2), (6, 40)) * jnp.arange(1, 7)[:, None]
    w = _weights((40, 24))
    q, scale = quantize_weight(w, kind, -2)
    xq, x_scale = quantize_activations(x, kind)
    assert x_scale.shape == (6, 1)  # one scale per token
    np.testing.assert_allclose(
        x_scale[:, 0], jnp.max(jnp.abs(x), axis=1) / (127 if kind == "int8" else 448), rtol=1e-6
    )
    got = qdot(x, q, scale, QuantScheme(weights=kind, activations=kind), jnp.float32)
    want = (xq.astype(jnp.float32) * x_scale) @ dequantize_weight(q, scale, -2)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(want))))
    if kind == "int8":  # the dot itself runs in integers, accumulated in int32
        text = jax.jit(qdot, static_argnums=(3, 4)).lower(x, q, scale, W8A8, jnp.float32).as_text()
        assert "xi8>" in text and "-> tensor<6x24xi32>" in text


def test_the_transposed_layout_computes_the_same_dot():
    """fp8 W8A8's [*features, in] kernels (GPUs) give the [in, *features] kernels' output."""
    x = jax.random.normal(jax.random.key(3), (5, 40))
    w = _weights((40, 3, 24))
    q, scale = quantize_weight(w, "fp8", -3)
    qt, scale_t = quantize_weight(jnp.moveaxis(w, -3, -1), "fp8", -1)
    np.testing.assert_array_equal(
        np.asarray(qt, np.float32), np.moveaxis(np.asarray(q, np.float32), 0, -1)
    )
    np.testing.assert_array_equal(scale_t, scale)
    np.testing.assert_allclose(
        qdot(x, qt, scale_t, FP8_W8A8_T, jnp.float32),
        qdot(x, q, scale, FP8_W8A8, jnp.float32),
        rtol=1e-6,
    )


def _logits(model, quant, tokens: list[int], plan=None) -> np.ndarray:
    """f32[len(tokens), vocab] of one sequence's teacher-forced forward (reference attention),
    split as `plan` (a ShardingPlan) says where one is given."""
    c = model.config
    layer_loop = layer_loop_of(model.params)
    module = model_for(c, model.dtype, "reference", plan, layer_loop=layer_loop, quant=quant)
    pages = -(-len(tokens) // 16)
    batch = pack_chunks(
        [SeqChunk(tokens, 0, list(range(pages)))],
        page_size=16,
        num_tokens=len(tokens),
        num_seqs=1,
        pages_per_seq=pages,
        num_pages=pages,
    )
    kv = KVPages(kv=jnp.zeros((c.num_layers, pages, 16, kv_lanes(c)), model.dtype))

    @jax.jit
    def forward(params, kv):
        hidden, _ = module.apply({"params": params}, kv, batch)
        return module.apply({"params": params}, hidden, method=module.logits)

    return np.asarray(forward(model.params, kv))


@pytest.fixture(scope="module")
def stories():
    return load_model(None, dtype=jnp.float32)


TOKENS = [1, 403, 407, 261, 378, 284, 359, 395, 291, 266, 422, 289, 266, 330, 263, 394] * 2


# Measured on stories260k (float32, these 32 positions), whose logits spread ~7.2 (standard
# deviation over the vocabulary): the mean |logit difference| from the float model was 0.069
# (int8), 0.226 (fp8), 0.125 (int8-w8a8), 0.294 (fp8-w8a8); the greedy token agreed at 94%, 91%,
# 94% and 84% of the positions. The bounds are twice the means: e4m3's 3 mantissa bits against
# int8's 7 order them, and a scale on the wrong axis, a skipped scale or truncation in place of
# rounding moves the logits by whole units.
MEAN_BOUNDS = {"int8": 0.14, "fp8": 0.45, "int8-w8a8": 0.25, "fp8-w8a8": 0.6}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantized_logits_stay_close_to_the_float_model(stories, name):
    scheme = SCHEMES[name]
    want = _logits(stories, None, TOKENS)
    params = quantize_params(stories.params, scheme)
    quantized = dataclasses.replace(stories, params=params, quant=scheme)
    got = _logits(quantized, scheme, TOKENS)
    diff = np.abs(got - want).mean()
    assert 0 < diff < MEAN_BOUNDS[name], diff
    # The same greedy choice at most positions: the model still reads the text.
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.8


def test_the_transposed_tree_serves_the_same_logits(stories):
    """quantize_params moves the contracting axis last for a transposed scheme (`kernel_t`),
    and the model reads it so: the logits are the untransposed scheme's."""
    params = quantize_params(stories.params, FP8_W8A8_T)
    layer = params["layers"] if "layers" in params else params["layers_0"]
    c = stories.config
    assert layer["self_attn"]["qkv_proj"]["kernel_t"].shape[-4:] == (
        c.num_kv_heads,
        c.q_per_kv + 2,
        c.head_dim,
        c.hidden_size,
    )
    assert "kernel" not in layer["mlp"]["down_proj"]
    got = _logits(dataclasses.replace(stories, params=params, quant=FP8_W8A8_T), FP8_W8A8_T, TOKENS)
    plain = quantize_params(stories.params, FP8_W8A8)
    want = _logits(dataclasses.replace(stories, params=plain, quant=FP8_W8A8), FP8_W8A8, TOKENS)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_the_quantized_tree_holds_8_bit_kernels_and_float_scales_beside_them(stories):
    params = quantize_params(stories.params, W8A8)
    flat = {
        "/".join(str(k.key) for k in kp): leaf
        for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    shapes = jax.tree_util.tree_flatten_with_path(
        abstract_params(stories.config, jnp.float32, layer_loop_of(params), quant=W8A8)
    )[0]
    assert {"/".join(str(k.key) for k in kp): (s.shape, s.dtype) for kp, s in shapes} == {
        p: (a.shape, a.dtype) for p, a in flat.items()
    }
    kernels = [
        p
        for p in flat
        if p.endswith(
            ("qkv_proj/kernel", "o_proj/kernel", "down_proj/kernel", "gate_up_proj/kernel")
        )
    ]
    assert len(kernels) == 4 * stories.config.num_layers
    assert all(
        flat[p].dtype == jnp.int8 and flat[p + "_scale"].dtype == jnp.float32 for p in kernels
    )
    # The embedding (and the tied head it is) and the norms stay float.
    assert flat["embed_tokens/embedding"].dtype == jnp.float32
    assert all(a.dtype == jnp.float32 for p, a in flat.items() if p.endswith("norm/scale"))
    # Quantizing again changes nothing: the scales mark what is done.
    again = quantize_params(params, W8A8)
    assert jax.tree.structure(again) == jax.tree.structure(params)


def test_the_experts_are_quantized_and_the_router_is_not():
    model = load_model("qwen3-moe-tiny", dtype=jnp.float32)
    params = quantize_params(model.params, INT8)
    mlp = (params["layers"] if "layers" in params else params["layers_0"])["mlp"]
    m, h = model.config.moe, model.config.hidden_size
    assert mlp["experts_gate_up"].dtype == jnp.int8 and mlp["experts_down"].dtype == jnp.int8
    assert mlp["experts_gate_up_scale"].shape[-3:] == (m.num_experts, 2, m.intermediate_size)
    assert mlp["experts_down_scale"].shape[-2:] == (m.num_experts, h)
    assert mlp["router"].dtype == jnp.float32
    got = _logits(dataclasses.replace(model, params=params, quant=INT8), INT8, TOKENS[:12])
    # Against the float model of the dequantized weights the quantized experts are exact (to
    # float32 rounding, measured 1e-6 of logits of spread 0.32): each row's expert's scales
    # are applied to its own rows. Against the float weights the error is not a useful bound:
    # int8 noise flips near-tied routing choices (measured 0.12, five times the dense shape's).
    dequantized = dataclasses.replace(model, params=_dequantized(params))
    want = _logits(dequantized, None, TOKENS[:12])
    assert np.abs(got - want).max() < 1e-4 * want.std()
    assert np.abs(got - _logits(model, None, TOKENS[:12])).max() > 1e-3  # it was quantized


def _dequantized(tree: dict, path: tuple[str, ...] = ()) -> dict:
    """A quantized tree as the float tree of q * scale (the scales dropped)."""
    out = {}
    for key, value in tree.items():
        axis = contracting_axis((*path, key))
        if isinstance(value, dict):
            out[key] = _dequantized(value, (*path, key))
        elif axis is not None:
            out[key] = dequantize_weight(value, tree[key + "_scale"], axis)
        elif not key.endswith("_scale"):
            out[key] = value
    return out


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "llama-tiny",
            ["qkv_proj/kernel", "o_proj/kernel", "gate_up_proj/kernel", "down_proj/kernel"],
        ),
        (
            "qwen3-moe-tiny",
            ["qkv_proj/kernel", "o_proj/kernel", "mlp/experts_gate_up", "mlp/experts_down"],
        ),
    ],
)
def test_every_matmul_of_the_decoder_is_quantized(name, expected):
    """By path: a renamed param would be left float without this failing elsewhere."""
    params = quantize_params(load_model(name, dtype=jnp.float32, layer_loop="scan").params, INT8)
    int8 = sorted(
        "/".join(str(k.key) for k in kp)
        for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if leaf.dtype == jnp.int8
    )
    assert int8 == sorted(
        f"layers/{p}"
        if p.startswith("mlp")
        else f"layers/self_attn/{p}"
        if "proj" in p and p.split("/")[0] in ("qkv_proj", "o_proj")
        else f"layers/mlp/{p}"
        for p in expected
    )


@pytest.mark.parametrize("on_mesh", [False, True])
def test_a_folder_loads_quantized_one_param_at_a_time(stories, on_mesh):
    """load_model(quant=...) of a Hugging Face folder: the tree quantize_params makes of the
    float load; on a mesh each param is read only when its turn comes (lazy leaves)."""
    from checkpoints import DEFAULT_MODEL_DIR
    from checkpoints.weights import place_hf_weights
    from jaxserve.models.sharding import ShardingPlan, make_mesh

    mesh = make_mesh(1) if on_mesh else None
    loaded = load_model(DEFAULT_MODEL_DIR, dtype=jnp.float32, mesh=mesh, quant=INT8)
    assert loaded.quant == INT8
    want = quantize_params(stories.params, INT8)
    assert jax.tree.structure(loaded.params) == jax.tree.structure(want)
    for got, ref in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    if on_mesh:
        shapes = abstract_params(stories.config, jnp.float32, layer_loop_of(stories.params))
        plan = ShardingPlan.create(mesh, stories.config)
        lazy = place_hf_weights(
            DEFAULT_MODEL_DIR, shapes, plan.params(shapes), tied_embeddings=True, lazy=True
        )
        assert all(callable(leaf) for leaf in jax.tree.leaves(lazy))  # nothing read yet
