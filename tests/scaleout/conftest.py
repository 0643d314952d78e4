"""Scale-out tests: on 4 simulated CPU devices, a flag XLA reads only when JAX starts.

`python -m pytest tests/scaleout` sets the flag itself (the session holds nothing else, so no
device has been touched yet). In a wider session (`python -m pytest` from the root) JAX starts
with one device: the tests here are deselected and `test_suite.py` reruns this folder in a
subprocess that has the flag. A session started with the flag already set runs them in place.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DEVICES = 4
DEVICE_FLAG = f"--xla_force_host_platform_device_count={DEVICES}"
HERE = Path(__file__).resolve().parent


def with_device_flag(env: dict[str, str], devices: int = DEVICES) -> dict[str, str]:
    """`env` with XLA_FLAGS asking for `devices` host devices (replacing any count given)."""
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    return {
        **env,
        "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
    }


def pytest_configure(config: pytest.Config) -> None:
    paths = [Path(str(arg).split("::")[0]).resolve() for arg in config.args]
    only_here = bool(paths) and all(p == HERE or HERE in p.parents for p in paths)
    if only_here and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ.update(with_device_flag(dict(os.environ)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without the devices, leaves this folder's tests to test_suite.py's subprocess."""
    import jax

    if jax.device_count() >= DEVICES:
        return
    mine = [
        item
        for item in items
        if HERE in Path(str(item.path)).parents and Path(str(item.path)).name != "test_suite.py"
    ]
    if mine:
        config.hook.pytest_deselected(items=mine)
        items[:] = [item for item in items if item not in mine]
