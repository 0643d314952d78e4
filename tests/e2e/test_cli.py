"""`jaxserve generate`, `convert` and `serve` flags as a user runs them: real output."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from checkpoints import DEFAULT_MODEL_DIR
from jaxserve.cli import main
from jaxserve.cli.serve import _chat_template


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_generate_prints_the_story():
    proc = run_cli("generate", "Once upon a time", "--max-tokens", "40")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(
        "Once upon a time, there was a little girl named Lily. She loved to play outside"
    )
    assert "Traceback" not in proc.stderr


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """`jaxserve ARGS` in this process: for errors found after the real processes above showed
    that starting JAX and loading a model print nothing else (each process costs seconds)."""
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("jaxserve: error:")
    for needle in needles:
        assert needle in lines[0]


def test_missing_model_folder_is_one_line_error(tmp_path):
    missing = tmp_path / "no_such_model"
    _assert_one_line_error(
        run_cli("generate", "hi", "--model", str(missing)), str(missing), "does not exist"
    )


def test_unsupported_architecture_is_one_line_error(tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(config))
    _assert_one_line_error(
        run_cli("generate", "hi", "--model", str(folder)),
        "Unsupported architecture",
        "GPT2LMHeadModel",
    )


def test_prompt_longer_than_context_is_one_line_error():
    prompt = "Once upon a time " * 200
    _assert_one_line_error(run_cli("generate", prompt), "context is 512 tokens")


@pytest.mark.parametrize("args", [["--max-tokens", "0"], ["--temperature", "-1"]])
def test_bad_sampling_flags_are_one_line_errors(args, capsys):
    _assert_one_line_error(run_main(capsys, "generate", "hi", *args))


def test_chat_template_flag_takes_a_file_or_a_template_and_refuses_neither(tmp_path, capsys):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    assert _chat_template(str(path)) == template
    assert _chat_template(template) == template
    _assert_one_line_error(
        run_main(capsys, "serve", "--chat-template", str(tmp_path / "missing.jinja")),
        "missing.jinja",
        "neither a file nor a Jinja template",
    )
    _assert_one_line_error(
        run_main(capsys, "serve", "--chat-template", "{% for m in messages %}{{ m }"),
        "does not compile as a Jinja template",
    )


def test_convert_then_generate_from_the_orbax_folder(tmp_path, capsys):
    out = tmp_path / "converted"
    proc = run_cli("convert", str(DEFAULT_MODEL_DIR), str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "jaxserve.json").exists()
    proc = run_cli("generate", "Once upon a time", "--max-tokens", "12", "--model", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Once upon a time, there was a little girl named Lily")
    again = run_main(capsys, "convert", str(DEFAULT_MODEL_DIR), str(out))
    _assert_one_line_error(again, "already holds a checkpoint")
