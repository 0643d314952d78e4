"""Facts about the accelerator chips jaxserve targets, in one table, for choices made before a run.

Kernel block sizes (VMEM budgets), roofline step-time predictions and KV-pool sizing all need the
target chip's numbers, and they must be computable for a chip this process is not running on
(ahead-of-time compilation for a TPU topology from a CPU host, or planning a deployment). So the
numbers live here as plain data, looked up by the name of a chip generation ("v5e") or by the
`jax.Device.device_kind` string JAX reports for it ("TPU v5 lite"), never read from a device.

Sources (the vendors' published spec pages; peak rates are dense, without sparsity):
- Google Cloud TPU documentation, "TPU v4", "TPU v5e", "TPU v5p", "TPU v6e" and "TPU7x
  (Ironwood)" system-architecture pages: HBM capacity and bandwidth, peak bf16 and int8/fp8 rates,
  TensorCores per chip.
- NVIDIA "H100 Tensor Core GPU" and "H200 Tensor Core GPU" product spec pages (SXM form factor):
  GPU memory, memory bandwidth, Tensor Core rates (the pages list rates with sparsity; the dense
  rate is half), and NVIDIA's CUDA GPU compute capability list for 9.0.
- HBM sizes are the published capacity; the runtime leaves a little less for arrays, so a KV
  pool sized on a live device should still ask it (`jax.Device.memory_stats()`).
- VMEM per TensorCore is not on the spec pages: the numbers below are the ones the XLA:TPU
  compiler in libtpu (jax 0.10.2) enforces, measured by compiling a Pallas kernel with a growing
  VMEM scratch for each topology (an allocation past them fails with "would exceed memory"), and
  they agree with `jax.experimental.pallas.tpu.get_tpu_info_for_chip`. The default scoped VMEM
  limit (what a Pallas kernel may use without `vmem_limit_bytes`) was measured the same way.
"""

from __future__ import annotations

import dataclasses

_GiB = 2**30
_MiB = 2**20


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuChip:
    """One TPU generation. Rates and HBM are per chip; VMEM is per TensorCore."""

    name: str  # the generation, as jax topology names spell it: "v4", "v5e", "v5p", "v6e", "tpu7x"
    device_kinds: tuple[str, ...]  # `jax.Device.device_kind` strings of this generation
    tensorcores_per_chip: int
    # JAX devices one chip shows up as: 1 where the two TensorCores form one "megacore" device
    # (v4, v5p), 2 on TPU7x (each TensorCore is its own device).
    devices_per_chip: int
    vmem_bytes: int  # per TensorCore: the most a kernel's scoped VMEM limit can be
    default_scoped_vmem_bytes: int  # a Pallas kernel's VMEM limit when none is asked for
    mxu_size: int  # the MXU is mxu_size x mxu_size: 128 before v6e, 256 from v6e on
    hbm_bytes: int  # per chip
    hbm_bandwidth: float  # bytes/s per chip
    peak_bf16_flops: float  # FLOP/s per chip, dense bf16 matmul
    peak_int8_ops: float | None  # OP/s per chip; None where the spec page gives none
    peak_fp8_flops: float | None  # FLOP/s per chip; None where the spec page gives none

    @property
    def hbm_bytes_per_device(self) -> int:
        """HBM of one JAX device (half a chip on TPU7x): what a KV pool on one device may use."""
        return self.hbm_bytes // self.devices_per_chip


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuChip:
    """One NVIDIA GPU model (SXM form factor)."""

    name: str
    device_kinds: tuple[str, ...]  # `jax.Device.device_kind` strings
    compute_capability: str  # as `jax.Device.compute_capability` reports it
    num_sms: int
    hbm_bytes: int  # as published, read as GiB (the H100's five 16 GiB stacks make its "80GB")
    hbm_bandwidth: float  # bytes/s
    peak_bf16_flops: float  # FLOP/s, dense Tensor Core bf16
    peak_fp8_flops: float  # FLOP/s, dense Tensor Core fp8
    peak_fp32_flops: float  # FLOP/s, CUDA cores (non-Tensor-Core) fp32


TPU_CHIPS: dict[str, TpuChip] = {
    chip.name: chip
    for chip in (
        # "TPU v4": 32 GiB HBM2 at 1200 GBps, 275 TFLOPs bf16 or int8, two TensorCores.
        TpuChip(
            name="v4",
            device_kinds=("TPU v4",),
            tensorcores_per_chip=2,
            devices_per_chip=1,
            vmem_bytes=16 * _MiB,
            default_scoped_vmem_bytes=16 * _MiB,
            mxu_size=128,
            hbm_bytes=32 * _GiB,
            hbm_bandwidth=1200e9,
            peak_bf16_flops=275e12,
            peak_int8_ops=275e12,
            peak_fp8_flops=None,
        ),
        # "TPU v5e": 16 GiB at 819 GBps, 197 TFLOPs bf16, 393 TOPs int8, one TensorCore.
        TpuChip(
            name="v5e",
            device_kinds=("TPU v5 lite", "TPU v5e"),
            tensorcores_per_chip=1,
            devices_per_chip=1,
            vmem_bytes=128 * _MiB,
            default_scoped_vmem_bytes=16 * _MiB,
            mxu_size=128,
            hbm_bytes=16 * _GiB,
            hbm_bandwidth=819e9,
            peak_bf16_flops=197e12,
            peak_int8_ops=393e12,
            peak_fp8_flops=None,
        ),
        # "TPU v5p": 95 GiB HBM2e at 2765 GBps, 459 TFLOPs bf16, 918 TOPs int8, two TensorCores.
        TpuChip(
            name="v5p",
            device_kinds=("TPU v5", "TPU v5p"),
            tensorcores_per_chip=2,
            devices_per_chip=1,
            vmem_bytes=64 * _MiB,
            default_scoped_vmem_bytes=16 * _MiB,
            mxu_size=128,
            hbm_bytes=95 * _GiB,
            hbm_bandwidth=2765e9,
            peak_bf16_flops=459e12,
            peak_int8_ops=918e12,
            peak_fp8_flops=None,
        ),
        # "TPU v6e" (Trillium): 32 GiB at 1638 GBps, 918 TFLOPs bf16, 1836 TOPs int8.
        TpuChip(
            name="v6e",
            device_kinds=("TPU v6 lite", "TPU v6e"),
            tensorcores_per_chip=1,
            devices_per_chip=1,
            vmem_bytes=128 * _MiB,
            default_scoped_vmem_bytes=32 * _MiB,
            mxu_size=256,
            hbm_bytes=32 * _GiB,
            hbm_bandwidth=1638e9,
            peak_bf16_flops=918e12,
            peak_int8_ops=1836e12,
            peak_fp8_flops=None,
        ),
        # "TPU7x (Ironwood)": 192 GiB HBM3E at 7380 GBps, 2307 TFLOPs bf16, 4614 TFLOPs fp8;
        # two TensorCores, each its own JAX device.
        TpuChip(
            name="tpu7x",
            device_kinds=("TPU7x",),
            tensorcores_per_chip=2,
            devices_per_chip=2,
            vmem_bytes=64 * _MiB,
            default_scoped_vmem_bytes=32 * _MiB,
            mxu_size=256,
            hbm_bytes=192 * _GiB,
            hbm_bandwidth=7380e9,
            peak_bf16_flops=2307e12,
            peak_int8_ops=None,
            peak_fp8_flops=4614e12,
        ),
    )
}

GPU_CHIPS: dict[str, GpuChip] = {
    chip.name: chip
    for chip in (
        # "H100 Tensor Core GPU", SXM: 80 GB HBM3 at 3.35 TB/s; 1,979 TFLOPS bf16 and 3,958 fp8
        # with sparsity (989.5 and 1,979 dense); 67 TFLOPS fp32; 132 SMs.
        GpuChip(
            name="h100",
            device_kinds=("NVIDIA H100 80GB HBM3",),
            compute_capability="9.0",
            num_sms=132,
            hbm_bytes=80 * _GiB,
            hbm_bandwidth=3.35e12,
            peak_bf16_flops=989.5e12,
            peak_fp8_flops=1979e12,
            peak_fp32_flops=67e12,
        ),
        # "H200 Tensor Core GPU", SXM: 141 GB HBM3e at 4.8 TB/s; the H100's compute.
        GpuChip(
            name="h200",
            # The first as a live H200 reports it, the second as the compile-only target config
            # (pallas_kernels/gpu_targets/h200.txtpb) names it.
            device_kinds=("NVIDIA H200", "NVIDIA H200 141GB HBM3e"),
            compute_capability="9.0",
            num_sms=132,
            hbm_bytes=141 * _GiB,
            hbm_bandwidth=4.8e12,
            peak_bf16_flops=989.5e12,
            peak_fp8_flops=1979e12,
            peak_fp32_flops=67e12,
        ),
    )
}


def _find(table: dict, chip: str):
    """The row whose name or one of whose device kinds is `chip` (case-insensitive), or None."""
    key = chip.strip().lower()
    for row in table.values():
        if key == row.name.lower() or key in (kind.lower() for kind in row.device_kinds):
            return row
    return None


def _known(table: dict) -> str:
    return ", ".join(f"{row.name} ({', '.join(row.device_kinds)})" for row in table.values())


def tpu_chip(chip: str) -> TpuChip:
    """The TPU row for a generation name ("v5e") or a device kind ("TPU v5 lite").

    Matching is exact (case aside), so an unknown or mistyped chip fails here instead of
    silently borrowing another chip's VMEM size.
    """
    row = _find(TPU_CHIPS, chip)
    if row is None:
        raise ValueError(
            f"Unknown TPU chip {chip!r}: pass a generation name or a device kind, one of "
            f"{_known(TPU_CHIPS)}."
        )
    return row


def gpu_chip(chip: str) -> GpuChip:
    """The GPU row for a name ("h200") or a device kind ("NVIDIA H200")."""
    row = _find(GPU_CHIPS, chip)
    if row is None:
        raise ValueError(
            f"Unknown GPU chip {chip!r}: pass a name or a device kind, one of {_known(GPU_CHIPS)}."
        )
    return row


def lookup(chip: str) -> TpuChip | GpuChip:
    """The row for any chip in either table, for callers that handle both (roofline, pools)."""
    row = _find(TPU_CHIPS, chip) or _find(GPU_CHIPS, chip)
    if row is None:
        raise ValueError(
            f"Unknown chip {chip!r}: the known TPUs are {_known(TPU_CHIPS)}; the known GPUs are "
            f"{_known(GPU_CHIPS)}."
        )
    return row


def default_device_kind() -> str:
    """The device kind of the default backend's first device: the target when none is named."""
    import jax  # here, so that the table itself imports without JAX

    return jax.devices()[0].device_kind
