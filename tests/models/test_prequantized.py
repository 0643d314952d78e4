"""Pre-quantized Hugging Face checkpoints (checkpoints/prequantized.py) against transformers'
own forward of the same folder.

Each checkpoint is made here from a tiny random transformers model whose hidden size is 256,
so the 128x128 blocks are real (two a side), and whose MLP is 320 wide, so gate/up's rows and
down's columns end in a partial block (the ceil case); the fused qkv's pieces are 256 and 128
rows. Written:
- `quant_method: fp8` (transformers' FineGrainedFP8): every decoder matmul quantized per
  128x128 block exactly as transformers' Fp8Quantize does it (checked against it on a shape
  it takes), `weight_scale_inv` beside it. transformers cannot run fp8 matmuls on the CPU;
  it dequantizes the folder (FineGrainedFP8Config(dequantize=True)), which proves the folder
  well formed on a shape whose blocks divide it; the reference of the partial-block shape is
  the float model of transformers' own `_dequantize_fp8_weight` (what its FP8Linear's backward
  multiplies with), because its dequantizing loader divides a partial block's rows evenly
  (320 rows in 3 blocks) and refuses the folder.
- `compressed-tensors` W8A8, int8 ("int-quantized", "naive-quantized") and fp8
  ("float-quantized"): written by compressed-tensors' own apply_quantization_config,
  calculate_qparams (its min-max observer's per-channel scales) and ModelCompressor, read back
  by transformers' CompressedTensorsHfQuantizer, whose forward fake-quantizes each linear's
  input per token.

Tolerances: where both sides compute with the same dequantized weights and float activations
(fp8 blocks; compressed-tensors served weight-only against transformers with its activation
quantization off) the float32 parity bound of test_parity.py, 1e-4 (measured 3e-6 to 1.2e-5),
and the greedy tokens equal. W8A8 with activations quantized on both sides: fp8's per-token
grids are the same (max|x| / 448), so 1e-3 (measured 2.5e-4 and 9.5e-5: e4m3 ties rounding
apart in float32), greedy equal. int8's grids are not: compressed-tensors' scale is
max|x| / 127.5 (its range -128..127), jaxserve's max|x| / 127, so every activation rounds on
another grid and the two forwards are independent draws of the activations' rounding noise
(on these high-gain random models even a 1e-6 nudge of transformers' own input moves its W8A8
logits by 0.13). The bound is twice the noise transformers' own activation quantization adds
(its W8A8 forward against its weight-only one), in the max and in the mean (measured on the
Llama shape: ours 0.28 / 0.051 against its 0.32 / 0.045), and the teacher-forced greedy
choice the same at 90% of the positions (measured 94% and 100%).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import checkpoints
from checkpoints import ModelLoadError
from checkpoints.prequantized import checkpoint_quantization, checkpoint_quantization_of
from jaxserve.quantization import CheckpointQuant, QuantScheme, resolve_checkpoint_quantization
from jaxserve.target import Target
from tests.models.helpers import (
    build_hf_model,
    hf_greedy,
    hf_logits,
    paged_greedy,
    save_hf,
    sequence_logits,
)
from tests.torch_reference import require_compressed_tensors, require_torch

torch = require_torch()
transformers = pytest.importorskip("transformers")

SHAPE = dict(
    vocab_size=128,
    hidden_size=256,  # two 128-blocks a side
    intermediate_size=320,  # 2.5 blocks: gate/up's rows and down's columns end in a part block
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,  # q 256 rows, k and v 128 each
)
DIVISIBLE = {**SHAPE, "intermediate_size": 384}  # blocks divide every matmul
PROMPT = [5, 9, 3, 77, 12, 100, 1, 2, 3, 4, 5, 6, 8, 90, 33, 17]
GREEDY = 16
ATOL = 1e-4
W8A8_FP8_ATOL = 1e-3  # fp8 W8A8: measured 2.5e-4 and 9.5e-5 (e4m3 ties rounding apart)
INT8_W8A8_AGREEMENT = 0.9  # greedy agreement, teacher forced (measured 94% and 100%)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


def fp8_block_quantize(w, block: int = 128):
    """(float8_e4m3fn [out, in], f32 scale_inv [ceil(out / block), ceil(in / block)]) of a
    float weight [out, in], as transformers' Fp8Quantize computes them, the last blocks over
    the rows and columns that remain (FP8Linear's ceil'd scale grid)."""
    out, cols = w.shape
    rows_b, cols_b = -(-out // block), -(-cols // block)
    padded = torch.nn.functional.pad(w.float(), (0, cols_b * block - cols, 0, rows_b * block - out))
    tiles = padded.reshape(rows_b, block, cols_b, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, 1.0), 1.0)
    q = (tiles * scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows_b * block, cols_b * block)[:out, :cols], (1.0 / scales).float()


def _is_linear(name: str) -> bool:
    """A decoder matmul's weight (an expert's too), as the folder names it."""
    return name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in LINEARS


def _is_linear_weight(name: str) -> bool:
    """A decoder matmul's `.weight` (not its bias)."""
    return _is_linear(name) and name.endswith(".weight")


def write_fp8_block(hf, path: Path, quantization_config: dict | None = None, drop=()) -> Path:
    """`hf` saved as a `quant_method: fp8` folder (transformers' FineGrainedFP8 format): its
    own save_pretrained folder with every decoder matmul's weight replaced by its e4m3 blocks
    and `weight_scale_inv` beside it; `drop` names tensors to leave out."""
    from safetensors.torch import load_file, save_file

    save_hf(hf, path)
    tensors = {}
    for name, value in load_file(str(path / "model.safetensors")).items():
        if _is_linear_weight(name):
            q, scale_inv = fp8_block_quantize(value)
            tensors[name] = q.contiguous()
            tensors[name[: -len("weight")] + "weight_scale_inv"] = scale_inv.contiguous()
        else:
            tensors[name] = value
    for name in drop:
        del tensors[name]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config or {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "fmt": "e4m3",
        "modules_to_not_convert": ["lm_head"],
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def fp8_reference(hf, path: Path):
    """The float model transformers' FP8 layers compute with: each weight of the folder at
    `path` dequantized by transformers' own `_dequantize_fp8_weight`."""
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    stored = load_file(str(path / "model.safetensors"))
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if _is_linear_weight(name):
                scale = stored[name[: -len("weight")] + "weight_scale_inv"]
                p.copy_(_dequantize_fp8_weight(stored[name], scale, [128, 128], torch.float32))
    return ref


def write_compressed_tensors(hf, path: Path, preset: str, fmt: str) -> Path:
    """`hf` quantized by compressed-tensors' `preset` ("W8A8": int8, "FP8_DYNAMIC": e4m3;
    channel weights, dynamic per-token activations), compressed as `fmt` and saved."""
    require_compressed_tensors()
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = type(hf)(hf.config).eval()
    model.load_state_dict(hf.state_dict())
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.INITIALIZED,
    )
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):  # the min-max observer's per-channel scales
                w = module.weight
                scale, zero = calculate_qparams(
                    w.amin(dim=1, keepdim=True),
                    w.amax(dim=1, keepdim=True),
                    module.quantization_scheme.weights,
                )
                module.weight_scale.copy_(scale)
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


def load_hf(path: Path, **kwargs):
    """transformers' own load of the folder at `path` (its quantizer chosen by config.json)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def without_activation_quantization(model):
    """A compressed-tensors model (decompressed by one forward) with its input
    fake-quantization off: the dequantized weights with float activations."""
    hf_logits(model, PROMPT[:2])  # the decompression hook runs on the first forward
    for module in model.modules():
        if hasattr(module, "quantization_scheme"):
            module.quantization_enabled = False
    return model


def ours(path: Path, quant: QuantScheme | None = None, **kwargs):
    """jaxserve's float32 load of the folder at `path` (`quant` None: the folder's own)."""
    return checkpoints.load_model(path, dtype=jnp.float32, quant=quant, **kwargs)


def max_diff(loaded, ref) -> float:
    """max |logit difference| over PROMPT between jaxserve's `loaded` and transformers' `ref`."""
    return float(np.max(np.abs(sequence_logits(loaded, PROMPT) - hf_logits(ref, PROMPT))))


# --- fp8, 128x128 blocks ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def fp8_pair(request, tmp_path_factory):
    """(transformers' reference of the folder, jaxserve's load of it) with partial blocks."""
    hf = build_hf_model(request.param, **SHAPE)
    path = write_fp8_block(hf, tmp_path_factory.mktemp(f"fp8-{request.param}"))
    return fp8_reference(hf, path), ours(path), path


def test_the_block_quantizer_is_transformers_own():
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    w = torch.randn(256, 384) * torch.logspace(-2, 1, 384)
    quantizer = type("Q", (), {"quantization_config": FineGrainedFP8Config()})()
    theirs = Fp8Quantize(quantizer)._quantize_one("x.weight", w)
    q, scale_inv = fp8_block_quantize(w)
    assert torch.equal(q.view(torch.uint8), theirs["x.weight"].view(torch.uint8))
    assert torch.equal(scale_inv, theirs["x.weight_scale_inv"])


def test_fp8_blocks_load_8_bit_with_their_block_scales(fp8_pair):
    _, loaded, path = fp8_pair
    assert loaded.quant == QuantScheme(weights="fp8", block=128)
    layer = loaded.params["layers"] if "layers" in loaded.params else loaded.params["layers_0"]
    up = layer["mlp"]["gate_up_proj"]
    assert up["kernel"].dtype == jnp.float8_e4m3fn
    assert up["kernel_scale"].shape[-3:] == (2, 2, 320)  # [ceil(256 / 128), 2, 320]
    assert layer["mlp"]["down_proj"]["kernel_scale"].shape[-2:] == (3, 256)  # ceil(320 / 128)
    assert layer["self_attn"]["qkv_proj"]["kernel_scale"].shape[-4:] == (2, 2, 4, 64)
    # The stored bytes themselves: layer 0's down_proj, transposed.
    from safetensors.torch import load_file

    stored = load_file(str(path / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    down = np.asarray(layer["mlp"]["down_proj"]["kernel"])
    down = down[0] if down.ndim == 3 else down
    np.testing.assert_array_equal(down.view(np.uint8), stored.view(torch.uint8).numpy().T)


def test_fp8_blocks_match_transformers(fp8_pair):
    ref, loaded, _ = fp8_pair
    err = max_diff(loaded, ref)
    assert err <= ATOL, err
    assert paged_greedy(loaded, [PROMPT], GREEDY)[0] == hf_greedy(ref, PROMPT, GREEDY)


def test_transformers_reads_the_fp8_folder_as_its_reference_does(tmp_path):
    """The folder is well formed: transformers' own loader (dequantizing on the CPU) reads the
    weights the reference multiplies with, and jaxserve matches both (blocks dividing every
    matmul, the shape that loader takes)."""
    from transformers import FineGrainedFP8Config

    hf = build_hf_model("llama", **DIVISIBLE)
    path = write_fp8_block(hf, tmp_path)
    theirs = load_hf(path, quantization_config=FineGrainedFP8Config(dequantize=True))
    ref = fp8_reference(hf, path)
    for (name, a), (_, b) in zip(theirs.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a.float(), b), name
    assert max_diff(ours(path), theirs) <= ATOL


def test_fp8_blocks_differ_from_the_float_model(fp8_pair):
    """The comparison sees the quantization: the float weights' logits are visibly elsewhere."""
    ref, loaded, _ = fp8_pair
    hf = build_hf_model(ref.config.model_type, **SHAPE)  # the float model it was made from
    assert max_diff(loaded, hf) > 100 * ATOL


# --- compressed-tensors W8A8 -----------------------------------------------------------------

CT = [("W8A8", "int-quantized"), ("W8A8", "naive-quantized"), ("FP8_DYNAMIC", "float-quantized")]


CT_CASES = [("llama", *c) for c in CT] + [("qwen2", *CT[2]), ("qwen3", *CT[0])]


@pytest.fixture(scope="module")
def ct_folders(tmp_path_factory) -> dict:
    """{(family, format): (folder, preset)}, each written once for the module."""
    out = {}
    for family, preset, fmt in CT_CASES:
        hf = build_hf_model(family, **SHAPE)
        path = tmp_path_factory.mktemp(f"ct-{family}-{fmt}")
        out[(family, fmt)] = (write_compressed_tensors(hf, path, preset, fmt), preset)
    return out


@pytest.fixture(params=CT_CASES, ids=lambda c: f"{c[0]}-{c[2]}")
def ct_folder(request, ct_folders):
    family, _, fmt = request.param
    return ct_folders[(family, fmt)]


def test_compressed_tensors_config_is_read_as_its_scheme(ct_folder):
    path, preset = ct_folder
    ckpt = checkpoint_quantization_of(path)
    weights = "int8" if preset == "W8A8" else "fp8"
    assert (ckpt.method, ckpt.weights, ckpt.activations) == ("compressed-tensors", weights, weights)


def test_compressed_tensors_weights_match_transformers_exactly(ct_folder):
    """Served weight-only against transformers with its activation quantization off: the same
    dequantized weights on both sides, so the float32 bound. The int8 weights arrive as int8."""
    path, preset = ct_folder
    weights = "int8" if preset == "W8A8" else "fp8"
    loaded = ours(path, QuantScheme(weights=weights))
    layer = loaded.params["layers"] if "layers" in loaded.params else loaded.params["layers_0"]
    assert layer["mlp"]["down_proj"]["kernel"].dtype == jnp.dtype(loaded.quant.weight_dtype)
    assert layer["mlp"]["down_proj"]["kernel_scale"].shape[-1:] == (256,)
    ref = without_activation_quantization(load_hf(path))
    err = max_diff(loaded, ref)
    assert err <= ATOL, err
    assert paged_greedy(loaded, [PROMPT], GREEDY)[0] == hf_greedy(ref, PROMPT, GREEDY)


def test_compressed_tensors_w8a8_matches_transformers(ct_folder):
    """Activations quantized per token on both sides (fp8 forced W8A8 on the CPU, which serves
    it weight-only by default). fp8: the same e4m3 grid (max|x| / 448) on both sides, within
    W8A8_FP8_ATOL, greedy the same. int8: the two grids differ (max|x| / 127 here, / 127.5 in
    compressed-tensors), so the roundings are two independent draws of the activations'
    rounding noise: each gap within twice what transformers' own activation quantization
    moves its logits (its W8A8 against its weight-only forward), and the greedy choice the
    same at WEIGHT_GREEDY of the positions."""
    path, preset = ct_folder
    kind = "int8" if preset == "W8A8" else "fp8"
    loaded = ours(path, QuantScheme(weights=kind, activations=kind))
    got = sequence_logits(loaded, PROMPT)
    ref = load_hf(path)
    want = hf_logits(ref, PROMPT)
    diff = np.abs(got - want)
    if kind == "fp8":
        assert diff.max() <= W8A8_FP8_ATOL, diff.max()
        assert paged_greedy(loaded, [PROMPT], GREEDY)[0] == hf_greedy(ref, PROMPT, GREEDY)
        return
    own = np.abs(want - hf_logits(without_activation_quantization(load_hf(path)), PROMPT))
    assert diff.max() <= 2 * own.max(), (diff.max(), own.max())
    assert diff.mean() <= 2 * own.mean(), (diff.mean(), own.mean())
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= INT8_W8A8_AGREEMENT


def test_an_int8_w8a8_folder_serves_as_its_own_scheme_by_default(ct_folders):
    path, _ = ct_folders[("llama", "int-quantized")]
    loaded = ours(path)  # quant None: the checkpoint's own, int8 matmuls on the CPU
    assert loaded.quant == QuantScheme(weights="int8", activations="int8")


# --- which scheme serves ---------------------------------------------------------------------

INT8_W8A8 = CheckpointQuant(method="compressed-tensors", weights="int8", activations="int8")
FP8_BLOCKS = CheckpointQuant(method="fp8", weights="fp8", activations="fp8", block=128)


CPU = Target(platform="cpu", device_kind="cpu")
H100 = Target(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")


def test_the_checkpoint_scheme_serves_under_none_and_its_own_name():
    cpu = CPU
    for name in ("none", "int8-w8a8"):
        scheme, note = resolve_checkpoint_quantization(name, INT8_W8A8, cpu)
        assert scheme == QuantScheme(weights="int8", activations="int8")
        assert "pre-quantized as compressed-tensors int8 W8A8" in note
    scheme, _ = resolve_checkpoint_quantization("int8", INT8_W8A8, cpu)
    assert scheme == QuantScheme(weights="int8")  # the same weights, weight-only
    scheme, note = resolve_checkpoint_quantization("fp8", FP8_BLOCKS, cpu)
    assert scheme == QuantScheme(weights="fp8", block=128) and "weight-only" in note


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_a_conflicting_request_is_refused_naming_both(name):
    ckpt = INT8_W8A8 if name == "fp8" else FP8_BLOCKS
    with pytest.raises(ValueError) as e:
        resolve_checkpoint_quantization(name, ckpt, CPU)
    message = str(e.value)
    assert f"quantization={name!r}" in message and f"quantization={ckpt.name!r}" in message
    assert ckpt.label in message and message.endswith(".")


def test_int8_w8a8_falls_back_or_is_refused_where_no_int8_matmuls_exist():
    gpu = H100
    scheme, note = resolve_checkpoint_quantization("none", INT8_W8A8, gpu)
    assert scheme == QuantScheme(weights="int8") and "weight-only" in note
    with pytest.raises(ValueError, match="needs int8 matmuls"):
        resolve_checkpoint_quantization("int8-w8a8", INT8_W8A8, gpu)
    fp8 = CheckpointQuant(method="compressed-tensors", weights="fp8", activations="fp8")
    scheme, _ = resolve_checkpoint_quantization("none", fp8, gpu)  # H100 has fp8 matmuls
    assert scheme == QuantScheme(weights="fp8", activations="fp8", transposed=True)
    scheme, _ = resolve_checkpoint_quantization("none", fp8, CPU)
    assert scheme == QuantScheme(weights="fp8")


def test_a_transposed_scheme_loads_the_same_model(ct_folders):
    """fp8 W8A8 on GPUs stores `kernel_t`: the folder's kernels moved so after loading."""
    path, _ = ct_folders[("llama", "float-quantized")]
    plain = ours(path, QuantScheme(weights="fp8", activations="fp8"))
    moved = ours(path, QuantScheme(weights="fp8", activations="fp8", transposed=True))
    layer = moved.params["layers"] if "layers" in moved.params else moved.params["layers_0"]
    assert layer["mlp"]["down_proj"]["kernel_t"].shape[-2:] == (256, 320)
    np.testing.assert_allclose(
        sequence_logits(moved, PROMPT), sequence_logits(plain, PROMPT), atol=1e-4
    )


def test_a_folder_refuses_other_weights_than_its_own(ct_folder):
    path, _ = ct_folder
    other = QuantScheme(weights="fp8", block=128)
    with pytest.raises(ModelLoadError, match="cannot load as fp8 weight-only"):
        ours(path, other)


# --- refusals --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_tiny(tmp_path_factory):
    return build_hf_model("llama", **SHAPE)


def test_an_unknown_quant_method_is_refused_naming_it(tmp_path, fp8_tiny):
    write_fp8_block(fp8_tiny, tmp_path, {"quant_method": "awq", "bits": 4})
    with pytest.raises(ModelLoadError) as e:
        ours(tmp_path)
    assert "quant_method='awq'" in str(e.value) and str(e.value).endswith(".")


@pytest.mark.parametrize("block", [[64, 64], [128, 64], None])
def test_another_block_size_is_refused_naming_it(tmp_path, fp8_tiny, block):
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}
    write_fp8_block(fp8_tiny, tmp_path, config)
    with pytest.raises(ModelLoadError) as e:
        ours(tmp_path)
    assert f"weight_block_size={block!r}" in str(e.value) and str(e.value).endswith(".")


def test_a_missing_scale_is_refused_naming_the_tensor(tmp_path, fp8_tiny):
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    write_fp8_block(fp8_tiny, tmp_path, drop=[name])
    with pytest.raises(ModelLoadError) as e:
        ours(tmp_path)
    assert f"Tensor {name!r} is missing" in str(e.value) and str(e.value).endswith(".")


def test_a_misshapen_scale_is_refused_naming_the_tensor(tmp_path, fp8_tiny):
    from safetensors.torch import load_file, save_file

    write_fp8_block(fp8_tiny, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :2].contiguous()  # (2, 2): the partial block dropped
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=rf"Tensor '{name}' has shape \(2, 2\); expected \(2, 3\)"
    ):
        ours(tmp_path)


def test_a_decoder_matmul_left_float_is_refused_naming_it(tmp_path, fp8_tiny):
    from safetensors.torch import load_file, save_file

    write_fp8_block(fp8_tiny, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = fp8_tiny.state_dict()[name].contiguous()
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"Tensor '{name}' .* is float32"):
        ours(tmp_path)


def test_compressed_tensors_schemes_jaxserve_cannot_run_are_refused():
    base = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "strategy": "channel",
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": None,
            }
        },
    }
    assert checkpoint_quantization({"quantization_config": base}).name == "int8"
    for change, named in (
        ({"strategy": "group", "group_size": 128}, "'strategy': 'group'"),
        ({"num_bits": 4}, "'num_bits': 4"),
        ({"symmetric": False}, "'symmetric': False"),
    ):
        q = json.loads(json.dumps(base))
        q["config_groups"]["group_0"]["weights"].update(change)
        with pytest.raises(ValueError, match=named):
            checkpoint_quantization({"quantization_config": q})
    q = dict(base, format="pack-quantized")
    with pytest.raises(ValueError, match="format='pack-quantized'"):
        checkpoint_quantization({"quantization_config": q})


def test_block_scaled_experts_are_refused_naming_the_tensor(tmp_path):
    hf = build_hf_model("qwen3_moe", hidden_size=128)
    path = write_fp8_block(hf, tmp_path)
    with pytest.raises(
        ModelLoadError, match=r"Tensor 'model\.layers\.0\.mlp\.experts\.\d+\..*expert"
    ):
        ours(path)


def test_a_float_tree_quantizes_into_the_block_layout(fp8_pair):
    """A block-scaled model's swapped-in float weights (update_weights) are quantized in its
    layout by quantize_params: one scale per 128 rows and column. e4m3 is a float format, so
    finer scales buy little (they matter near its subnormals): measured within 4% of one scale
    a column (the per-column fp8 scheme), bounded at 10%."""
    from checkpoints.weights import hf_arrays_to_params
    from jaxserve.models.loaded import abstract_params, layer_loop_of
    from jaxserve.models.quant import quantize_params

    ref, loaded, _ = fp8_pair
    hf = build_hf_model(ref.config.model_type, **SHAPE)
    shapes = abstract_params(loaded.config, jnp.float32, layer_loop_of(loaded.params))
    named = {k: v.numpy() for k, v in hf.state_dict().items()}
    tied = loaded.config.tie_word_embeddings
    float_params = hf_arrays_to_params(named, shapes, tied_embeddings=tied)
    want = hf_logits(hf, PROMPT)
    gaps = {}
    for scheme in (loaded.quant, QuantScheme(weights="fp8")):
        params = quantize_params(float_params, scheme)
        model = dataclasses.replace(loaded, params=params, quant=scheme)
        gaps[scheme.block] = np.abs(sequence_logits(model, PROMPT) - want).mean()
    assert 0 < gaps[128] <= 1.1 * gaps[None], gaps


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_block_quantization_round_trips_per_block_of_rows(kind):
    """quantize_weight(block=...): the scale axis counts ceil(rows / block) blocks, each block's
    scale its column's max over those rows (the last block the 72 rows left), a zero block
    gives 0 scales and 0 weights, and dequantize_weight repeats each scale over its rows."""
    import jax

    from jaxserve.models.quant import dequantize_weight, quantize_weight

    w = jax.random.normal(jax.random.key(0), (2, 200, 48)) * jnp.logspace(-2, 1, 48)
    w = w.at[:, 128:, 5].set(0.0)
    q, scale = quantize_weight(w, kind, -2, block=128)
    assert q.shape == w.shape and scale.shape == (2, 2, 48)
    qmax = 127.0 if kind == "int8" else 448.0
    want = np.stack([np.abs(w[:, :128]).max(1), np.abs(w[:, 128:]).max(1)], axis=1) / qmax
    np.testing.assert_allclose(scale, want, rtol=1e-6)
    assert not np.any(np.asarray(scale)[:, 1, 5]) and not np.any(
        np.asarray(q, np.float32)[:, 128:, 5]
    )
    back = np.asarray(dequantize_weight(q, scale, -2, block=128))
    rows = np.repeat(np.asarray(scale), 128, axis=1)[:, :200]
    if kind == "int8":
        bound = rows / 2
    else:
        bound = np.maximum(np.abs(np.asarray(w)) * 2.0**-4, rows * 2.0**-10)
    assert np.all(np.abs(back - np.asarray(w)) <= bound * (1 + 1e-5))


def _edited(folder: Path, tmp_path: Path, edit) -> Path:
    """A copy of `folder` whose tensors `edit` (a dict of name -> torch tensor) changed."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = Path(shutil.copytree(folder, tmp_path / "edited"))
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_zero_points_are_dropped_when_zero_and_refused_otherwise(ct_folders, tmp_path):
    folder, _ = ct_folders[("llama", "int-quantized")]
    name = "model.layers.0.mlp.down_proj.weight_zero_point"

    def zeros(t):
        t[name] = torch.zeros(256, 1, dtype=torch.int8)

    scheme = QuantScheme(weights="int8")
    same = ours(_edited(folder, tmp_path / "a", zeros), scheme)
    np.testing.assert_array_equal(
        sequence_logits(same, PROMPT), sequence_logits(ours(folder, scheme), PROMPT)
    )

    def ones(t):
        t[name] = torch.ones(256, 1, dtype=torch.int8)

    with pytest.raises(ModelLoadError, match=rf"Tensor '{name}' holds non-zero zero points"):
        ours(_edited(folder, tmp_path / "b", ones))


def test_an_8_bit_head_is_refused_naming_it(ct_folders, tmp_path):
    folder, _ = ct_folders[("llama", "int-quantized")]

    def quantized_head(t):
        t["lm_head.weight"] = torch.ones_like(t["lm_head.weight"], dtype=torch.int8)
        t["lm_head.weight_scale"] = torch.ones(128, 1)

    with pytest.raises(ModelLoadError, match=r"Tensor 'lm_head.weight' .* is int8, but jaxserve"):
        ours(_edited(folder, tmp_path, quantized_head))


def test_a_misshapen_channel_scale_is_refused_naming_it(ct_folders, tmp_path):
    folder, _ = ct_folders[("llama", "int-quantized")]
    name = "model.layers.1.self_attn.k_proj.weight_scale"

    def halved(t):
        t[name] = t[name][:64].contiguous()

    with pytest.raises(ModelLoadError, match=rf"Tensor '{name}' has shape \(64, 1\); expected"):
        ours(_edited(folder, tmp_path, halved))
