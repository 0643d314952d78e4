"""`jaxserve serve` as a real process: warm-up, then SIGTERM during 8 streams drains and exits 0."""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from service.grpc.client import JaxServeClient
from tests.service.conftest import SMALL_FLAGS, wait_until

# Long enough to be mid-stream through the SIGTERM, the health poll and the refused call.
STREAM = dict(max_tokens=400, temperature=0.0, ignore_eos=True)


@pytest.fixture
def serve_process():
    """A `jaxserve serve` process on free ports; yields (process, log lines queue, grpc port)."""
    cmd = [
        sys.executable,
        "-m",
        "jaxserve.cli",
        "serve",
        "--port=0",
        "--metrics-port=0",
        "--grace-period=60",
        *SMALL_FLAGS,
        "--max-model-len=512",  # the last flag wins: room for long streams
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_read_logs, args=(proc.stderr, lines), daemon=True)
    reader.start()
    try:
        listening = _next_log(lines, "listening", timeout=60)
        yield proc, lines, listening["port"]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _read_logs(stream, lines: queue.Queue) -> None:
    for line in stream:
        try:
            lines.put(json.loads(line))
        except json.JSONDecodeError:  # a third-party line that bypassed logging
            lines.put({"msg": line.rstrip()})


def _next_log(lines: queue.Queue, msg: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        entry = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        if entry.get("msg") == msg:
            return entry


def test_sigterm_during_8_streams_drains_them_and_exits_0(serve_process):
    proc, lines, port = serve_process
    with JaxServeClient(f"127.0.0.1:{port}") as c:
        statuses = []

        def health():
            try:
                statuses.append(c.health(timeout=5))
            except grpc.RpcError as e:  # before the health service answers at all
                statuses.append(e.code().name)
            return statuses[-1] == "SERVING"

        wait_until(health, timeout=120, interval=0.05)
        assert "NOT_SERVING" in statuses  # warm-up was seen, and it came first
        # Warm-up compiled the one step shape of SMALL (one token bucket), and only it.
        assert _next_log(lines, "serving", timeout=5)["compiles"] == 1

        calls = [c.generate("Once upon a time", timeout=120, **STREAM) for _ in range(8)]
        streams = [iter(call) for call in calls]
        firsts = [next(s) for s in streams]  # all 8 are running
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: c.health(timeout=5) == "NOT_SERVING", timeout=10)
        assert _next_log(lines, "draining", timeout=5)["calls_in_flight"] == 8
        with pytest.raises(grpc.RpcError) as err:
            c.generate_unary("Once upon a time", max_tokens=4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in err.value.details()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            rests = list(pool.map(list, streams))
        outputs = [
            [t for r in [f, *rest] for t in r.token_ids]
            for f, rest in zip(firsts, rests, strict=True)
        ]
        assert all(len(o) == STREAM["max_tokens"] for o in outputs)
        assert all(o == outputs[0] for o in outputs)  # greedy: the same story 8 times
        assert all(rest[-1].finish_reason for rest in rests)
    assert proc.wait(60) == 0
    _next_log(lines, "stopped", timeout=5)


def test_sigterm_during_warm_up_exits_0_without_an_abort():
    """SIGTERM while warm-up is still compiling: the server stops at once and the process exits
    0, rather than aborting in C++ at interpreter exit with the compile thread still in XLA."""
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port=0", "--metrics-port=0"]
    cmd += SMALL_FLAGS
    env = dict(os.environ, JAXSERVE_COMPILATION_CACHE="")  # no cache: warm-up really compiles
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_logs, args=(proc.stderr, lines), daemon=True).start()
    try:
        _next_log(lines, "listening", timeout=60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    seen = []
    while not lines.empty():
        seen.append(lines.get().get("msg", ""))
    assert "serving" not in seen  # it was stopped during warm-up, not after
    assert not any("terminate called" in m or "FATAL" in m for m in seen), seen
