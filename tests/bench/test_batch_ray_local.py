"""`jaxserve batch --ray` with no address starts a Ray cluster of its own: on the loopback
address only, whatever the environment points Ray at, and leaves nothing of that set-up behind.

A module of its own: the job must find no Ray connected in the process (test_batch_ray.py's
module cluster is shut down when that module ends).
"""

from __future__ import annotations

import collections
import os

from tests.bench.test_batch_ray import CONFIG, _records, _write_input, listening_beyond_loopback
from tests.bench.test_batch_ray import needs_ray as _needs_ray


@_needs_ray
def test_a_job_without_an_address_runs_on_a_loopback_cluster_of_its_own(
    tiny_engine, tmp_path, monkeypatch
):
    import ray
    from ray._private import ray_constants

    from jaxserve.jobs.ray_replicas import run_ray

    assert not ray.is_initialized()
    enabled = ray_constants.ENABLE_RAY_CLUSTER
    # An address in the environment (or a stale ray_current_cluster file) must not send a
    # job that asked for a cluster of its own to another one.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    seen = []

    def look(summary):
        if not seen:
            seen.append((ray.util.get_node_ip_address(), listening_beyond_loopback()))

    n = 6
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp, n)
    summary = run_ray(inp, out, config=CONFIG, replicas=1, progress=False, on_progress=look)
    assert seen == [("127.0.0.1", [])]
    assert collections.Counter(r["id"] for r in _records(out)) == {f"p{i}": 1 for i in range(n)}
    assert summary.completed == n
    # The cluster is gone, and Ray in this process is as it was: a later ray.init() may join
    # a cluster elsewhere.
    assert not ray.is_initialized()
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
    assert enabled == ray_constants.ENABLE_RAY_CLUSTER  # as it was
