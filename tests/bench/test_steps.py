"""`jaxserve bench --profile steps` end to end on llama-tiny: every point, sane and consistent."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from jaxserve.bench.steps import BATCHES, PROMPT_LENS
from jaxserve.engine_config import default_compilation_cache_dir
from jaxserve.scheduling.cost_model import CostModel, work_of

# Two prefill points (one capped by the context) and two decode batches, on a 16-token budget:
# every code path of the full run (chunked prefill, the cap, filling a batch, the cost model's
# decode and mixed steps) at a fraction of its compiles (each costs seconds: the bench compiles
# without a cache unless given one). The defaults are checked below.
PROMPT_POINTS = (16, 2048)
BATCH_POINTS = (1, 4)
BUDGET = 16


@pytest.mark.slow  # it compiles every bucket the points use
def test_steps_profile_prints_and_writes_every_point(tmp_path):
    out = tmp_path / "steps"
    # The suite's compilation cache (as the engines of other tests use): a rerun loads its steps.
    cache = default_compilation_cache_dir()
    cache_flag = ["--compilation-cache-dir", cache] if cache else []
    # Short decode contexts and few timed steps keep the fill of each batch to a few buckets.
    proc = subprocess.run(
        [
            sys.executable, "-m", "jaxserve.cli", "bench", "--profile", "steps",
            "--model", "llama-tiny", "--dtype", "float32", "--prompt-len", "4",
            "--output-len", "3", "--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", "8",
            "--steps-prompt-lens", ",".join(map(str, PROMPT_POINTS)),
            "--steps-batches", ",".join(map(str, BATCH_POINTS)),
            *cache_flag,
            "--out", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "steps.json").read_text())
    # llama-tiny's context is 2048 tokens: the 2048-token prompt is capped to 2047.
    assert [p["tokens"] for p in report["prefill"]] == [min(p, 2047) for p in PROMPT_POINTS]
    assert [d["batch"] for d in report["decode"]] == list(BATCH_POINTS)
    budget = report["max_num_batched_tokens"]
    assert budget == BUDGET
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
    for p in (*PROMPT_POINTS[:-1], 2047):
        assert f"| {p} |" in proc.stdout
    for b in BATCH_POINTS:
        assert f"| {b} |" in proc.stdout
    assert "GFLOP/s" in proc.stdout and "GB/s" in proc.stdout
    # The step-cost model of an engine of 8 rows and this budget, beside steps.json.
    cost = CostModel.load(out / "cost_model.json")
    assert cost.key.token_buckets[-1] == budget and cost.key.device_kind
    assert all(cost.fits[b].samples > 0 for b in (1, 2, 4, 8, BUDGET))  # decodes, full prefills
    assert cost.fit_error["samples"] > 100 and cost.fit_error["rel_rms"] is not None
    # Measured in the CPU attention's terms; a full prefill step over long contexts costs more
    # than a one-token decode.
    assert cost.features == "tiles"
    assert cost.predict(work_of([(300, BUDGET)])) > cost.predict(work_of([(31, 1)]))
    assert "rel RMS" in proc.stderr


def test_steps_profile_defaults_to_llama_batched_bench_points(monkeypatch):
    # The test above asks for fewer points; without the flags the spec gets the full lists.
    import jaxserve.bench.steps as steps
    from jaxserve.cli import main

    seen = []

    def fake_run_steps(spec, log):
        seen.append(spec)
        raise SystemExit(0)  # stop before anything is built

    monkeypatch.setattr(steps, "run_steps", fake_run_steps)
    with pytest.raises(SystemExit):
        main(["bench", "--profile", "steps", "--model", "llama-tiny"])
    assert (seen[0].prompt_lens, seen[0].batches) == (PROMPT_LENS, BATCHES)
    with pytest.raises(SystemExit):
        main(["bench", "--profile", "steps", "--steps-prompt-lens", "8", "--steps-batches", "2,3"])
    assert (seen[1].prompt_lens, seen[1].batches) == ((8,), (2, 3))
    assert main(["bench", "--profile", "steps", "--steps-batches", "4,0"]) == 2  # a batch of 0
    assert len(seen) == 2
    assert seen[0].cost_model  # measured after the table unless asked not to
    with pytest.raises(SystemExit):
        main(["bench", "--profile", "steps", "--no-cost-model"])
    assert not seen[2].cost_model


def test_steps_profile_times_the_quantized_engine_it_is_asked_for(monkeypatch):
    """--quantization reaches the engines the profile times (it once built float ones whatever
    the flag), and the report's weight bytes are the quantized model's."""
    import jax
    import numpy as np

    import jaxserve.bench.steps as steps
    from checkpoints import load_model
    from jaxserve.cli import main

    seen = []
    monkeypatch.setattr(steps, "run_steps", lambda spec, log: seen.append(spec) or exit(0))
    with pytest.raises(SystemExit):
        main(["bench", "--profile", "steps", "--model", "llama-tiny", "--quantization", "int8"])
    assert seen[0].quantization == "int8"
    monkeypatch.undo()

    spec = steps.StepsSpec(
        model="llama-tiny", dtype="float32", quantization="int8", prompt_lens=(8,),
        batches=(1,), decode_context=4, decode_steps=2, max_num_batched_tokens=16,
        cost_model=False,
    )  # fmt: skip
    report = steps.run_steps(spec, log=lambda m: None)
    float_bytes = sum(
        int(np.size(x)) * x.dtype.itemsize
        for x in jax.tree.leaves(load_model("llama-tiny", dtype="float32").params)
    )
    assert report["quantization"] == "int8"
    assert report["weight_bytes"] < 0.75 * float_bytes  # the decoder's kernels in one byte
    assert "quantization int8" in steps.format_steps(report)
