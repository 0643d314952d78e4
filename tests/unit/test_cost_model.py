"""The step-cost model: fits known lines back, keeps its key, survives noisy steps (no JAX)."""

from __future__ import annotations

import json
import random

import pytest

from jaxserve.cost_model import (
    CostKey,
    CostModel,
    CostModelError,
    StepSample,
    attended_pairs,
    fit,
    plan_features,
    serving_scale,
)
from tests.unit.helpers import add_all, make_requests, make_scheduler

KEY = CostKey(model="m", dtype="float32", device_kind="cpu", token_buckets=(8, 16, 32, 64))
# Ground truth per bucket: fixed seconds grow with the bucket; shared per-token and per-pair costs.
TRUE = {
    8: (1e-3, 2e-5, 3e-8),
    16: (1.5e-3, 2e-5, 3e-8),
    32: (2.5e-3, 2e-5, 3e-8),
    64: (4e-3, 2e-5, 3e-8),
}


def _samples(buckets=(8, 16, 32, 64), per_bucket=40, noise=0.02, seed=0):
    rng = random.Random(seed)
    out = []
    lower = {8: 1, 16: 9, 32: 17, 64: 33}
    for b in buckets:
        fixed, per_token, per_pair = TRUE[b]
        for _ in range(per_bucket):
            tokens = rng.randint(lower[b], b)
            attended = rng.randint(tokens, tokens * 600)
            t = fixed + per_token * tokens + per_pair * attended
            out.append(StepSample(tokens, attended, t * (1 + rng.gauss(0, noise))))
    return out


def test_attended_pairs_of_decode_and_prefill():
    # A decode at context 9 (8 cached + itself) attends 9; a 3-token chunk after 4 cached
    # tokens attends 5 + 6 + 7 = 18.
    assert attended_pairs([(8, 1)]) == 9
    assert attended_pairs([(4, 3)]) == 18
    assert attended_pairs([(8, 1), (4, 3)]) == 27


def test_plan_features_read_a_real_plan():
    sched = make_scheduler()
    add_all(sched, make_requests(2, prompt_len=8))
    plan = sched.schedule(now=0.0)
    # Two whole 8-token prompts: 16 tokens, each attending 1 + 2 + ... + 8 = 36 pairs.
    assert plan_features(plan) == (16, 72)


def test_fit_recovers_known_lines():
    model = fit(_samples(), KEY)
    for b, (fixed, per_token, per_pair) in TRUE.items():
        for tokens, attended in ((b, b * 100), (b // 2 + 1, b * 500)):
            want = fixed + per_token * tokens + per_pair * attended
            assert model.predict(tokens, attended) == pytest.approx(want, rel=0.05)
    assert model.fit_error["rel_rms"] < 0.05


def test_disturbed_steps_are_dropped_not_fitted():
    samples = _samples(noise=0.0)
    # Every tenth step ran 10x slower (a compile, a swap): the fit must not follow them.
    noisy = [
        StepSample(s.tokens, s.attended, s.seconds * (10 if i % 10 == 0 else 1))
        for i, s in enumerate(samples)
    ]
    model = fit(noisy, KEY)
    assert model.fit_error["outliers_dropped"] >= len(samples) // 10
    fixed, per_token, per_pair = TRUE[32]
    want = fixed + per_token * 32 + per_pair * 3200
    assert model.predict(32, 3200) == pytest.approx(want, rel=0.03)


def test_unmeasured_bucket_interpolates_between_neighbours():
    model = fit(_samples(buckets=(8, 64)), KEY)
    assert model.fits[16].samples == 0 and model.fits[16].shared_slopes
    low, high = model.predict(16, 0), model.predict(32, 0)
    assert model.predict(8, 0) < low < high < model.predict(64, 0)


def test_one_pair_slope_for_all_buckets_so_long_contexts_stay_ordered():
    # Bucket 32's steps met a busy neighbour whenever their contexts were long: fitted alone,
    # its pair slope would be 6x the true one, and at contexts 4x the measured ones a 32-token
    # step would be predicted slower than a 64-token one. An attended pair costs the same in
    # every bucket, so the slope is fitted over all of them.
    def disturbed(s):
        if 16 < s.tokens <= 32:
            return StepSample(s.tokens, s.attended, s.seconds + 5 * TRUE[32][2] * s.attended)
        return s

    model = fit([disturbed(s) for s in _samples(noise=0.0)], KEY)
    assert len({f.coef[2] for f in model.fits.values()}) == 1
    for per_token_pairs in (600, 2400):
        times = [model.predict(t, t * per_token_pairs) for t in (8, 16, 32, 64)]
        assert times == sorted(times), times


def test_slopes_never_negative():
    # Times that fall with more work (noise on a flat cost) must not give a negative slope.
    samples = [StepSample(t, t * 10, 1e-3 - 1e-7 * t) for t in range(1, 9)] * 3
    model = fit(samples, CostKey(model="m", dtype="f", device_kind="cpu", token_buckets=(8,)))
    assert all(c >= 0 for c in model.fits[8].coef[1:])


def test_save_load_round_trip_and_key_check(tmp_path):
    model = fit(_samples(), KEY)
    path = model.save(tmp_path / "cost.json")
    loaded = CostModel.load(path, expect=KEY)
    assert loaded.predict(20, 4000) == pytest.approx(model.predict(20, 4000), rel=1e-12)
    # An engine with a subset of the buckets can use it; another device kind cannot.
    CostModel.load(path, expect=CostKey(model="m", dtype="float32", device_kind="cpu",
                                        token_buckets=(8, 16)))  # fmt: skip
    with pytest.raises(CostModelError, match="device_kind='cpu', not 'tpu'"):
        CostModel.load(path, expect=CostKey(model="m", dtype="float32", device_kind="tpu",
                                            token_buckets=(8,)))  # fmt: skip
    with pytest.raises(CostModelError, match=r"no token buckets \[128\]"):
        CostModel.load(path, expect=CostKey(model="m", dtype="float32", device_kind="cpu",
                                            token_buckets=(8, 128)))  # fmt: skip


def test_load_rejects_other_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"key": {}}')
    with pytest.raises(CostModelError, match="Not a jaxserve cost model"):
        CostModel.load(bad)
    with pytest.raises(CostModelError, match="Cannot read"):
        CostModel.load(tmp_path / "missing.json")


def test_serving_scale_is_measured_on_served_steps_and_saved(tmp_path):
    model = fit(_samples(), KEY)
    assert model.serving_scale == 1.0
    # Served steps 1.3x slower than calibrated, and one stalled 10x (a compile): left out.
    served = [StepSample(s.tokens, s.attended, 1.3 * s.seconds) for s in _samples(seed=1)]
    served.append(StepSample(20, 4000, 10 * model.predict(20, 4000)))
    scale = serving_scale(model, served)
    assert scale == pytest.approx(1.3, rel=0.02)
    scaled = model.with_serving_scale(scale, len(served))
    assert scaled.predict(20, 4000) == pytest.approx(scale * model.predict(20, 4000))
    assert scaled.predict_calibrated(20, 4000) == model.predict(20, 4000)
    # Saved with the model: the next start and the simulator plan served steps.
    loaded = CostModel.load(scaled.save(tmp_path / "cost.json"), expect=KEY)
    assert loaded.predict(20, 4000) == pytest.approx(scaled.predict(20, 4000), rel=1e-12)
    assert loaded.serving == {"scale": scale, "steps": len(served)}
    # Measured again on the scaled model: still against calibration, not compounded.
    assert serving_scale(loaded, served) == pytest.approx(scale)
    assert serving_scale(model, []) is None
    with pytest.raises(CostModelError, match=r"serving scale 0\.0 must be"):
        model.with_serving_scale(0.0, 5)


def test_a_file_from_before_the_serving_scale_loads_without_it(tmp_path):
    obj = fit(_samples(), KEY).to_json()
    del obj["serving"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(obj))
    model = CostModel.load(path, expect=KEY)
    assert model.serving_scale == 1.0
    assert model.predict(20, 4000) == model.predict_calibrated(20, 4000)
