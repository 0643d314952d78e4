"""The multi-host path on one machine: two controller processes (2 CPU devices each) joined by
jax.distributed serve one tensor-parallel-4 engine; process 0 schedules and sends each step,
process 1 follows. Their tokens equal a one-process, one-device engine's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from tests.scaleout import multihost_worker
from tests.scaleout.conftest import HERE, with_device_flag


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_pair(tmp_path, *mode: str) -> dict:
    """Both processes of multihost_worker to the end; process 0's JSON."""
    port, out = _free_port(), tmp_path / "tokens.json"
    env = with_device_flag(dict(os.environ), devices=2)
    worker = [sys.executable, "-m", "tests.scaleout.multihost_worker", str(port)]
    procs = [
        subprocess.Popen(
            [*worker, str(i), str(out), *mode],
            cwd=HERE.parent.parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i}:\n{logs[i][-4000:] if i < len(logs) else ''}"
    return json.loads(out.read_text())


def test_two_processes_serve_one_tensor_parallel_engine(tmp_path):
    got = _run_pair(tmp_path)
    alone = Engine(EngineConfig(**multihost_worker.CONFIG))  # one process, one device
    assert got["tokens"] == multihost_worker.generate(alone)
    assert got["num_pages"] == alone.runner.config.num_pages


def test_process_0_dispatches_each_step_while_the_one_before_runs(tmp_path):
    """Asynchronous scheduling across hosts: sending a step to the followers must not wait for
    the step in flight. Process 1 dispatches each step 0.3 s after it gets it, so every step
    runs at least that long; process 0, planning in well under that, must find the step before
    still running at every dispatch (it found it ended, every time, while the plan went by a
    device collective queued behind the step)."""
    got = _run_pair(tmp_path, "slow-follower")
    overlap = got["overlap"]
    assert len(overlap) >= 7, overlap  # 8 decode steps after the prefill
    assert all(overlap), f"the step before had ended at dispatches {overlap}"
