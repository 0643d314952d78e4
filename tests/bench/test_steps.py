"""`jaxserve bench --profile steps` end to end on llama-tiny: every point, sane and consistent."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from jaxserve.bench.steps import BATCHES, PROMPT_LENS
from jaxserve.cost_model import CostModel


@pytest.mark.slow  # ~2 CPU-minutes: it compiles every bucket the points use
def test_steps_profile_prints_and_writes_every_point(tmp_path):
    out = tmp_path / "steps"
    # Short decode contexts and few timed steps keep the fill of batch 256 to a few buckets.
    proc = subprocess.run(
        [
            sys.executable, "-m", "jaxserve.cli", "bench", "--profile", "steps",
            "--model", "llama-tiny", "--dtype", "float32", "--prompt-len", "4",
            "--output-len", "3", "--max-num-batched-tokens", "512", "--max-num-seqs", "8",
            "--out", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "steps.json").read_text())
    # llama-tiny's context is 2048 tokens: the 2048-token prompt is capped to 2047.
    assert [p["tokens"] for p in report["prefill"]] == [min(p, 2047) for p in PROMPT_LENS]
    assert [d["batch"] for d in report["decode"]] == list(BATCHES)
    budget = report["max_num_batched_tokens"]
    for p in report["prefill"]:
        assert p["steps"] == math.ceil(p["tokens"] / budget)
        assert p["tok_per_s"] == pytest.approx(p["tokens"] / p["seconds"])
        assert min(p["seconds"], p["gflop_per_s"], p["gb_per_s"]) > 0
    for d in report["decode"]:
        assert d["tok_per_s"] == pytest.approx(d["batch"] / (d["ms_per_step"] / 1e3))
        assert min(d["ms_per_step"], d["gflop_per_s"], d["gb_per_s"]) > 0
        assert 4 < d["context"] < 4 + 64  # the prompt plus the tokens decoded so far
    c = report["ceilings"]
    assert c["matmul_gflop_per_s"] > 0 and c["gemv_gb_per_s"] > 0
    assert c["gemv_bytes"] >= 500e6
    for p in (*PROMPT_LENS[:2], 2047):
        assert f"| {p} |" in proc.stdout
    for b in BATCHES:
        assert f"| {b} |" in proc.stdout
    assert "GFLOP/s" in proc.stdout and "GB/s" in proc.stdout
    # The step-cost model of an engine of 8 rows and this budget, beside steps.json.
    cost = CostModel.load(out / "cost_model.json")
    assert cost.key.token_buckets[-1] == budget and cost.key.device_kind
    assert all(cost.fits[b].samples > 0 for b in (1, 2, 4, 8, 512))  # decodes, full prefills
    assert cost.fit_error["samples"] > 100 and cost.fit_error["rel_rms"] is not None
    # A full prefill step over long contexts costs more than a one-token decode.
    assert cost.predict(512, 512 * 300) > cost.predict(1, 32)
    assert "rel RMS" in proc.stderr
