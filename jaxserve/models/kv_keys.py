"""How an 8-bit KV pool's keys are conditioned before they are quantized, exactly for attention.

An 8-bit pool keeps one power-of-two scale per (token, KV head) (kv_pool.py), so a head's
largest key channel decides every channel's step. Real models concentrate their keys: in
stories260k each 8-wide head carries one channel of its lowest-frequency rotary pair at
|k| ~ 15-28 beside channels of 1-5 (a mean of ~+-15, a spread of ~3 across tokens), and that
one channel costs int8 0.043 nats a token against the float pool (docs/benchmarks.md). Three
changes of the keys, each leaving every query's attention weights what they were:

- **Centre** (`center`, b: f32[L, Hkv, D]): the pool stores k - b. Each query's logits all move
  by the same q.b, and softmax does not see a shift common to a row, so the weights are
  unchanged. Not for soft-capped logits (Gemma 2's tanh is not shift-invariant): b is 0 there.
- **Smooth** (`scale`, s: f32[L, Hkv, D] > 0): the pool stores (k - b) / s and the query is
  multiplied by s channel by channel, so q.k is unchanged; s evens the channels' spreads.
- **Rotate** (int8 only): both go through the same orthonormal Hadamard matrix H (head_dim a
  power of two), q H . k H = q . k; H spreads what is left of an outlier over the head, where
  int8's one step per row spends it better. e4m3's error is relative to each element, so a
  rotation only mixes small channels with large ones there (measured worse: not applied).

b and s come from the model's own keys over a short calibration text at start-up
(runtime/key_calibration.py). Since any b and s are exact, calibration decides only how small
the quantization error is, never whether attention is right; a weight update keeps them.
Measured through the engine on stories260k over a text it was not calibrated on: int8 0.043
-> 0.013 nats a token, e4m3 0.097 -> 0.067 (docs/benchmarks.md, "Quantized KV cache").

The transform is part of the compiled step as constants (a `KeyTransform` is hashable and
static), applied by `models/llama.Attention` after RoPE and before the pool write, so every
attention path (XLA, Pallas TPU, Triton, Mosaic GPU) reads keys and queries already changed.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

# How far s evens the channels' spreads: s = spread^alpha (normalised), per pool dtype; chosen in
# simulation on stories260k (docs/history/kv_keys_sim.py: int8 alpha 1 with the rotation, 0.012
# nats; e4m3 0.5 without, 0.063).
SMOOTHING = {"int8": 1.0, "float8_e4m3fn": 0.5}


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix f32[n, n] (n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"A Sylvester Hadamard matrix needs a power-of-two size; got {n}.")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def rotates(kv_dtype, head_dim: int) -> bool:
    """Whether a pool of `kv_dtype` rotates its keys (int8, head_dim a power of two)."""
    return jnp.dtype(kv_dtype) == jnp.int8 and head_dim >= 2 and not head_dim & (head_dim - 1)


@dataclasses.dataclass(frozen=True, eq=False)
class KeyTransform:
    """The keys' centre and smoothing per (layer, KV head, channel) and whether they rotate.

    Hashable by value (a module attribute of the compiled step). `center` is all zeros for a
    soft-capped model, `scale` all ones where nothing was calibrated (`identity`)."""

    center: np.ndarray  # f32[num_layers, num_kv_heads, head_dim]
    scale: np.ndarray  # f32[num_layers, num_kv_heads, head_dim], > 0
    rotate: bool

    def __post_init__(self):
        center = np.asarray(self.center, np.float32)
        scale = np.asarray(self.scale, np.float32)
        if center.ndim != 3 or scale.shape != center.shape:
            raise ValueError(
                f"A KeyTransform needs center and scale of one shape [layers, kv_heads, "
                f"head_dim]; got {center.shape} and {scale.shape}."
            )
        if not (np.all(np.isfinite(center)) and np.all(scale > 0) and np.all(np.isfinite(scale))):
            raise ValueError("A KeyTransform needs a finite center and a finite, positive scale.")
        object.__setattr__(self, "center", center)
        object.__setattr__(self, "scale", scale)

    def _key(self) -> tuple:
        digest = hashlib.sha256(self.center.tobytes() + self.scale.tobytes()).hexdigest()
        return self.center.shape, self.rotate, digest

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other) -> bool:
        return isinstance(other, KeyTransform) and self._key() == other._key()

    @classmethod
    def identity(cls, num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype) -> KeyTransform:
        """No centre, no smoothing, the pool's rotation: the shape of the calibrated transform
        (what `jaxserve compile` builds, where there are no weights to calibrate on)."""
        shape = (num_layers, num_kv_heads, head_dim)
        return cls(
            np.zeros(shape, np.float32), np.ones(shape, np.float32), rotates(kv_dtype, head_dim)
        )

    @classmethod
    def from_keys(cls, keys: np.ndarray, kv_dtype, soft_capped: bool) -> KeyTransform:
        """Calibrated on `keys` f32[L, T, Hkv, D] (after RoPE, T >= 2 tokens of some text):
        b the mean over tokens (0 when `soft_capped`), s the spread about it raised to
        SMOOTHING's power and normalised to a geometric mean of 1 over each head's channels,
        both snapped to a grid (s to sixteenths of a power of two)."""
        keys = np.asarray(keys, np.float64)
        if keys.ndim != 4 or keys.shape[1] < 2:
            raise ValueError(
                f"Calibration needs keys [layers, tokens >= 2, heads, dim]; got {keys.shape}."
            )
        dtype = jnp.dtype(kv_dtype)
        center = np.zeros_like(keys[:, 0]) if soft_capped else keys.mean(axis=1)
        spread = np.sqrt(((keys - center[:, None]) ** 2).mean(axis=1))
        # A channel that never moves would get s = 0: floor it at a thousandth of its head's.
        spread = np.maximum(spread, 1e-3 * spread.max(axis=-1, keepdims=True) + 1e-12)
        s = spread ** SMOOTHING.get(dtype.name, 1.0)
        s = s / np.exp(np.log(s).mean(axis=-1, keepdims=True))
        # Snapped to a coarse grid: a mesh that computes the keys in another order differs in
        # their last bits, and the transforms (hence the 8-bit roundings) should not. s to a
        # sixteenth of a power of two, b to 1/256 of the head's typical spread.
        s = np.exp2(np.round(16 * np.log2(s)) / 16)
        step = np.exp2(np.round(np.log2(np.median(spread, axis=-1, keepdims=True))) - 8)
        center = np.round(center / step) * step
        return cls(center.astype(np.float32), s.astype(np.float32), rotates(dtype, keys.shape[-1]))

    def apply(
        self,
        q: jax.Array,  # [T, num_heads, D] after RoPE; q head j * g + i reads KV head j
        k: jax.Array,  # [T, num_kv_heads, D] after RoPE
        layer,  # i32[] or int: the decoder layer
    ) -> tuple[jax.Array, jax.Array]:
        """(q s H, (k - b) / s H) of `layer`, in q's and k's dtypes: q . k is unchanged up to
        rounding, and each query's logits move by one constant (q . b)."""
        t, heads, d = q.shape
        kv_heads = k.shape[1]
        b = jnp.asarray(self.center)[layer]  # [Hkv, D]
        s = jnp.asarray(self.scale)[layer]
        # A product by 1 / s made here, not a quotient XLA may turn into one differently on a
        # split mesh: every program rounds each key the same way (the 8-bit roundings follow).
        inv = jnp.asarray((1.0 / self.scale).astype(np.float32))[layer]
        k32 = (k.astype(jnp.float32) - b) * inv
        q32 = q.astype(jnp.float32).reshape(t, kv_heads, heads // kv_heads, d) * s[:, None]
        if self.rotate:
            h = jnp.asarray(hadamard(d))
            hi = jax.lax.Precision.HIGHEST
            k32 = jnp.einsum("thd,de->the", k32, h, precision=hi)
            q32 = jnp.einsum("thgd,de->thge", q32, h, precision=hi)
        return q32.reshape(q.shape).astype(q.dtype), k32.astype(k.dtype)
