"""Engine death is visible to supervisors: streams end with INTERNAL at once, health turns
NOT_SERVING, and `jaxserve serve` exits non-zero after its grace period (issue 15, item 6)."""

from __future__ import annotations

import concurrent.futures
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from service.grpc.client import JaxServeClient
from service.server import EXIT_ENGINE_FAILED
from tests.service.conftest import SMALL_FLAGS, wait_until
from tests.service.failing_serve import FAULT
from tests.service.test_sigterm import _next_log, _read_logs

ROOT = pathlib.Path(__file__).resolve().parents[2]
STREAM = dict(max_tokens=200, temperature=0.0, ignore_eos=True)


def _ends(stream) -> tuple[float, grpc.RpcError | None]:
    """When the stream ended, and with what error (None: it finished)."""
    try:
        for _ in stream:
            pass
    except grpc.RpcError as e:
        return time.monotonic(), e
    return time.monotonic(), None


@pytest.mark.parametrize("stay_up", [False, True], ids=["exits", "stays-up"])
def test_device_step_failure_ends_streams_with_internal_and_serve_exits_nonzero(tmp_path, stay_up):
    """By default the process exits with EXIT_ENGINE_FAILED; with --stay-up-on-engine-failure
    it lingers past the grace period, answering INTERNAL, until signalled."""
    trigger = tmp_path / "fail-now"
    cmd = [
        sys.executable,
        "-m",
        "tests.service.failing_serve",
        str(trigger),
        "--port=0",
        "--no-metrics",
        "--grace-period=1",  # short: the waits below are multiples of it
        *SMALL_FLAGS,
        *(["--stay-up-on-engine-failure"] if stay_up else []),
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_logs, args=(proc.stderr, lines), daemon=True).start()
    try:
        port = _next_log(lines, "listening", timeout=120)["port"]
        with JaxServeClient(f"127.0.0.1:{port}") as c:
            wait_until(lambda: _health(c) == "SERVING", timeout=300, interval=0.05)
            streams = [iter(c.generate("Once upon a time", timeout=60, **STREAM)) for _ in range(4)]
            for s in streams:
                next(s)  # all four are running
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                ends = [pool.submit(_ends, s) for s in streams]
                failed_at = time.monotonic()
                trigger.touch()
                results = [e.result() for e in ends]
            for ended_at, error in results:
                assert error is not None and error.code() == grpc.StatusCode.INTERNAL
                assert FAULT in error.details()
                assert ended_at - failed_at < 1.0, f"ended {ended_at - failed_at:.2f}s late"
            # NOT_SERVING, or already gone (or going: a server stopping mid-call cancels the
            # call): never SERVING again.
            gone = ("UNAVAILABLE",) if stay_up else ("UNAVAILABLE", "CANCELLED")
            assert _health(c) in ("NOT_SERVING", *gone)
            if stay_up:
                with pytest.raises(subprocess.TimeoutExpired):
                    proc.wait(2)  # twice the grace period
                assert _health(c) == "NOT_SERVING"
                with pytest.raises(grpc.RpcError) as err:
                    c.generate_unary("Once upon a time", max_tokens=2, timeout=10)
                assert err.value.code() == grpc.StatusCode.INTERNAL
                proc.send_signal(signal.SIGTERM)
        status = proc.wait(30)  # grace period 1 s, then out
        if stay_up:
            assert status == 0
        else:
            assert status == EXIT_ENGINE_FAILED != 0
            assert _next_log(lines, "exiting after the engine failure", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _health(c: JaxServeClient) -> str:
    try:
        return c.health(timeout=5)
    except grpc.RpcError as e:
        return e.code().name
