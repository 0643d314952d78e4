"""The chip table: lookups by generation and device kind, clear errors, and agreement with the
hardware facts JAX's Pallas TPU backend carries (where this JAX has them)."""

from __future__ import annotations

import dataclasses

import pytest

from pallas_kernels import chips


@pytest.mark.parametrize("name", list(chips.TPU_CHIPS))
def test_tpu_rows_are_found_by_generation_and_device_kind(name: str):
    row = chips.TPU_CHIPS[name]
    assert chips.tpu_chip(name) is row
    assert chips.tpu_chip(name.upper()) is row
    for kind in row.device_kinds:
        assert chips.tpu_chip(kind) is row
        assert chips.lookup(kind) is row
    assert row.default_scoped_vmem_bytes <= row.vmem_bytes
    assert row.hbm_bytes_per_device * row.devices_per_chip == row.hbm_bytes


def test_device_kinds_jax_reports():
    """The strings JAX gives `device_kind` on each generation (and on AOT topologies)."""
    assert chips.tpu_chip("TPU v4").name == "v4"
    assert chips.tpu_chip("TPU v5 lite").name == "v5e"
    assert chips.tpu_chip("TPU v5").name == "v5p"  # not v5e: matching is exact
    assert chips.tpu_chip("TPU v6 lite").name == "v6e"
    assert chips.tpu_chip("TPU7x").name == "tpu7x"
    assert chips.gpu_chip("NVIDIA H200").name == "h200"
    assert chips.gpu_chip("NVIDIA H100 80GB HBM3").name == "h100"


def test_unknown_chips_raise_a_sentence_naming_the_chip():
    with pytest.raises(ValueError, match=r"Unknown TPU chip 'TPU v4 lite'.*v5e \(TPU v5 lite"):
        chips.tpu_chip("TPU v4 lite")
    with pytest.raises(ValueError, match="Unknown GPU chip 'NVIDIA A100"):
        chips.gpu_chip("NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"Unknown chip 'cpu'.*known TPUs.*known GPUs"):
        chips.lookup("cpu")


def test_gpu_rows():
    h100, h200 = chips.gpu_chip("h100"), chips.gpu_chip("h200")
    assert h100.compute_capability == h200.compute_capability == "9.0"
    assert h200.hbm_bytes > h100.hbm_bytes and h200.hbm_bandwidth > h100.hbm_bandwidth
    assert h200.peak_bf16_flops == h100.peak_bf16_flops  # same GH100 compute, more memory
    assert chips.lookup("NVIDIA H200") is h200


def test_rows_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        chips.tpu_chip("v5e").vmem_bytes = 1


def test_ridge_points_are_plausible():
    """FLOPs per HBM byte at the roofline's ridge: a typo of 1000x in either would show here."""
    for row in (*chips.TPU_CHIPS.values(), *chips.GPU_CHIPS.values()):
        assert 100 < row.peak_bf16_flops / row.hbm_bandwidth < 600, row.name


@pytest.mark.parametrize("name", list(chips.TPU_CHIPS))
def test_tpu_rows_agree_with_jax_tpu_info(name: str):
    """JAX's own per-TensorCore table (jax.experimental.pallas.tpu.get_tpu_info_for_chip).

    VMEM must match exactly (both were measured against the compiler); HBM and bf16 peak to a
    few percent, since JAX rounds them differently from the spec pages. Bandwidth is not
    compared: JAX's v5p figure (2.46e12) is not the spec page's 2765 GBps.
    """
    from jax.experimental.pallas import tpu as pltpu

    get_info = getattr(pltpu, "get_tpu_info_for_chip", None)
    if get_info is None:
        pytest.skip("This JAX has no pltpu.get_tpu_info_for_chip to compare with.")
    version = {"v4": "v4", "v5e": "v5e", "v5p": "v5p", "v6e": "v6e", "tpu7x": "7x"}[name]
    row = chips.tpu_chip(name)
    megacore = row.tensorcores_per_chip // row.devices_per_chip
    info = get_info(pltpu.ChipVersion(version), megacore)
    assert info.vmem_capacity_bytes == row.vmem_bytes
    assert info.hbm_capacity_bytes * row.tensorcores_per_chip == pytest.approx(
        row.hbm_bytes, rel=0.05
    )
    assert info.bf16_ops_per_second * row.tensorcores_per_chip == pytest.approx(
        row.peak_bf16_flops, rel=0.02
    )
