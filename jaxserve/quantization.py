"""`--quantization`: which weights are stored in 8 bits and how their matmuls run, per target.

    scheme, note = resolve_quantization("fp8", target.current())   # QuantScheme or None

Four names (EngineConfig.quantization): "none"; "int8", per-output-channel symmetric int8
weights, weight-only (the activations stay in the compute dtype and the scale is applied to the
dot's output); "fp8", e4m3 weights with dynamic per-token e4m3 activations where the chip has
fp8 matmuls (H100, H200, TPU7x), weight-only everywhere else; "int8-w8a8", int8 weights with
dynamic per-token int8 activations and an int8 x int8 -> int32 dot, only where the chip has
int8 matmuls (v4, v5e, v5p, v6e's MXU, by the chip table's int8 rate; the CPU). The math and
the model's layers are jaxserve/models/quant.py; docs/architecture.md, "Quantized weights",
says why the representation is ours and not qwix's.

A pre-quantized Hugging Face checkpoint (checkpoints/prequantized.py reads its
`quantization_config` into a `CheckpointQuant`) brings its own scheme:
`resolve_checkpoint_quantization` serves it as that scheme under "none", accepts the same name
(and "int8" for an int8 W8A8 checkpoint, run weight-only) and refuses any other.

Here without JAX (like jaxserve/target.py, beside which it sits), so that the command line can
list the names and validate them before anything is imported.
"""

from __future__ import annotations

import dataclasses

QUANTIZATIONS = ("none", "int8", "fp8", "int8-w8a8")
# `--kv-cache-dtype` (EngineConfig.kv_cache_dtype): the model's dtype, or 8-bit keys and values
# with per-(token, KV head) power-of-two scales (models/kv_pool.py; "Quantized KV cache").
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
WEIGHT_DTYPES = {"int8": "int8", "fp8": "float8_e4m3fn"}  # scheme weights -> numpy dtype name
# The largest magnitude of each 8-bit type: a column's max|w| maps there (the scale's divisor).
QMAX = {"int8": 127.0, "fp8": 448.0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantScheme:
    """How a model's decoder matmuls run, once resolved for a target. Hashable, so a flax
    module may hold it as a field (a static part of the step)."""

    weights: str  # "int8" | "fp8": the stored kernels' type (scales are float32)
    activations: str | None = None  # "int8" | "fp8": dynamic per-token; None: weight-only
    # The dense kernels stored [*features, in] (`kernel_t`), the contracting axis minor, as
    # GPUs' fp8 GEMM reads them: stored [in, *features] XLA:GPU transposes each one for it,
    # and under the scan hoists that copy of every layer (docs/architecture.md).
    transposed: bool = False
    # Block-scaled weights (a pre-quantized `quant_method: fp8` checkpoint's 128x128 blocks):
    # one scale per `block` rows of the contracting axis and per output column, `kernel_scale`
    # [ceil(in / block), *features]; weight-only on every chip. None: one scale a column.
    block: int | None = None

    def __post_init__(self):
        if self.weights not in WEIGHT_DTYPES:
            raise ValueError(f"QuantScheme weights={self.weights!r} must be int8 or fp8.")
        if self.activations not in (None, self.weights):
            raise ValueError(
                f"QuantScheme activations={self.activations!r} must be None (weight-only) or "
                f"{self.weights!r}, the weights' own type."
            )
        if self.block is not None and (self.activations or self.transposed or self.block < 1):
            raise ValueError(
                f"QuantScheme block={self.block!r} must be a positive row count of a weight-only, "
                f"untransposed scheme (activations={self.activations!r}, "
                f"transposed={self.transposed!r} here)."
            )

    @property
    def weight_dtype(self) -> str:
        """The numpy dtype name of the quantized kernels."""
        return WEIGHT_DTYPES[self.weights]

    @property
    def label(self) -> str:
        """How logs and `jaxserve compile` name it: 'int8 weight-only', 'fp8 W8A8', ..."""
        blocks = f" ({self.block}-row blocks)" if self.block else ""
        return f"{self.weights} {'W8A8' if self.activations else 'weight-only'}{blocks}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointQuant:
    """The scheme a pre-quantized Hugging Face checkpoint stores (its config.json's
    `quantization_config`, read by checkpoints/prequantized.py)."""

    method: str  # "fp8" | "compressed-tensors": the config's quant_method
    weights: str  # "int8" | "fp8": the stored weights' type
    activations: str | None  # "int8" | "fp8": dynamic per-token; None: weight-only
    block: int | None = None  # fp8's weight_block_size (square); None: one scale a channel
    detail: str = ""  # for messages: the format, the block size, ...

    @property
    def name(self) -> str:
        """The --quantization name of this scheme: 'int8', 'int8-w8a8' or 'fp8'."""
        if self.weights == "int8":
            return "int8-w8a8" if self.activations else "int8"
        return "fp8"

    @property
    def label(self) -> str:
        """How messages name it: "compressed-tensors int8 W8A8 (int-quantized)", "fp8 W8A8
        (128x128 blocks)"."""
        kind = "W8A8" if self.activations else "weight-only"
        weights = "" if self.method == self.weights else f" {self.weights}"
        return f"{self.method}{weights} {kind}" + (f" ({self.detail})" if self.detail else "")


def resolve_checkpoint_quantization(
    name: str, checkpoint: CheckpointQuant | None, where
) -> tuple[QuantScheme | None, str | None]:
    """`resolve_quantization` for a model whose checkpoint may be pre-quantized: (the scheme,
    a sentence to log at start or None). A float checkpoint (`checkpoint` None) resolves as
    `name` does. A pre-quantized one is served in its own scheme: under "none" (the default)
    or its own name; "int8" on an int8 W8A8 checkpoint runs its weights weight-only. The
    activations fall back as resolve_quantization's do (int8 W8A8 runs weight-only on a chip
    without int8 matmuls, fp8 W8A8 without fp8 matmuls), each said in the sentence; block
    scales (fp8's 128x128) run weight-only everywhere.

    Raises ValueError, naming both, for a name that asks another scheme than the checkpoint's
    (weights of another type cannot be made from 8-bit ones), and as resolve_quantization does
    for an explicit "int8-w8a8" on a chip without int8 matmuls."""
    if checkpoint is None:
        return resolve_quantization(name, where)
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization={name!r} must be one of {QUANTIZATIONS}.")
    own = checkpoint.name
    allowed = {"none", own} | ({"int8"} if own == "int8-w8a8" else set())
    if name not in allowed:
        raise ValueError(
            f"quantization={name!r} conflicts with the checkpoint, which is pre-quantized as "
            f"{checkpoint.label} (quantization={own!r}); pass quantization={own!r} or 'none' to "
            "serve it as it is, or load a float checkpoint to quantize it otherwise."
        )
    kind = where.device_kind if where.platform != "cpu" else "the CPU"
    said = f"The checkpoint is pre-quantized as {checkpoint.label}"
    if checkpoint.block is not None:
        scheme = QuantScheme(weights=checkpoint.weights, block=checkpoint.block)
        return scheme, (
            f"{said}: served as {scheme.label}, its block scales applied to the weight "
            "inside each dot (block-scaled activations are not implemented)."
        )
    if name == "int8" or checkpoint.activations is None:  # its weights, weight-only
        scheme = QuantScheme(weights=checkpoint.weights)
        return scheme, f"{said}: served as {scheme.label}."
    if own == "int8-w8a8" and not has_int8_matmuls(where):
        if name == own:  # an explicit request for a dot the chip lacks: refused as ever
            resolve_quantization(name, where)
        return QuantScheme(weights="int8"), (
            f"{said}: {kind} has no int8 matmuls, so it runs weight-only (int8 weights, "
            "activations unquantized)."
        )
    scheme, note = resolve_quantization(own, where)
    return scheme, f"{said}: served as {scheme.label}" + (f"; {note}" if note else ".")


def has_int8_matmuls(where) -> bool:
    """Whether the target's chip multiplies int8 by int8 natively: the CPU (XLA:CPU's integer
    dot; VNNI/AMX where the C++ kernel of cpu_matmul.cc will use them) and the TPUs whose chip
    row gives an int8 rate (pallas_kernels/chips.py). GPUs are not claimed: no int8 path of
    XLA:GPU has been compiled or measured here."""
    if where.platform == "cpu":
        return True
    chip = where.chip
    return where.platform == "tpu" and getattr(chip, "peak_int8_ops", None) is not None


def has_fp8_matmuls(where) -> bool:
    """Whether the target's chip multiplies fp8 by fp8 natively: the chip row gives an fp8
    rate (H100, H200, TPU7x)."""
    return where.platform != "cpu" and getattr(where.chip, "peak_fp8_flops", None) is not None


def resolve_quantization(name: str, where) -> tuple[QuantScheme | None, str | None]:
    """(the scheme for target `where` (a jaxserve.target.Target), a sentence to log at start
    where the scheme is not what the name asks on every chip, or None).

    Raises ValueError, naming the value and the target, for an unknown name and for int8-w8a8
    on a chip without int8 matmuls (an explicit request for a dot the chip does not have;
    `int8`, weight-only, serves there)."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization={name!r} must be one of {QUANTIZATIONS}.")
    kind = where.device_kind if where.platform != "cpu" else "the CPU"
    if name == "none":
        return None, None
    if name == "int8":
        return QuantScheme(weights="int8"), None
    if name == "int8-w8a8":
        if not has_int8_matmuls(where):
            raise ValueError(
                f"quantization='int8-w8a8' needs int8 matmuls, which {kind} does not have here "
                f"(v4, v5e, v5p, v6e and the CPU do); use quantization='int8' (weight-only) "
                "or 'fp8'."
            )
        return QuantScheme(weights="int8", activations="int8"), None
    if has_fp8_matmuls(where):
        return QuantScheme(
            weights="fp8", activations="fp8", transposed=where.platform == "gpu"
        ), None
    note = (
        f"quantization='fp8' runs weight-only on {kind}: it has no fp8 matmuls (H100, H200 "
        "and TPU7x do), so the e4m3 weights are widened to the compute dtype inside each dot "
        "and the activations stay unquantized."
    )
    return QuantScheme(weights="fp8"), note
