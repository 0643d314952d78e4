"""Runs this folder in a subprocess with 4 host devices when the session itself has fewer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.scaleout.conftest import DEVICES, HERE, with_device_flag


def test_scaleout_suite_on_four_cpu_devices():
    import jax

    if jax.device_count() >= DEVICES:
        pytest.skip("this session has the devices: the scale-out tests run in place")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE)],
        cwd=HERE.parent.parent,
        env=with_device_flag(dict(os.environ)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    # Every test ran there: none was left out for want of devices.
    assert " passed" in proc.stdout and "deselected" not in proc.stdout, proc.stdout[-3000:]
