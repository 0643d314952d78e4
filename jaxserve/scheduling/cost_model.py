"""A measured model of what one engine step costs, so latency can be planned and simulated.

Every step runs one token bucket (model_runner.bucket_ladder), so within a bucket the matmul
shapes are fixed and the time varies with the work the attention does. Per token bucket we fit,
by least squares over measured steps, a line in the step's work (`StepWork`). Which work depends
on the attention that runs (`FEATURE_SETS`):

- "tiles", the CPU's attention (pallas_kernels/ragged_paged_attention/xla_blocked.py):
  `seconds = fixed + per_token * tokens + per_decode_key * decode_keys + per_block * blocks`.
  Its decode loop runs every sequence slot of the bucket through key blocks up to the longest
  decoding context, so a decode step costs by that context (`decode_keys`), not by the sum of
  the rows' contexts; its prefill runs (query tile, key block) pairs (`prefill_blocks`).
- "pairs", any other attention (the Pallas kernels): `fixed + per_token * tokens + per_pair *
  attended`, where a decode at context c attends c and a prefill chunk of n tokens after s
  cached ones n * s + n * (n + 1) / 2.

Measured on `tiny` (2026-12-01, one process, docs/benchmarks.md): calibrated by attended pairs,
served steps ran 1.41-1.57x the prediction, 64-row decode steps 2.1-2.5x (their rows' contexts
spread from 16 to 700, and every slot runs to the longest); by the kernel's work, 1.01-1.08x.

Steps are timed as the engine loop sees them (host work included), which is what a request waits
for. The fit is one least-squares problem: each bucket has its own intercept (its matmuls run the
padded shape) and, with 30 steps or more, its own per-token and per-decode-key slopes (fewer
steps, as at warm-up: one slope shared by such buckets, per sequence slot for a decode key,
which every slot of the bucket runs); the per-pair and per-block slopes are one for all buckets,
since an attended pair or a prefill block costs the same in any. (Per-bucket pair slopes,
fitted to a few dozen noisy steps at the calibration's contexts, predicted at the longer
contexts of a static batch's tail a 32-row decode 20-40% slower than a 64-row one.) Buckets
never measured interpolate the intercepts of their neighbours.

What the features still miss in serving (the machine's pace between calibration and serving)
is one factor, `serving_scale`, measured on served steps (the function `serving_scale`: their
measured over calibrated total) and saved with the model; `predict` includes it, so the SLO
policy, the simulator and the next start plan served steps.

A model is saved as JSON keyed by model, dtype, device kind and token buckets (`CostKey`), so a
file measured on one machine is never silently applied to another. Pure Python and numpy: the
scheduler's SLO policy and the simulator use it without JAX.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

# The terms of each feature set's line, the intercept first (module docstring). A bucket has its
# own slope for the terms in PER_BUCKET when it has the steps to tell; the others are shared.
FEATURE_SETS = {
    "pairs": ("fixed", "tokens", "attended"),
    "tiles": ("fixed", "tokens", "decode_keys", "prefill_blocks"),
}
PER_BUCKET = frozenset({"tokens", "decode_keys"})
# Per-bucket terms whose work is done once per sequence slot of the bucket: where buckets share
# the slope (too few steps of their own, as at warm-up), it is shared per slot, so a one-slot
# decode key is not priced as a 64-slot one.
PER_SLOT = frozenset({"decode_keys"})
# The CPU attention's loop sizes (xla_blocked: _DECODE_KEYS, _DECODE_KEYS_ONE_SEQ, _TILE_ROWS,
# _TILE_KEYS), here without JAX; tests/kernels/test_xla_blocked.py checks they agree.
DECODE_KEYS, DECODE_KEYS_ONE_SEQ, TILE_ROWS, TILE_KEYS = 32, 128, 64, 128
# A step this many times slower than predicted was not the step's doing (a compile, a swap):
# refit without it. Milder slowdowns (a busy neighbour) stay in: serving meets them too.
_OUTLIER_FACTOR = 4.0
MIN_SAMPLES_OWN_FIT = 30  # fewer steps in a bucket: its PER_BUCKET slopes shared with such buckets


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


class StepWork(NamedTuple):
    """What one step computes, in every feature set's terms (a model reads its own)."""

    tokens: int  # real tokens run
    attended: int  # (query, key) pairs the attention reads
    # Keys the decode loop runs every slot through: the longest decoding context, rounded up to
    # the loop's key block (0: no decode in the step).
    decode_keys: int = 0
    prefill_blocks: int = 0  # (query tile, key block) trips of the prefill loop


@dataclasses.dataclass(frozen=True)
class StepSample:
    """One measured step."""

    work: StepWork
    seconds: float


def decode_keys(longest: int, tokens: int) -> int:
    """Keys the CPU attention's decode loop runs to in a step of `tokens` tokens whose longest
    decoding context is `longest`: whole key blocks (larger ones for a one-slot step)."""
    block = DECODE_KEYS_ONE_SEQ if tokens == 1 else DECODE_KEYS
    return -(-longest // block) * block


def prefill_blocks(start: int, n: int) -> int:
    """(query tile, key block) trips of a prefill chunk of `n` > 1 tokens after `start` cached
    ones: each tile of TILE_ROWS queries reads the key blocks up to its last query's."""
    return sum(
        (start + min(first + TILE_ROWS, n) - 1) // TILE_KEYS + 1 for first in range(0, n, TILE_ROWS)
    )


def work_of(spans: Iterable[tuple[int, int]]) -> StepWork:
    """The work of a step running chunks of (start_pos, num_tokens): one token is a decode (the
    attention's rule), more a prefill chunk."""
    tokens = attended = longest = blocks = 0
    for s, n in spans:
        tokens += n
        attended += n * s + n * (n + 1) // 2
        if n == 1:
            longest = max(longest, s + 1)
        else:
            blocks += prefill_blocks(s, n)
    return StepWork(tokens, attended, decode_keys(longest, tokens), blocks)


def decode_work(rows: int, attended: int, longest: int) -> StepWork:
    """The work of a decode-only step of `rows` rows attending `attended` keys in all, the
    longest `longest`."""
    return StepWork(rows, attended, decode_keys(longest, rows), 0)


def plan_features(plan) -> StepWork:
    """The work of a SchedulerOutput's step."""
    return work_of((s.start_pos, len(s.token_ids)) for s in plan.seqs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketFit:
    """The fitted line of one token bucket."""

    bucket: int
    coef: tuple[float, ...]  # seconds: the intercept, then per unit of each term of the set
    samples: int  # steps measured in this bucket (0: interpolated)
    shared_slopes: bool  # too few samples for slopes of its own
    rel_rms: float | None  # relative RMS error over its samples; None without samples


class CostModel:
    """Predicts the seconds of a step from its work (StepWork), by one feature set's line."""

    def __init__(
        self,
        key: CostKey,
        fits: Sequence[BucketFit],
        *,
        features: str = "pairs",
        fit_error: dict | None = None,
        serving: dict | None = None,
        slots: Mapping[int, int] | None = None,
    ):
        if not fits:
            raise CostModelError("A cost model needs at least one fitted bucket.")
        if features not in FEATURE_SETS:
            raise CostModelError(
                f"Unknown cost model features {features!r}; known: {sorted(FEATURE_SETS)}."
            )
        terms = FEATURE_SETS[features]
        for f in fits:
            if len(f.coef) != len(terms):
                raise CostModelError(
                    f"Bucket {f.bucket} has {len(f.coef)} coefficients; the {features!r} "
                    f"features need {len(terms)} ({', '.join(terms)})."
                )
        self.features = features
        # Sequence slots per bucket, as fitted (fit's `slots`), for a refit in the same terms.
        self.slots = {int(b): int(n) for b, n in (slots or {}).items()}
        self._fields = [StepWork._fields.index(t) for t in terms[1:]]  # the slopes' StepWork fields
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

    def predict(self, work: StepWork) -> float:
        """Seconds of one served step: the fit times `serving_scale`; never below a
        microsecond (a line may dip near zero)."""
        return self.serving_scale * self.predict_calibrated(work)

    def predict_calibrated(self, work: StepWork) -> float:
        """Seconds of one step as calibration measured it (no serving scale)."""
        coef = self.fit_for(work.tokens).coef
        seconds = coef[0]
        for c, field in zip(coef[1:], self._fields, strict=True):
            seconds += c * work[field]
        return max(1e-6, seconds)

    def with_serving_scale(self, scale: float, steps: int) -> CostModel:
        """This model with `scale` (served over calibrated step time, from `steps` steps)."""
        return CostModel(
            self.key,
            list(self.fits.values()),
            features=self.features,
            fit_error=self.fit_error,
            serving={"scale": scale, "steps": steps},
            slots=self.slots,
        )

    def predict_plan(self, plan) -> float:
        """Seconds of a SchedulerOutput's step (0 for an empty plan: nothing runs)."""
        if not plan.seqs:
            return 0.0
        return self.predict(plan_features(plan))

    def to_json(self) -> dict:
        return {
            "jaxserve_cost_model": 1,
            "key": {**dataclasses.asdict(self.key), "token_buckets": list(self.key.token_buckets)},
            "features": list(FEATURE_SETS[self.features]),
            "fit_error": self.fit_error,
            "serving": self.serving,
            "slots": {str(b): n for b, n in self.slots.items()},
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
            # Files before the tiles features: none (then each bucket is its own slot count).
            slots = {int(b): int(n) for b, n in (obj.get("slots") or {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CostModelError(f"Not a jaxserve cost model: missing or bad field {e}.") from None
        serving = obj.get("serving")  # files before the serving scale: none
        terms = tuple(obj.get("features") or FEATURE_SETS["pairs"])
        features = next((name for name, t in FEATURE_SETS.items() if t == terms), None)
        if features is None:
            raise CostModelError(f"Not a jaxserve cost model: unknown features {list(terms)}.")
        return cls(
            key,
            fits,
            features=features,
            fit_error=obj.get("fit_error") or {},
            serving=serving,
            slots=slots,
        )

    @classmethod
    def load(
        cls, path: str | Path, expect: CostKey | None = None, features: str | None = None
    ) -> CostModel:
        """Reads a saved model; with `expect`, refuses one measured for something else, and with
        `features`, one that prices steps in other terms (another attention's)."""
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
        if features is not None and model.features != features:
            raise CostModelError(
                f"Cost model {str(path)!r} does not apply: it prices steps by "
                f"{model.features!r} features, and this engine's attention by {features!r}."
            )
        return model

    def describe(self) -> str:
        """One line per bucket: the fitted terms and the fit's error."""
        terms = FEATURE_SETS[self.features][1:]
        lines = [
            f"cost model of {self.key.model} ({self.key.dtype}, {self.key.device_kind}; "
            f"{self.features}): relative RMS error {_pct(self.fit_error.get('rel_rms'))} over "
            f"{self.fit_error.get('samples', 0)} steps; served steps x{self.serving_scale:.2f} "
            f"(over {self.serving.get('steps', 0)})",
            "| bucket | steps | fixed ms | "
            + " | ".join(_UNITS[t][0] for t in terms)
            + " | rel RMS |",
            "|---:|---:|---:|" + "---:|" * len(terms) + "---:|",
        ]
        for f in self.fits.values():
            shared = " (shared slopes)" if f.shared_slopes and f.samples else ""
            slopes = " | ".join(
                f"{c * _UNITS[t][1]:.3f}" for c, t in zip(f.coef[1:], terms, strict=True)
            )
            lines.append(
                f"| {f.bucket} | {f.samples}{shared} | {f.coef[0] * 1e3:.2f} | {slopes} | "
                f"{_pct(f.rel_rms)} |"
            )
        return "\n".join(lines)


# Each term's column header in `describe` and the factor from seconds to its unit.
_UNITS = {
    "tokens": ("us/token", 1e6),
    "attended": ("ns/attended pair", 1e9),
    "decode_keys": ("us/decode key", 1e6),
    "prefill_blocks": ("us/prefill block", 1e6),
}


def serving_scale(model: CostModel, samples: Sequence[StepSample]) -> float | None:
    """Measured over calibrated time of served steps, in total (long steps weigh most, as in a
    request's latency); steps `_OUTLIER_FACTOR` times slower than predicted are left out, as in
    the fit. None without steps."""
    predicted = [model.predict_calibrated(s.work) for s in samples]
    kept = [
        (s.seconds, p) for s, p in zip(samples, predicted, strict=True)
        if s.seconds <= _OUTLIER_FACTOR * p * model.serving_scale
    ]  # fmt: skip
    if not kept:
        return None
    return sum(m for m, _ in kept) / sum(p for _, p in kept)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def fit(
    samples: Sequence[StepSample],
    key: CostKey,
    features: str = "pairs",
    slots: Mapping[int, int] | None = None,
) -> CostModel:
    """Fits one line per token bucket of `key` to measured steps, in the terms of `features`
    (a FEATURE_SETS name; see the module docstring). `slots`: each bucket's sequence slots (the
    runner's seq_bucket_for); default the bucket's size."""
    buckets = list(key.token_buckets)
    slots = {b: int(slots[b]) if slots and b in slots else b for b in buckets}
    if not samples:
        raise CostModelError("Cannot fit a cost model without measured steps.")
    if features not in FEATURE_SETS:
        raise CostModelError(
            f"Unknown cost model features {features!r}; known: {sorted(FEATURE_SETS)}."
        )
    kept = list(samples)
    for _ in range(4):  # fit, drop the steps something else slowed down, fit again
        model = _fit_once(kept, buckets, key, features, slots)
        pred = [model.predict(s.work) for s in kept]
        survivors = [s for s, p in zip(kept, pred, strict=True) if s.seconds <= _OUTLIER_FACTOR * p]
        if len(survivors) == len(kept) or len(survivors) < len(kept) // 2:
            break
        kept = survivors
    return _with_errors(model, samples, kept)


def _fit_once(
    samples: Sequence[StepSample],
    buckets: list[int],
    key: CostKey,
    features: str,
    slots: dict[int, int],
) -> CostModel:
    by_bucket: dict[int, list[StepSample]] = {b: [] for b in buckets}
    for s in samples:
        i = min(bisect.bisect_left(buckets, s.work.tokens), len(buckets) - 1)
        by_bucket[buckets[i]].append(s)
    measured = [b for b in buckets if by_bucket[b]]
    # One least-squares fit for all buckets (module docstring): a column per measured bucket's
    # intercept; per term of PER_BUCKET a column per bucket with the steps to tell its slope
    # (within a bucket tokens range over a factor of 2 at most) and one shared by the others
    # (per slot, for PER_SLOT terms); one column per other term, for all buckets.
    terms = FEATURE_SETS[features][1:]
    fields = [StepWork._fields.index(t) for t in terms]
    columns: dict[tuple[str, int | None], int] = {("fixed", b): j for j, b in enumerate(measured)}
    for t, field in zip(terms, fields, strict=True):
        if t in PER_BUCKET:
            for b in measured:
                if len(by_bucket[b]) >= MIN_SAMPLES_OWN_FIT and _varies(by_bucket[b], field):
                    columns[t, b] = len(columns)
        columns[t, None] = len(columns)  # shared

    def column(t: str, b: int) -> int:
        return columns.get((t, b), columns[t, None])

    def per_unit(t: str, b: int) -> int:
        """How many of the column's units one unit of term `t` is in bucket `b`."""
        return slots[b] if t in PER_SLOT and (t, b) not in columns else 1

    rows = np.zeros((len(samples), len(columns)), np.float64)  # f64[n, columns]
    times = np.zeros(len(samples), np.float64)  # f64[n]
    r = 0
    for b in measured:
        for s in by_bucket[b]:
            rows[r, columns["fixed", b]] = 1.0
            for t, field in zip(terms, fields, strict=True):
                rows[r, column(t, b)] = s.work[field] * per_unit(t, b)
            times[r] = s.seconds
            r += 1
    coef = _nonneg_lstsq(rows, times)
    fixed = {b: float(coef[columns["fixed", b]]) for b in measured}
    fits = []
    for b in buckets:
        if b in fixed:
            intercept = fixed[b]
        else:  # never measured: between its neighbours' intercepts
            intercept = float(np.interp(b, measured, [fixed[m] for m in measured]))
        fits.append(
            BucketFit(
                bucket=b,
                coef=(intercept, *(float(coef[column(t, b)]) * per_unit(t, b) for t in terms)),
                samples=len(by_bucket[b]),
                shared_slopes=any(t in PER_BUCKET and (t, b) not in columns for t in terms),
                rel_rms=None,
            )
        )
    return CostModel(key, fits, features=features, slots=slots)


def _varies(pts: Sequence[StepSample], field: int) -> bool:
    """Whether a term takes more than one value: else its slope is not identifiable."""
    return len({s.work[field] for s in pts}) > 1


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
        f = model.fit_for(s.work.tokens)
        per.setdefault(f.bucket, []).append((model.predict(s.work) - s.seconds) / s.seconds)
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
    return CostModel(
        model.key,
        fits,
        features=model.features,
        fit_error=fit_error,
        serving=model.serving,
        slots=model.slots,
    )


def _rms(xs: Sequence[float]) -> float | None:
    return math.sqrt(sum(x * x for x in xs) / len(xs)) if xs else None
