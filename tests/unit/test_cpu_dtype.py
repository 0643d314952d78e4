"""16-bit parameters on the CPU are refused at start with the reason, unless asked for anyway."""

from __future__ import annotations

import pytest

from jaxserve.engine import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.runtime.builder import CPU_HALF_PRECISION_ENV, check_cpu_dtype


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_an_engine_on_the_cpu_refuses_16_bit_params_before_loading(dtype, monkeypatch):
    monkeypatch.delenv(CPU_HALF_PRECISION_ENV, raising=False)
    with pytest.raises(ValueError, match=f"--dtype {dtype} is refused on the CPU.*float32"):
        Engine(EngineConfig(dtype=dtype, show_progress=False))


def test_float32_and_accelerators_and_the_override_pass(monkeypatch):
    monkeypatch.delenv(CPU_HALF_PRECISION_ENV, raising=False)
    for dtype in (None, "float32"):
        check_cpu_dtype(dtype, "cpu")
    check_cpu_dtype("bfloat16", "tpu")
    check_cpu_dtype("bfloat16", "gpu")
    monkeypatch.setenv(CPU_HALF_PRECISION_ENV, "1")
    check_cpu_dtype("bfloat16", "cpu")
