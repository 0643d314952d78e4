"""`jaxserve compile`: every bucket compiled for a real TPU target through libtpu, on this CPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='needs libtpu for TPU targets: pip install -e ".[tpu]"',
)


def _compile(*args: str, tmp_path) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "compile", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, json.loads(out.read_text()) if out.exists() else None


@needs_libtpu
def test_compiles_the_buckets_for_a_v5e_chip_and_prints_the_table(tmp_path):
    proc, report = _compile(
        "--target", "v5e:1x1", "--model", "llama-tiny", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "16", "--buckets", "1,16", tmp_path=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert report["device_kind"] == "TPU v5 lite" and report["platform"] == "tpu"
    assert report["dtype"] == "bfloat16"  # the target's default, not the CPU's float32
    assert report["attention_backend"] == "pallas_tpu"  # auto on a TPU: the TPU kernel
    assert [b["num_tokens"] for b in report["buckets"]] == [1, 16]
    for bucket in report["buckets"]:
        assert bucket["compiled"] and bucket["argument_bytes"] > 0
        # Never below what the step must move and compute (issue 47, item 5).
        assert bucket["predicted_step_s"] >= bucket["floor_step_s"] > 0
        assert bucket["floor_bytes"] > 0 and bucket["floor_flops"] > 0
        assert bucket["pool_copies"] == 0  # the pool keeps its place (issue 28, defect 3)
    one, sixteen = report["buckets"]
    assert sixteen["floor_step_s"] > one["floor_step_s"]  # 16 tokens' KV and rows' logits
    # llama-tiny's 2 KV heads of 16: 64 lanes of keys and values, padded to one 128-lane tile.
    assert report["pool_padding"] == 2.0 and "layout padding 2.00x" in proc.stdout
    # Sized from the chip's 16 GiB, so capped by 4 sequences of llama-tiny's 2048-token context.
    assert report["num_pages"] == 4 * 2048 // 16
    assert "tokens" in proc.stdout and "predicted step" in proc.stdout and "fits" in proc.stdout
    assert "floor" in proc.stdout


def test_an_unknown_target_is_one_line_and_exit_2(tmp_path):
    proc, report = _compile("--target", "v9z:1x1", "--model", "llama-tiny", tmp_path=tmp_path)
    assert proc.returncode == 2 and report is None
    errors = [line for line in proc.stderr.splitlines() if line.startswith("jaxserve: error:")]
    assert len(errors) == 1 and "v9z:1x1" in errors[0], proc.stderr


@needs_libtpu
def test_the_tpu_kernel_compiles_under_tensor_parallel_where_attention_is_not_head_local(tmp_path):
    """Issue 28, defect 1: smollm2-135m's 9 query / 3 KV heads over 2 devices. XLA cannot
    partition the Mosaic kernel ("Mosaic kernels cannot be automatically partitioned"); it runs
    under shard_map on the query heads of each device's KV heads."""
    proc, report = _compile(
        "--target", "v5e:2x2", "--model", "smollm2-135m", "--tensor-parallel", "2",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "8", "--buckets", "8",
        tmp_path=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert report["num_devices"] == 2 and report["attention_backend"] == "pallas_tpu"
    assert all(b["compiled"] and b["pool_copies"] == 0 for b in report["buckets"]), report
