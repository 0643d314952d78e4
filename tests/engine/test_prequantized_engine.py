"""A pre-quantized Hugging Face folder through the engine: served in its own scheme under the
default `--quantization none`, an explicit conflicting scheme refused with both named, its
greedy text transformers' own, and the folder swapped in again (update_weights) with no
compile. The folders are tests/models/test_prequantized.py's, made here from tiny random
models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.quantization import QuantScheme
from jaxserve.runtime.model_runner import packs_weights
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import TINY
from tests.models.helpers import build_hf_model, hf_greedy
from tests.models.test_prequantized import (
    PROMPT,
    SHAPE,
    fp8_reference,
    load_hf,
    write_compressed_tensors,
    write_fp8_block,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    hf = build_hf_model("llama", **SHAPE)
    fp8 = write_fp8_block(hf, tmp_path_factory.mktemp("fp8"))
    int8 = write_compressed_tensors(hf, tmp_path_factory.mktemp("ct"), "W8A8", "int-quantized")
    return hf, fp8, int8


def _kernel(engine: Engine, path: tuple[str, ...]):
    """The served leaf at `path` under the first (or the stacked) layer."""
    params = engine.runner.params
    layer = params["layers"] if "layers" in params else params["layers_0"]
    for key in path:
        layer = layer[key]
    return layer


def test_an_fp8_block_folder_serves_as_its_own_scheme(folders):
    hf, fp8, _ = folders
    engine = Engine(EngineConfig(model=str(fp8), **TINY))
    assert engine.runner.model.quant == QuantScheme(weights="fp8", block=128)
    assert _kernel(engine, ("mlp", "down_proj", "kernel")).dtype == jnp.float8_e4m3fn
    # Never packed for the CPU's kernels (they apply one scale a column; packs_weights).
    assert engine.runner.step_params is engine.runner.params
    out = LLM(engine=engine).generate([PROMPT], GREEDY)[0].token_ids
    assert list(out) == hf_greedy(fp8_reference(hf, fp8), PROMPT, GREEDY.max_tokens)
    # The same folder again (update_weights): read as stored, served with no compile.
    engine.update_weights(str(fp8))
    assert LLM(engine=engine).generate([PROMPT], GREEDY)[0].token_ids == out
    assert engine.metrics.stats.compiles_after_warmup == 0


def test_an_int8_w8a8_folder_serves_int8_matmuls_and_its_own_name_agrees(folders):
    _, _, int8 = folders
    for name in ("none", "int8-w8a8"):
        engine = Engine(EngineConfig(model=str(int8), quantization=name, **TINY))
        assert engine.runner.model.quant == QuantScheme(weights="int8", activations="int8")
        assert _kernel(engine, ("self_attn", "qkv_proj", "kernel")).dtype == jnp.int8
    # Packed like any int8 tree where the CPU's int8 kernels exist (packs_weights).
    packs = packs_weights(jnp.float32, engine.runner.sharding, engine.runner.model.quant)
    assert (engine.runner.step_params is not engine.runner.params) == packs
    ref = load_hf(int8)
    out = LLM(engine=engine).generate([PROMPT], GREEDY)[0].token_ids
    # W8A8 int8's two activation grids (test_prequantized.py): the first tokens agree.
    assert list(out)[:4] == hf_greedy(ref, PROMPT, 4)


@pytest.mark.parametrize(("which", "name"), [("int8", "fp8"), ("fp8", "int8-w8a8")])
def test_a_conflicting_quantization_is_refused_naming_both(folders, which, name):
    path = folders[2] if which == "int8" else folders[1]
    with pytest.raises(ValueError) as e:
        Engine(EngineConfig(model=str(path), quantization=name, **TINY))
    message = str(e.value)
    own = "int8-w8a8" if which == "int8" else "fp8"
    assert f"quantization={name!r} conflicts" in message and f"quantization={own!r}" in message
    assert message.endswith(".")


def test_a_pre_quantized_folder_is_refused_by_a_float_engine(folders, stories_engine):
    _, fp8, _ = folders
    engine = Engine(EngineConfig(**TINY), model=stories_engine.model)
    with pytest.raises(
        ValueError,
        match=r"pre-quantized as fp8 W8A8 \(128x128 blocks\), but the model served is float",
    ):
        engine.update_weights(str(fp8))
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(engine.runner.params))
