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


# ---- the pool sized from a target's HBM and the step's reserved bytes, on this CPU ----------

MiB = 2**20


def test_size_pool_leaves_the_step_s_reserved_bytes_out_of_the_pool():
    """kv_cache_memory_fraction of the HBM, less the params and the step's reserved bytes,
    in whole pages, capped by max_num_seqs full-length sequences; at least one page."""
    from jaxserve.engine_config import EngineConfig
    from jaxserve.runtime import aot

    config = EngineConfig(max_num_seqs=4, page_size=16, kv_cache_memory_fraction=0.9)
    model = None  # size_pool reads only the config and the byte counts

    def pages(hbm, reserved, max_model_len=65536):
        return aot.size_pool(config, model, "float32", hbm, 100 * MiB, MiB, max_model_len, reserved)

    # 0.9 GiB = 921.6 MiB, less 100 MiB of params: 821 pages; 200 MiB reserved: 200 fewer.
    assert pages(2**30, 0) == 821
    assert pages(2**30, 200 * MiB) == 621
    assert pages(2**30, 900 * MiB) == 1  # nothing fits: one page, the step still runs
    # 4 sequences of 1024 tokens need 256 pages: the cap, whatever the HBM leaves.
    assert pages(2**30, 200 * MiB, max_model_len=1024) == 256
    # No HBM figure (the CPU): kv_cache_memory_gb (1 GiB: 1024 pages), reserved or not.
    assert pages(None, 200 * MiB) == pages(None, 0) == 1024


def test_a_hybrid_pool_is_capped_by_the_pages_its_groups_hold():
    """gemma3-1b's hybrid layout: a 4096-token sequence holds 256 global pages and, in each of
    its 6 local groups, the window and a 256-token chunk (49 pages): 550 page IDs, not 256."""
    from checkpoints import NAMED_SHAPES
    from jaxserve.engine_config import EngineConfig
    from jaxserve.runtime import aot

    model = NAMED_SHAPES["gemma3-1b"]
    config = EngineConfig(max_num_seqs=4, page_size=16, max_num_batched_tokens=256)
    layout = aot.resolve_kv_layout(config, model)
    assert layout.num_groups == 7
    hbm = 2**40  # the cap binds
    assert aot.size_pool(config, model, "bfloat16", hbm, 0, 1, 4096, 0, layout) == 4 * 550
    assert aot.size_pool(config, model, "bfloat16", hbm, 0, 1, 4096, 0) == 4 * 256


def test_compile_sizes_the_pool_again_from_the_measured_reserved_bytes(monkeypatch):
    """`compile_for_target` on this CPU with an HBM figure given to it (the CPU has none): the
    largest bucket compiles with the pool the HBM allows, its memory analysis says what the
    step needs beside its arguments, and the pool is sized again without those bytes and
    compiled at that size. The compiles are real; only the HBM figure is supplied."""
    from jaxserve.engine_config import EngineConfig
    from jaxserve.runtime import aot

    hbm = 12 * MiB  # under what 16 sequences of 2048 tokens take: the HBM, not the cap, binds
    compiled = []
    real = aot._compile_bucket

    def recording(program, num_tokens, num_seqs):
        report = real(program, num_tokens, num_seqs)
        compiled.append((program.runner.num_pages, report))
        return report

    monkeypatch.setattr(aot, "_compile_bucket", recording)
    monkeypatch.setattr(aot, "_hbm_per_device", lambda where: hbm)
    config = EngineConfig(model="llama-tiny", max_num_seqs=16, max_num_batched_tokens=16)
    report = aot.compile_for_target(config, None, buckets=[16])
    assert report.platform == "cpu" and report.hbm_bytes_per_device == hbm
    (first_pages, first), (pages, last) = compiled
    assert first.compiled and last.compiled and report.buckets == [last]
    page_bytes = report.pool_bytes_per_device // report.num_pages
    free = 0.9 * hbm - report.param_bytes_per_device
    # The step's temporaries and its outputs that are not the donated pool: some, but not
    # the pool again (the pool is donated and aliased).
    reserved = first.reserved_bytes
    assert reserved == first.temp_bytes + first.output_bytes - first.alias_bytes
    assert 0 < reserved < first_pages * page_bytes
    assert first_pages == int(free // page_bytes)
    assert pages == report.num_pages == int((free - reserved) // page_bytes) < first_pages


@needs_libtpu
def test_int8_weights_are_reported_by_dtype_and_priced_at_their_size(tmp_path):
    """`--quantization int8`: the params by dtype (int8 kernels, f32 scales, the bf16 embedding
    and head), and a batch-1 floor below the bf16 model's by the decoder's saved bytes."""
    common = ("--target", "v5e:1x1", "--model", "llama-tiny", "--max-num-seqs", "4",
              "--max-num-batched-tokens", "16", "--buckets", "1")  # fmt: skip
    proc, bf16 = _compile(*common, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc, int8 = _compile(*common, "--quantization", "int8", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int8["quantization"] == "int8 weight-only" and bf16["quantization"] == "none"
    by_dtype = int8["param_bytes_by_dtype"]
    assert set(by_dtype) == {"bfloat16", "int8", "float32"} and "int8" in proc.stdout
    from checkpoints import NAMED_SHAPES
    from jaxserve.runtime.roofline import layer_weights

    model = NAMED_SHAPES["llama-tiny"]
    decoder = model.num_layers * layer_weights(model)  # elements of the quantized kernels
    assert by_dtype["int8"] == decoder
    assert by_dtype["bfloat16"] == bf16["param_bytes_per_device"] - 2 * decoder
    saved = bf16["buckets"][0]["floor_bytes"] - int8["buckets"][0]["floor_bytes"]
    assert saved == pytest.approx(decoder)  # 2 bytes a weight -> 1


def test_a_pool_that_cannot_hold_one_sequence_does_not_fit():
    """The weights may fit while the pool beside them holds less than one max_model_len
    sequence (bf16 Llama-3.1-8B on a v5e: 1 page): not a model that serves."""
    from jaxserve.runtime.aot import BucketReport, CompileReport

    def report(num_pages):
        bucket = BucketReport(num_tokens=1, num_seqs=1, compiled=True, argument_bytes=10)
        return CompileReport(
            target="v5e:1x1", platform="tpu", device_kind="TPU v5 lite", num_devices=1,
            model="m", dtype="bfloat16", attention_backend="pallas_tpu", layer_loop="scan",
            num_pages=num_pages, page_size=16, pool_bytes_per_device=0, pool_padding=1.0,
            param_bytes_per_device=0, hbm_bytes_per_device=100, buckets=[bucket],
            max_model_len=4096,
        )  # fmt: skip

    assert not report(255).fits and not report(255).ok and not report(255).holds_a_sequence
    assert report(256).fits and report(256).ok
    assert report(256).to_json()["holds_a_sequence"] is True


@needs_libtpu
@pytest.mark.parametrize(
    "target, scheme, label, kernel_dtype",
    [
        ("v5e:1x1", "int8-w8a8", "int8 W8A8", "int8"),
        ("v6e:1x1", "int8-w8a8", "int8 W8A8", "int8"),
        ("tpu7x:1x1x1", "fp8", "fp8 W8A8", "float8_e4m3fn"),  # TPU7x has fp8 matmuls
        ("v5e:1x1", "fp8", "fp8 weight-only", "float8_e4m3fn"),  # v5e has none: said so
    ],
)
def test_each_scheme_compiles_for_the_tpus_that_run_it(
    tmp_path, target, scheme, label, kernel_dtype
):
    """Every scheme's step compiles for the TPUs it resolves to there, with its 8-bit kernels
    among the params, and the fallback (fp8 weight-only without fp8 matmuls) printed."""
    proc, report = _compile(
        "--target", target, "--model", "llama-tiny", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "16", "--buckets", "1,16", "--quantization", scheme,
        tmp_path=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert report["quantization"] == label
    assert kernel_dtype in report["param_bytes_by_dtype"]
    assert all(b["compiled"] for b in report["buckets"])
    falls_back = label.endswith("weight-only") and scheme == "fp8"
    assert (report["quantization_note"] is not None) == falls_back
    if falls_back:
        assert "no fp8 matmuls" in report["quantization_note"]
