"""The step-cost model: fits known lines back, keeps its key, survives noisy steps (no JAX)."""

from __future__ import annotations

import json
import random

import pytest

from jaxserve.scheduling.cost_model import (
    CostKey,
    CostModel,
    CostModelError,
    StepSample,
    StepWork,
    fit,
    plan_features,
    serving_scale,
    work_of,
)
from tests.unit.helpers import add_all, make_requests, make_scheduler

KEY = CostKey(model="m", dtype="float32", device_kind="cpu", token_buckets=(8, 16, 32, 64))
W20 = StepWork(20, 4000)  # a step of 20 tokens attending 4000 pairs
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
            out.append(StepSample(StepWork(tokens, attended), t * (1 + rng.gauss(0, noise))))
    return out


def test_attended_pairs_of_decode_and_prefill():
    # A decode at context 9 (8 cached + itself) attends 9; a 3-token chunk after 4 cached
    # tokens attends 5 + 6 + 7 = 18.
    assert work_of([(8, 1)]).attended == 9
    assert work_of([(4, 3)]).attended == 18
    assert work_of([(8, 1), (4, 3)]).attended == 27


def test_plan_features_read_a_real_plan():
    sched = make_scheduler()
    add_all(sched, make_requests(2, prompt_len=8))
    plan = sched.schedule(now=0.0)
    # Two whole 8-token prompts: 16 tokens, each attending 1 + 2 + ... + 8 = 36 pairs.
    assert plan_features(plan)[:2] == (16, 72)


def test_work_of_counts_the_cpu_attentions_loop_trips():
    # Decodes: every slot runs to the longest context, in blocks of 32 keys (128 for a step of
    # one slot): contexts 41 and 9 run 64 keys; a lone decode at context 9, 128.
    assert work_of([(40, 1), (8, 1)]) == (2, 41 + 9, 64, 0)
    assert work_of([(8, 1)]).decode_keys == 128
    # Prefill: tiles of 64 queries, each through the 128-key blocks up to its last query's. A
    # 100-token prompt: queries 0-63 and 64-99 read block 0 each. After 100 cached tokens: the
    # tiles end at positions 163 and 199, two blocks each.
    assert work_of([(0, 100)]).prefill_blocks == 2
    assert work_of([(100, 100)]).prefill_blocks == 4
    assert work_of([(100, 100), (40, 1)]) == (101, 100 * 100 + 5050 + 41, 64, 4)


def _tiles_samples(seed=0, per_context=10, mixed=30):
    """Steps timed as the CPU attention runs them (per bucket fixed + 20 us a token + 8 us a
    decode key per slot + 40 us a prefill block): decode batches whose rows share one context,
    as calibration runs them, and mixed steps of spread contexts."""
    rng = random.Random(seed)
    out = []

    def step(spans):
        w = work_of(spans)
        b = next(b for b in KEY.token_buckets if b >= w.tokens)
        t = 1e-3 * b / 32 + 2e-5 * w.tokens + 8e-6 * min(b, 64) * w.decode_keys / 32
        out.append(StepSample(w, (t + 4e-5 * w.prefill_blocks) * (1 + rng.gauss(0, 0.01))))

    for b in KEY.token_buckets:
        for ctx in (32, 128, 512, 768):
            for _ in range(per_context):
                step([(ctx + rng.randint(0, 8), 1)] * b)
        for _ in range(mixed):
            decodes = rng.randint(0, b // 2)
            spans = [(rng.randint(16, 700), 1) for _ in range(decodes)]
            step([*spans, (rng.randint(0, 300), b - decodes)])
    return out


def test_tiles_model_prices_a_decode_by_its_longest_row_where_pairs_miss():
    samples = _tiles_samples()
    tiles, pairs = fit(samples, KEY, "tiles"), fit(samples, KEY, "pairs")
    assert tiles.features == "tiles" and tiles.fit_error["rel_rms"] < 0.05
    # Serving's commonest step: 64 rows whose contexts spread from 16 to 700 (mean 358).
    spans = [(16 + 11 * i, 1) for i in range(64)]
    truth = 2e-3 + 2e-5 * 64 + 8e-6 * 64 * work_of(spans).decode_keys / 32
    assert tiles.predict(work_of(spans)) == pytest.approx(truth, rel=0.05)
    assert pairs.predict(work_of(spans)) < 0.85 * truth  # by the mean row: a fifth short
    # Saved and loaded with its features.
    loaded = CostModel.from_json(json.loads(json.dumps(tiles.to_json())))
    assert loaded.features == "tiles"
    assert loaded.predict(work_of(spans)) == tiles.predict(work_of(spans))


def test_a_shared_decode_slope_is_per_slot_so_few_steps_price_small_buckets_right():
    # At warm-up each bucket has a few steps: too few for slopes of their own. Shared as one
    # slope per decode key, a one-row decode would cost as much attention as a 64-row one;
    # shared per slot, each bucket pays for its own slots.
    samples = _tiles_samples(per_context=2, mixed=6)
    model = fit(samples, KEY, "tiles")
    assert all(f.shared_slopes for f in model.fits.values())
    assert model.fits[8].coef[2] == pytest.approx(model.fits[64].coef[2] / 8)
    for rows in (8, 64):
        spans = [(700, 1)] * rows
        truth = 1e-3 * rows / 32 + 2e-5 * rows + 8e-6 * rows * work_of(spans).decode_keys / 32
        assert model.predict(work_of(spans)) == pytest.approx(truth, rel=0.1)
    # Other slot counts (a bucket past the engine's rows) are given; they are saved for refits.
    capped = fit(samples, KEY, "tiles", slots={64: 32})
    assert capped.fits[64].coef[2] == pytest.approx(capped.fits[32].coef[2])
    assert CostModel.from_json(capped.to_json()).slots == {8: 8, 16: 16, 32: 32, 64: 32}


def test_unknown_features_are_refused():
    with pytest.raises(CostModelError, match="Unknown cost model features 'flops'"):
        fit(_samples(), KEY, "flops")
    obj = fit(_samples(), KEY).to_json()
    obj["features"] = ["fixed", "flops"]
    with pytest.raises(CostModelError, match=r"unknown features \['fixed', 'flops'\]"):
        CostModel.from_json(obj)


def test_fit_recovers_known_lines():
    model = fit(_samples(), KEY)
    for b, (fixed, per_token, per_pair) in TRUE.items():
        for tokens, attended in ((b, b * 100), (b // 2 + 1, b * 500)):
            want = fixed + per_token * tokens + per_pair * attended
            assert model.predict(StepWork(tokens, attended)) == pytest.approx(want, rel=0.05)
    assert model.fit_error["rel_rms"] < 0.05


def test_disturbed_steps_are_dropped_not_fitted():
    samples = _samples(noise=0.0)
    # Every tenth step ran 10x slower (a compile, a swap): the fit must not follow them.
    noisy = [
        StepSample(s.work, s.seconds * (10 if i % 10 == 0 else 1)) for i, s in enumerate(samples)
    ]
    model = fit(noisy, KEY)
    assert model.fit_error["outliers_dropped"] >= len(samples) // 10
    fixed, per_token, per_pair = TRUE[32]
    want = fixed + per_token * 32 + per_pair * 3200
    assert model.predict(StepWork(32, 3200)) == pytest.approx(want, rel=0.03)


def test_unmeasured_bucket_interpolates_between_neighbours():
    model = fit(_samples(buckets=(8, 64)), KEY)
    assert model.fits[16].samples == 0 and model.fits[16].shared_slopes
    low, high = model.predict(StepWork(16, 0)), model.predict(StepWork(32, 0))
    assert model.predict(StepWork(8, 0)) < low < high < model.predict(StepWork(64, 0))


def test_one_pair_slope_for_all_buckets_so_long_contexts_stay_ordered():
    # Bucket 32's steps met a busy neighbour whenever their contexts were long: fitted alone,
    # its pair slope would be 6x the true one, and at contexts 4x the measured ones a 32-token
    # step would be predicted slower than a 64-token one. An attended pair costs the same in
    # every bucket, so the slope is fitted over all of them.
    def disturbed(s):
        if 16 < s.work.tokens <= 32:
            return StepSample(s.work, s.seconds + 5 * TRUE[32][2] * s.work.attended)
        return s

    model = fit([disturbed(s) for s in _samples(noise=0.0)], KEY)
    assert len({f.coef[2] for f in model.fits.values()}) == 1
    for per_token_pairs in (600, 2400):
        times = [model.predict(StepWork(t, t * per_token_pairs)) for t in (8, 16, 32, 64)]
        assert times == sorted(times), times


def test_slopes_never_negative():
    # Times that fall with more work (noise on a flat cost) must not give a negative slope.
    samples = [StepSample(StepWork(t, t * 10), 1e-3 - 1e-7 * t) for t in range(1, 9)] * 3
    model = fit(samples, CostKey(model="m", dtype="f", device_kind="cpu", token_buckets=(8,)))
    assert all(c >= 0 for c in model.fits[8].coef[1:])


def test_save_load_round_trip_and_key_check(tmp_path):
    model = fit(_samples(), KEY)
    path = model.save(tmp_path / "cost.json")
    loaded = CostModel.load(path, expect=KEY)
    assert loaded.predict(W20) == pytest.approx(model.predict(W20), rel=1e-12)
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
    served = [StepSample(s.work, 1.3 * s.seconds) for s in _samples(seed=1)]
    served.append(StepSample(W20, 10 * model.predict(W20)))
    scale = serving_scale(model, served)
    assert scale == pytest.approx(1.3, rel=0.02)
    scaled = model.with_serving_scale(scale, len(served))
    assert scaled.predict(W20) == pytest.approx(scale * model.predict(W20))
    assert scaled.predict_calibrated(W20) == model.predict(W20)
    # Saved with the model: the next start and the simulator plan served steps.
    loaded = CostModel.load(scaled.save(tmp_path / "cost.json"), expect=KEY)
    assert loaded.predict(W20) == pytest.approx(scaled.predict(W20), rel=1e-12)
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
    assert model.predict(W20) == model.predict_calibrated(W20)
