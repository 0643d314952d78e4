"""A measured model of what one engine step costs, so latency can be planned and simulated.

Every step runs one token bucket (model_runner.bucket_ladder), so within a bucket the matmul
shapes are fixed and the time varies with the work the attention does. Per token bucket we fit,
by least squares over measured steps,

    seconds = fixed + per_token * tokens + per_pair * attended

where `tokens` are the step's real tokens and `attended` the (query token, cached token) pairs
its attention reads: a decode at context c attends c, a prefill chunk of n tokens after s cached
ones n * s + n * (n + 1) / 2. Steps are timed as the engine loop sees them (host work included),
which is what a request waits for. The fit is one least-squares problem: each bucket has its own
intercept (its matmuls run the padded shape) and, with 30 steps or more, its own per-token slope
(fewer: one shared by such buckets); the per-pair slope is one for all buckets, since an attended
pair costs the same attention in any. (Per-bucket pair slopes, fitted to a few dozen noisy steps
at the calibration's contexts, predicted at the longer contexts of a static batch's tail a
32-row decode 20-40% slower than a 64-row one.) Buckets never measured interpolate the
intercepts of their neighbours.

What the features still miss in serving (the machine's pace between calibration and serving, a
mix of steps calibration did not run) is one factor, `serving_scale`, measured on served steps
(the function `serving_scale`: their measured over calibrated total) and saved with the model;
`predict` includes it, so the SLO policy, the simulator and the next start plan served steps.

A model is saved as JSON keyed by model, dtype, device kind and token buckets (`CostKey`), so a
file measured on one machine is never silently applied to another. Pure Python and numpy: the
scheduler's SLO policy and the simulator use it without JAX.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

FEATURES = ("fixed", "tokens", "attended")
# A step this many times slower than predicted was not the step's doing (a compile, a swap):
# refit without it. Milder slowdowns (a busy neighbour) stay in: serving meets them too.
_OUTLIER_FACTOR = 4.0
MIN_SAMPLES_OWN_FIT = 30  # fewer steps in a bucket: the per-token slope shared by such buckets


class CostModelError(ValueError):
    """A cost model file that cannot be read, or one measured for something else."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostKey:
    """What a cost model was measured for: it applies to nothing else."""

    model: str
    dtype: str
    device_kind: str
    token_buckets: tuple[int, ...]

    def mismatch(self, other: CostKey) -> str | None:
        """A sentence naming the first field that differs (buckets: `other` needs ours), or None."""
        for name in ("model", "dtype", "device_kind"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"the cost model was measured for {name}={mine!r}, not {theirs!r}."
        missing = sorted(set(other.token_buckets) - set(self.token_buckets))
        if missing:
            return (
                f"the cost model has no token buckets {missing} (it measured "
                f"{list(self.token_buckets)})."
            )
        return None


@dataclasses.dataclass(frozen=True)
class StepSample:
    """One measured step."""

    tokens: int  # real tokens run
    attended: int  # (query, key) pairs the attention read
    seconds: float


def attended_pairs(spans: Iterable[tuple[int, int]]) -> int:
    """Pairs attended by chunks of (start_pos, num_tokens): causal, each token sees itself."""
    return sum(n * s + n * (n + 1) // 2 for s, n in spans)


def plan_features(plan) -> tuple[int, int]:
    """(tokens, attended) of a SchedulerOutput."""
    return plan.num_batched_tokens, attended_pairs(
        (s.start_pos, len(s.token_ids)) for s in plan.seqs
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketFit:
    """The fitted line of one token bucket."""

    bucket: int
    coef: tuple[float, float, float]  # seconds: fixed, per token, per attended pair
    samples: int  # steps measured in this bucket (0: interpolated)
    shared_slopes: bool  # too few samples for slopes of its own
    rel_rms: float | None  # relative RMS error over its samples; None without samples

    def predict(self, tokens: int, attended: int) -> float:
        fixed, per_token, per_pair = self.coef
        return fixed + per_token * tokens + per_pair * attended


class CostModel:
    """Predicts the seconds of a step from its tokens and attended pairs."""

    def __init__(
        self,
        key: CostKey,
        fits: Sequence[BucketFit],
        *,
        fit_error: dict | None = None,
        serving: dict | None = None,
    ):
        if not fits:
            raise CostModelError("A cost model needs at least one fitted bucket.")
        # {"scale": measured over predicted of served steps, "steps": how many}; none: 1.
        self.serving = dict(serving or {})
        scale = self.serving.get("scale", 1.0)
        if not (isinstance(scale, int | float) and 0.1 <= scale <= 10):
            raise CostModelError(f"The serving scale {scale!r} must be a number in [0.1, 10].")
        self.serving_scale = float(scale)
        self.key = key
        self.fits = {f.bucket: f for f in sorted(fits, key=lambda f: f.bucket)}
        self._buckets = list(self.fits)
        self.fit_error = fit_error or {}

    def fit_for(self, tokens: int) -> BucketFit:
        """The fit of the bucket a step of `tokens` pads to (the largest beyond the ladder)."""
        i = bisect.bisect_left(self._buckets, tokens)
        return self.fits[self._buckets[min(i, len(self._buckets) - 1)]]

    def predict(self, tokens: int, attended: int) -> float:
        """Seconds of one served step: the fit times `serving_scale`; never below a
        microsecond (a line may dip near zero)."""
        return self.serving_scale * self.predict_calibrated(tokens, attended)

    def predict_calibrated(self, tokens: int, attended: int) -> float:
        """Seconds of one step as calibration measured it (no serving scale)."""
        return max(1e-6, self.fit_for(tokens).predict(tokens, attended))

    def with_serving_scale(self, scale: float, steps: int) -> CostModel:
        """This model with `scale` (served over calibrated step time, from `steps` steps)."""
        return CostModel(
            self.key,
            list(self.fits.values()),
            fit_error=self.fit_error,
            serving={"scale": scale, "steps": steps},
        )

    def predict_plan(self, plan) -> float:
        """Seconds of a SchedulerOutput's step (0 for an empty plan: nothing runs)."""
        if not plan.seqs:
            return 0.0
        return self.predict(*plan_features(plan))

    def to_json(self) -> dict:
        return {
            "jaxserve_cost_model": 1,
            "key": {**dataclasses.asdict(self.key), "token_buckets": list(self.key.token_buckets)},
            "features": list(FEATURES),
            "fit_error": self.fit_error,
            "serving": self.serving,
            "buckets": [
                {**dataclasses.asdict(f), "coef": list(f.coef)} for f in self.fits.values()
            ],
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def from_json(cls, obj: dict) -> CostModel:
        try:
            k = obj["key"]
            key = CostKey(
                model=str(k["model"]),
                dtype=str(k["dtype"]),
                device_kind=str(k["device_kind"]),
                token_buckets=tuple(int(b) for b in k["token_buckets"]),
            )
            fits = [
                BucketFit(
                    bucket=int(b["bucket"]),
                    coef=tuple(float(c) for c in b["coef"]),
                    samples=int(b["samples"]),
                    shared_slopes=bool(b["shared_slopes"]),
                    rel_rms=None if b["rel_rms"] is None else float(b["rel_rms"]),
                )
                for b in obj["buckets"]
            ]
        except (KeyError, TypeError, ValueError) as e:
            raise CostModelError(f"Not a jaxserve cost model: missing or bad field {e}.") from None
        serving = obj.get("serving")  # files before the serving scale: none
        return cls(key, fits, fit_error=obj.get("fit_error") or {}, serving=serving)

    @classmethod
    def load(cls, path: str | Path, expect: CostKey | None = None) -> CostModel:
        """Reads a saved model; with `expect`, refuses one measured for something else."""
        path = Path(path)
        try:
            obj = json.loads(path.read_text())
        except OSError as e:
            raise CostModelError(f"Cannot read cost model {str(path)!r}: {e.strerror}.") from None
        except json.JSONDecodeError as e:
            raise CostModelError(f"Cost model {str(path)!r} is not JSON: {e}.") from None
        if not isinstance(obj, dict):
            raise CostModelError(f"Cost model {str(path)!r} is not a JSON object.")
        model = cls.from_json(obj)
        if expect is not None and (why := model.key.mismatch(expect)):
            raise CostModelError(f"Cost model {str(path)!r} does not apply: {why}")
        return model

    def describe(self) -> str:
        """One line per bucket: the fitted terms and the fit's error."""
        lines = [
            f"cost model of {self.key.model} ({self.key.dtype}, {self.key.device_kind}): "
            f"relative RMS error {_pct(self.fit_error.get('rel_rms'))} over "
            f"{self.fit_error.get('samples', 0)} steps; served steps x{self.serving_scale:.2f} "
            f"(over {self.serving.get('steps', 0)})",
            "| bucket | steps | fixed ms | us/token | ns/attended pair | rel RMS |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for f in self.fits.values():
            fixed, per_token, per_pair = f.coef
            shared = " (shared slopes)" if f.shared_slopes and f.samples else ""
            lines.append(
                f"| {f.bucket} | {f.samples}{shared} | {fixed * 1e3:.2f} | {per_token * 1e6:.2f} | "
                f"{per_pair * 1e9:.3f} | {_pct(f.rel_rms)} |"
            )
        return "\n".join(lines)


def serving_scale(model: CostModel, samples: Sequence[StepSample]) -> float | None:
    """Measured over calibrated time of served steps, in total (long steps weigh most, as in a
    request's latency); steps `_OUTLIER_FACTOR` times slower than predicted are left out, as in
    the fit. None without steps."""
    predicted = [model.predict_calibrated(s.tokens, s.attended) for s in samples]
    kept = [
        (s.seconds, p) for s, p in zip(samples, predicted, strict=True)
        if s.seconds <= _OUTLIER_FACTOR * p * model.serving_scale
    ]  # fmt: skip
    if not kept:
        return None
    return sum(m for m, _ in kept) / sum(p for _, p in kept)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def fit(samples: Sequence[StepSample], key: CostKey) -> CostModel:
    """Fits one line per token bucket of `key` to measured steps (see the module docstring)."""
    buckets = list(key.token_buckets)
    if not samples:
        raise CostModelError("Cannot fit a cost model without measured steps.")
    kept = list(samples)
    for _ in range(4):  # fit, drop the steps something else slowed down, fit again
        model = _fit_once(kept, buckets, key)
        pred = [model.predict(s.tokens, s.attended) for s in kept]
        survivors = [s for s, p in zip(kept, pred, strict=True) if s.seconds <= _OUTLIER_FACTOR * p]
        if len(survivors) == len(kept) or len(survivors) < len(kept) // 2:
            break
        kept = survivors
    return _with_errors(model, samples, kept)


def _fit_once(samples: Sequence[StepSample], buckets: list[int], key: CostKey) -> CostModel:
    by_bucket: dict[int, list[StepSample]] = {b: [] for b in buckets}
    for s in samples:
        i = min(bisect.bisect_left(buckets, s.tokens), len(buckets) - 1)
        by_bucket[buckets[i]].append(s)
    measured = [b for b in buckets if by_bucket[b]]
    # One least-squares fit for all buckets: each measured bucket has its own intercept (its
    # matmuls run the padded shape) and, with the steps to tell, its own per-token slope (within
    # a bucket tokens range over a factor of 2 at most); the others share one. The per-pair
    # slope is one for all: an attended pair costs the same attention in any bucket, while
    # per-bucket pair slopes from a few dozen noisy steps, extrapolated to the longer contexts a
    # run reaches, predicted a 32-row decode slower than a 64-row one (docs/bench-slo).
    own = [
        b for b in measured if len(by_bucket[b]) >= MIN_SAMPLES_OWN_FIT and _varies(by_bucket[b])
    ]
    token_col = {b: len(measured) + k for k, b in enumerate(own)}
    shared_token = len(measured) + len(own)
    pair = shared_token + 1
    rows = np.zeros((len(samples), pair + 1), np.float64)  # f64[n, columns]
    times = np.zeros(len(samples), np.float64)  # f64[n]
    r = 0
    for j, b in enumerate(measured):
        for s in by_bucket[b]:
            rows[r, j] = 1.0
            rows[r, token_col.get(b, shared_token)] = s.tokens
            rows[r, pair], times[r] = s.attended, s.seconds
            r += 1
    coef = _nonneg_lstsq(rows, times)
    per_pair = float(coef[pair])
    fixed = {b: float(coef[j]) for j, b in enumerate(measured)}
    fits = [
        BucketFit(
            bucket=b,
            coef=(fixed[b], float(coef[token_col.get(b, shared_token)]), per_pair),
            samples=len(by_bucket[b]),
            shared_slopes=b not in token_col,
            rel_rms=None,
        )
        for b in measured
    ]
    for b in buckets:
        if b not in fixed:  # never measured: between its neighbours' intercepts
            between = float(np.interp(b, measured, [fixed[m] for m in measured]))
            fits.append(BucketFit(bucket=b, coef=(between, float(coef[shared_token]), per_pair),
                                  samples=0, shared_slopes=True, rel_rms=None))  # fmt: skip
    return CostModel(key, fits)


def _varies(pts: Sequence[StepSample]) -> bool:
    """Whether the tokens take more than one value: else their slope is not identifiable."""
    return len({s.tokens for s in pts}) > 1


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (an active set, one column out at a time).

    A step never gets cheaper with more work, nor costs less than nothing; a negative term is
    noise that would make the SLO policy pile on tokens or the simulator run steps for free.
    """
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1], np.float64)  # f64[columns]
        # Relative scaling keeps the tiny per-pair column from being lost to rounding.
        scale = np.maximum(np.abs(x[:, active]).max(axis=0), 1e-30)
        sol, *_ = np.linalg.lstsq(x[:, active] / scale, y, rcond=None)
        coef[active] = sol / scale
        worst = min(active, key=lambda c: coef[c])
        if coef[worst] >= 0 or len(active) == 1:
            return np.maximum(coef, 0.0)
        active.remove(worst)


def _with_errors(
    model: CostModel, samples: Sequence[StepSample], kept: Sequence[StepSample]
) -> CostModel:
    """The model with each bucket's and the overall relative error filled in."""
    per: dict[int, list[float]] = {}
    for s in kept:
        f = model.fit_for(s.tokens)
        per.setdefault(f.bucket, []).append(
            (model.predict(s.tokens, s.attended) - s.seconds) / s.seconds
        )
    fits = [
        dataclasses.replace(f, rel_rms=_rms(per[f.bucket]) if f.bucket in per else None)
        for f in model.fits.values()
    ]
    errs = [e for v in per.values() for e in v]
    fit_error = {
        "samples": len(samples),
        "outliers_dropped": len(samples) - len(kept),
        "rel_rms": _rms(errs),
        "median_abs_rel": float(np.median(np.abs(errs))) if errs else None,
    }
    return CostModel(model.key, fits, fit_error=fit_error, serving=model.serving)


def _rms(xs: Sequence[float]) -> float | None:
    return math.sqrt(sum(x * x for x in xs) / len(xs)) if xs else None
