"""`jaxserve batch`: SIGKILL mid-run and resume, and bad input lines, on stories260k."""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
import time

import pytest

from jaxserve.engine_config import default_compilation_cache_dir
from jaxserve.jobs.batch_job import BatchInputError, run_batch

TINY_FLAGS = [
    "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--min-token-bucket", "8",
    "--seq-bucket-factor", "4", "--max-model-len", "128", "--no-progress",
]  # fmt: skip


def _write_input(path, n, bad_line_at):
    lines = []
    for i in range(n):
        lines.append(
            json.dumps(
                {
                    "id": f"p{i}",
                    "prompt": f"Once upon a time {i}",
                    "max_tokens": 64,
                    "ignore_eos": True,
                }
            )
        )
    lines.insert(bad_line_at - 1, '{"id": "broken", "prompt": ')
    path.write_text("\n".join(lines) + "\n")


def _batch(inp, out):
    # The suite's compilation cache: these flags are the `tiny_engine` fixture's shapes, so one
    # compile serves both runs here and that fixture (or loads what it compiled).
    cache = default_compilation_cache_dir()
    return [
        sys.executable,
        "-m",
        "jaxserve.cli",
        "batch",
        str(inp),
        str(out),
        *TINY_FLAGS,
        *(["--compilation-cache-dir", cache] if cache else []),
    ]


def _output_lines(path) -> list[bytes]:
    return path.read_bytes().split(b"\n") if path.exists() else []


def test_sigkill_mid_run_then_rerun_leaves_exactly_one_line_per_id(tmp_path):
    n = 40
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp, n, bad_line_at=12)
    first = subprocess.Popen(_batch(inp, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while len(_output_lines(out)) < 4 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert first.returncode == -signal.SIGKILL, first.stderr.read().decode()[-2000:]
    written = [line for line in _output_lines(out) if line]
    assert 3 <= len(written) < n, "the kill must land mid-run"
    # What a kill during a write would leave behind: half a line, no newline.
    with open(out, "ab") as f:
        f.write(b'{"id": "p39", "text": "Once')

    second = subprocess.run(_batch(inp, out), capture_output=True, text=True, timeout=300)
    assert second.returncode == 1, second.stderr[-2000:]  # 1: a bad line was skipped
    assert "torn last line" in second.stderr and "resuming" in second.stderr
    assert "in.jsonl:12: not valid JSON" in second.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    counts = collections.Counter(r["id"] for r in records)
    assert counts == {f"p{i}": 1 for i in range(n)}
    assert all(r["output_tokens"] == 64 and r["finish_reason"] == "length" for r in records)
    assert all(r["text"] and r["prompt_tokens"] > 0 for r in records)


@pytest.mark.parametrize(
    "garbled",
    [
        b"\0" * 40,  # a file system that zero-fills the last block after a crash
        b'{"id": "p5", "text": "Once up',  # a line's head, then a newline from elsewhere
        b"[1, 2]",  # JSON, but no record
        b'{"text": "no id"}',  # an object without an id
    ],
    ids=["zeros", "head-only", "not-a-record", "no-id"],
)
def test_a_complete_but_garbled_last_line_is_cut_and_its_request_runs_again(
    tiny_engine, tmp_path, garbled
):
    """A last line that has its newline but is no result (a crash can leave that too) is cut
    like a torn one, not kept under the lines a rerun appends (where the next resume would
    refuse the file as not ours); every id then ends up on exactly one line."""
    n = 6
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": f"Once upon a time {i}", "max_tokens": 4}) + "\n"
            for i in range(n)
        )
    )
    run_batch(tiny_engine, inp, out, progress=False)
    kept = out.read_bytes().split(b"\n")[:3]
    out.write_bytes(b"\n".join(kept) + b"\n" + garbled + b"\n")
    said = []
    summary = run_batch(tiny_engine, inp, out, progress=False, log=said.append)
    assert summary.repaired_tail and summary.already_done == 3 and summary.completed == n - 3
    assert any("cut off a torn last line" in line for line in said), said
    records = [json.loads(line) for line in out.read_text().splitlines()]  # every line a result
    assert collections.Counter(r["id"] for r in records) == {f"p{i}": 1 for i in range(n)}
    again = run_batch(tiny_engine, inp, out, progress=False)  # resumable: nothing left to run
    assert again.already_done == n and again.completed == 0 and not again.repaired_tail


BAD_INPUT = [
    '{"id": "a", "prompt": "Once upon a time", "max_tokens": 5}',
    "not json {",  # 2
    '{"id": "b", "prompt_token_ids": [1, 5, 9], "max_tokens": 4}',
    '{"id": "c"}',  # 4: no prompt
    "",  # blank: carries no request, not an error
    '{"id": "a", "prompt": "again", "max_tokens": 3}',  # 6: duplicate id
    '{"id": "d", "prompt": "Hi", "max_tokens": 0}',  # 7: bad value
    json.dumps({"id": "e", "prompt_token_ids": [5] * 200, "max_tokens": 2}),  # 8: too long
    "[1, 2, 3]",  # 9: not an object
    '{"prompt": "The dog", "max_tokens": 3}',  # id from the line number
]


def test_bad_lines_are_reported_with_line_numbers_and_skipped(tiny_engine, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(BAD_INPUT) + "\n")
    summary = run_batch(tiny_engine, inp, out, progress=False)
    assert [n for n, _ in summary.bad_lines] == [2, 4, 6, 7, 8, 9]
    err = capsys.readouterr().err
    for n, reason in summary.bad_lines:
        assert f"in.jsonl:{n}: {reason}; skipped" in err
    assert "duplicate id 'a' (first on line 1)" in err
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"a", "b", "line-10"}
    assert records["b"]["output_tokens"] == 4 and records["b"]["prompt_tokens"] == 3


def test_stop_on_error_ends_at_the_first_bad_line_keeping_finished_work(tiny_engine, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(BAD_INPUT) + "\n")
    with pytest.raises(BatchInputError, match=r"in.jsonl line 2: not valid JSON"):
        run_batch(tiny_engine, inp, out, stop_on_error=True, progress=False)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a"]
    assert not tiny_engine.has_unfinished()


def test_a_line_with_structured_outputs_is_constrained_and_a_bad_one_skipped(tiny_engine, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"id": f"j{i}", "prompt": "Once", "max_tokens": 48, "temperature": 1.0, "seed": i,
         "structured_outputs": {"regex": "[0-9]{2}-[a-c]{3}"}}
        for i in range(3)
    ]  # fmt: skip
    lines.append(
        {
            "id": "c",
            "prompt": "Once",
            "max_tokens": 8,
            "structured_outputs": {"choice": ["up", "down"]},
        }
    )
    lines.append(
        {"id": "bad", "prompt": "Once", "max_tokens": 8, "structured_outputs": {"regex": "[b-a]"}}
    )
    inp.write_text("\n".join(map(json.dumps, lines)) + "\n")
    summary = run_batch(tiny_engine, inp, out, progress=False)
    assert [n for n, _ in summary.bad_lines] == [5]
    assert "regex" in summary.bad_lines[0][1]
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"j0", "j1", "j2", "c"}
    import re

    assert all(re.fullmatch("[0-9]{2}-[a-c]{3}", records[f"j{i}"]["text"]) for i in range(3))
    assert records["c"]["text"] in ("up", "down")
