"""The accelerator check's dry run, as CI runs it: the whole script on the CPU, so the GPU's
metered minutes are never spent on an error the CPU could have shown."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from jaxserve.bench import accelerator_check as ac
from tests.torch_reference import have_torch


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """One fresh compilation cache for this module: the dry run's stages share it (as on the
    device), and the later test reloads the xla bucket the dry run compiled."""
    return str(tmp_path_factory.mktemp("xla"))


def test_dry_run_writes_every_stage_with_equal_tokens_and_no_compiles(tmp_path, cache_dir):
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "jaxserve.bench.accelerator_check", "--out", str(out), "--dry-run"]
    cmd += ["--compilation-cache-dir", cache_dir, "--budget-s", "1200"]
    # The peer is transformers on torch: without torch (tests/torch_reference.py) every other
    # stage still runs, and CI's Python 3.11 side runs this with the peer.
    peer_runs = have_torch()
    names = [name for name, *_ in ac.STAGES if peer_runs or name != "peer"]
    cmd += ["--stages", ",".join(names)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The device tool brings back 8 files at most from $OUT.
    assert sorted(f.name for f in out.iterdir()) == ["report.json", "stages.log", "summary.md"]
    report = json.loads((out / "report.json").read_text())
    stages = report["stages"]
    assert list(stages) == names
    for name, stage in stages.items():
        want = "skipped" if name == "gpu_check" else "ok"
        assert stage["status"] == want, (name, stage)
        assert "error" not in stage and "error" not in stage["result"], (name, stage)
    assert "needs a GPU" in stages["gpu_check"]["reason"]

    p = ac.plan(dry_run=True)
    correctness = stages["engine_correctness"]["result"]
    assert correctness["tokens_equal"]["num_equal"] == len(p["prompt_lens"]) == 16
    for backend in p["backends"]:
        assert correctness[backend]["compiles_after_warmup"] == 0
        assert correctness[backend]["compiles_at_warmup"] == len(correctness[backend]["buckets"])
        assert [len(t) for t in correctness[backend]["tokens"]] == [p["correctness_tokens"]] * 16
    tiny = stages["tiny_f32_vs_cpu"]["result"]
    assert tiny["tokens_equal"]["num_equal"] == len(p["tiny_prompt_lens"])

    speed = stages["speed"]["result"]
    for backend in p["backends"]:
        runs = speed[backend]
        assert set(runs) == {"single", "mixed", *p["bursts"]}
        for name, run in runs.items():
            assert run["num_finished"] == run["num_requests"], (backend, name)
            assert run["compiles_after_warmup"] == 0, (backend, name)
        for name, count in p["bursts"].items():
            assert runs[name]["output_tokens"] == count * p["burst_lengths"]["output_range"][1]
        assert runs["single"]["tpot"]["p50"] > 0
    features = stages["features"]["result"]
    spec = features["speculative"]
    assert spec["tokens_equal"]["num_equal"] == 2
    assert spec["verifications"] > 0 and spec["proposed"] >= spec["accepted"] > 0
    assert spec["compiles_after_warmup"] == 0
    structured = features["structured"]
    assert structured["compiles_after_warmup"] == 0
    for kind in ("json", "regex", "choice"):
        assert structured[kind]["all_valid"] and structured[kind]["finished"] > 0, kind
    if peer_runs:
        peer = stages["peer"]["result"]
        for name, count in p["bursts"].items():
            assert peer[name]["num_errors"] == 0
            assert peer[name]["output_tokens"] == count * p["burst_lengths"]["output_range"][1]

        targets = {t["target"]: t for t in report["targets"]}
        ratio = targets["burst8 output tok/s vs transformers"]
        ours = speed[p["backends"][0]]["burst8"]["output_token_throughput"]
        assert ratio["value"] == ours / peer["burst8"]["output_token_throughput"]
    summary = (out / "summary.md").read_text()
    assert "| engine_correctness | ok |" in summary
    assert "Greedy tokens equal between backends: 16/16" in summary
    assert "greedy tokens equal to without: 2/2" in summary


def test_a_spent_budget_skips_the_remaining_stages_and_still_reports(tmp_path):
    # Under MIN_STAGE_S left from the start: nothing is started, every stage says why.
    rc = ac.main(["--out", str(tmp_path), "--budget-s", "1", "--stages", "environment,peer"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert rc == 0
    assert list(report["stages"]) == ["environment", "peer"]
    assert all(s["status"] == "skipped" for s in report["stages"].values())
    assert "Budget spent" in report["stages"]["peer"]["reason"]
    assert all(t["met"] is None for t in report["targets"])


def _fake_stage(name: str, args, limit_s: float) -> dict:
    """A stage that writes into the work dir as a real one does (its JSON and its log)."""
    (args.work_dir / f"{name}.json").write_text("{}")
    (args.work_dir / f"{name}.log").write_text("ran\n")
    if name == "peer":
        raise RuntimeError("the stage's parent failed")
    return {"seconds": 0.0, "cpu_s": 0.0, "limit_s": limit_s, "result": {}, "status": "ok"}


def _made_work_dirs(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("jaxserve-accelerator-check-"))


def test_a_work_dir_the_check_made_is_removed_however_it_ends(tmp_path, monkeypatch):
    # Every run used to leave a jaxserve-accelerator-check-* folder in /tmp, filled or empty.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(ac, "run_stage_process", _fake_stage)
    seen = []
    monkeypatch.setattr(ac, "write_report", lambda out, report: seen.append(_made_work_dirs(tmp)))

    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.md").write_text("")
    assert ac.main(["--out", str(out), "--stages", "environment"]) == 0
    assert len(seen[0]) == 1  # the stage ran in a folder of the check's own...
    assert _made_work_dirs(tmp) == []  # ...which is gone, with what the stage wrote in it

    with pytest.raises(RuntimeError, match="parent failed"):
        ac.main(["--out", str(out), "--stages", "environment,peer"])
    assert _made_work_dirs(tmp) == []

    with pytest.raises(SystemExit):  # refused before any folder is made
        ac.main(["--out", str(out), "--stages", "nonesuch"])
    assert _made_work_dirs(tmp) == []

    # The user's --work-dir is kept, with each stage's JSON and full log.
    mine = tmp_path / "mine"
    assert ac.main(["--out", str(out), "--stages", "environment", "--work-dir", str(mine)]) == 0
    assert sorted(f.name for f in mine.iterdir()) == ["environment.json", "environment.log"]


def test_targets_read_the_kernel_report_wherever_the_points_are_nested():
    # gpu_check's JSON may group points per kernel; the targets find them by their fields.
    point = {"batch": 64, "context": 2048, "speedup_vs_reference": 1.5}
    report = {
        "plan": ac.plan(dry_run=False),
        "stages": {
            "gpu_check": {
                "result": {
                    "decode": [{"batch": 1, "context": 512, "max_abs_error_vs_reference": 0.01}],
                    "triton": {"decode": [point | {"max_abs_error_vs_reference": 0.03}]},
                    "mosaic": {"decode": [point | {"speedup_vs_reference": 3.0}]},
                }
            },
            "speed": {"result": {"pallas": {"burst256": {"output_token_throughput": 3000.0}}}},
            "peer": {"result": {"burst256": {"output_token_throughput": 1000.0}}},
        },
    }
    got = {t["target"]: t for t in ac.targets(report)}
    error = got["kernel max abs error vs reference (bf16)"]
    assert (error["value"], error["met"]) == (0.03, False)  # the worst point decides
    assert error["source"] == "triton.decode[0].max_abs_error_vs_reference"
    speedup = got["kernel speedup at batch 64, context 2048"]
    assert (speedup["value"], speedup["met"]) == (1.5, False)  # the slower kernel decides
    peer = got["burst256 output tok/s vs transformers"]
    assert (peer["value"], peer["met"]) == (3.0, True)
    assert got["single-stream decode MBU (pallas)"]["met"] is None  # not measured


def test_compare_tokens_names_the_first_divergence():
    got = ac.compare_tokens([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [7]])
    assert got["num_equal"] == 1
    assert got["first_divergence"] == {"prompt": 1, "position": 1, "a": [5, 6], "b": [9, 6]}


def test_a_backend_that_fails_is_recorded_and_the_other_still_runs(
    tmp_path, monkeypatch, cache_dir
):
    # 'pallas' needs a TPU or GPU: on the CPU its engine fails, as a kernel that does not compile
    # would on the device. The xla engine must still run, and the stage must end in error.
    dry = ac.plan(dry_run=True)
    monkeypatch.setattr(ac, "plan", lambda dry_run: dry | {"backends": ("pallas", "xla")})
    args = argparse.Namespace(dry_run=True, compilation_cache_dir=cache_dir)
    stage = ac.Stage(tmp_path / "engine_correctness.json", args)
    ac.stage_engine_correctness(stage)
    saved = json.loads((tmp_path / "engine_correctness.json").read_text())
    assert "needs a TPU or GPU" in saved["pallas"]["error"]
    assert saved["xla"]["compiles_after_warmup"] == 0
    assert len(saved["xla"]["tokens"]) == len(dry["prompt_lens"])
    assert "tokens_equal" not in saved
    assert saved["error"] == "Backends ['pallas'] failed; see their entries."
