"""`--quantization`: the names, what each resolves to on each chip, the refusals' sentences, and
the roofline's floor at quantized bytes. No model runs here."""

from __future__ import annotations

import argparse

import pytest

from checkpoints import NAMED_SHAPES
from jaxserve.engine_args import add_engine_args, engine_config_from_args
from jaxserve.engine_config import EngineConfig
from jaxserve.quantization import QUANTIZATIONS, QuantScheme, resolve_quantization
from jaxserve.runtime.roofline import layer_weights, step_floor
from jaxserve.target import Target

CPU = Target(platform="cpu", device_kind="cpu")
V5E = Target(platform="tpu", device_kind="TPU v5 lite")
V6E = Target(platform="tpu", device_kind="TPU v6 lite")
TPU7X = Target(platform="tpu", device_kind="TPU7x")
H100 = Target(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize(
    ("name", "where", "weights", "activations", "falls_back"),
    [
        ("int8", CPU, "int8", None, False),
        ("int8", H100, "int8", None, False),
        ("int8-w8a8", CPU, "int8", "int8", False),
        ("int8-w8a8", V5E, "int8", "int8", False),
        ("int8-w8a8", V6E, "int8", "int8", False),
        ("fp8", H100, "fp8", "fp8", False),
        ("fp8", TPU7X, "fp8", "fp8", False),
        ("fp8", V5E, "fp8", None, True),
        ("fp8", CPU, "fp8", None, True),
    ],
)
def test_each_scheme_resolves_by_the_chip_s_matmuls(name, where, weights, activations, falls_back):
    scheme, note = resolve_quantization(name, where)
    # GPUs' fp8 GEMM reads kernels with the contracting axis minor: stored so there alone.
    transposed = activations == "fp8" and where.platform == "gpu"
    assert scheme == QuantScheme(weights=weights, activations=activations, transposed=transposed)
    assert (note is not None) == falls_back
    if falls_back:  # said at start, naming the chip and what it lacks
        assert "weight-only" in note and "no fp8 matmuls" in note
        assert (where.device_kind if where.platform != "cpu" else "the CPU") in note


def test_none_is_no_scheme():
    assert resolve_quantization("none", V5E) == (None, None)


@pytest.mark.parametrize("where", [H100, TPU7X])
def test_int8_w8a8_is_refused_where_the_chip_has_no_int8_dot(where):
    with pytest.raises(ValueError, match=r"int8-w8a8.*needs int8 matmuls.*quantization=.int8."):
        resolve_quantization("int8-w8a8", where)


def test_an_unknown_name_is_refused_in_a_sentence_naming_the_choices():
    with pytest.raises(ValueError, match=r"quantization='int4' must be one of \('none'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization='int4' must be one of"):
        resolve_quantization("int4", CPU)


def test_the_flag_takes_each_name_and_refuses_others(capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for name in QUANTIZATIONS:
        args = parser.parse_args(["--quantization", name])
        assert engine_config_from_args(args).quantization == name
    assert engine_config_from_args(parser.parse_args([])).quantization == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_a_scheme_s_activations_must_match_its_weights():
    with pytest.raises(ValueError, match="activations='fp8' must be None"):
        QuantScheme(weights="int8", activations="fp8")
    assert QuantScheme(weights="fp8", activations="fp8").label == "fp8 W8A8"
    assert QuantScheme(weights="int8").weight_dtype == "int8"


@pytest.mark.parametrize("name", ["llama3.1-8b", "qwen3-moe-tiny"])
def test_the_floor_reads_quantized_decoder_weights_at_one_byte(name):
    """Exactly the decoder's matmul weights get cheaper; the head, embedding and KV do not."""
    model = NAMED_SHAPES[name]
    full = step_floor(model, 1, 1, 2)
    quantized = step_floor(model, 1, 1, 2, weight_itemsize=1)
    saved = model.num_layers * layer_weights(model, num_tokens=1) * (2 - 1)
    assert full.bytes - quantized.bytes == pytest.approx(saved)
    assert full.flops == quantized.flops
    if name == "llama3.1-8b":  # 13.96 GB of decoder weights in bf16, 6.98 GB saved
        assert saved == pytest.approx(6.98e9, rel=1e-3)
