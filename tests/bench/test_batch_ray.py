"""`jaxserve batch --ray`: two CPU replicas of stories260k on a local Ray cluster.

The same texts as the single-process job, every id exactly once when a replica or the driver is
killed mid-run, and one clear line without Ray. One cluster serves the module (2 CPUs, one per
replica), bound to the loopback address only, as every local cluster jaxserve starts. The
replicas' engines are tiny_engine's and use its compilation cache, so they load their buckets
instead of compiling them again.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxserve.engine_config import EngineConfig, default_compilation_cache_dir
from jaxserve.jobs.batch_job import run_batch
from tests.bench.conftest import TINY

needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="Ray is an optional extra (pip install 'jaxserve[ray]')",
)
# Each replica's engine is tiny_engine's: the same buckets, so the same arithmetic per request.
CONFIG = EngineConfig(max_model_len=128, show_progress=False, **TINY)
CLI_FLAGS = [
    "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--min-token-bucket", "8",
    "--seq-bucket-factor", "4", "--max-model-len", "128", "--no-progress",
]  # fmt: skip
if CONFIG.compilation_cache_dir:
    CLI_FLAGS += ["--compilation-cache-dir", default_compilation_cache_dir()]


def _write_input(path, n, max_tokens=None):
    """Greedy lines and seeded sampled lines of varied lengths (so they finish out of order)."""
    with open(path, "w") as f:
        for i in range(n):
            line = {"id": f"p{i}", "prompt": f"Once upon a time {i}", "ignore_eos": True}
            line["max_tokens"] = max_tokens or 4 + (i * 7) % 17
            if i % 2:
                line |= {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}
            f.write(json.dumps(line) + "\n")


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def listening_beyond_loopback() -> list[str]:
    """Each socket, as "ADDRESS:PORT name", that this process or any below it (a local Ray
    cluster's GCS, raylets and workers) listens on at an address other than the loopback."""
    import psutil

    me = psutil.Process()
    found = []
    for proc in [me, *me.children(recursive=True)]:
        try:
            sockets = proc.net_connections(kind="inet")
            name = proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in sockets:
            host = c.laddr.ip.removeprefix("::ffff:")
            if c.status == psutil.CONN_LISTEN and host not in ("127.0.0.1", "::1"):
                found.append(f"{c.laddr.ip}:{c.laddr.port} {name}")
    return found


@pytest.fixture(scope="module")
def cluster(tiny_engine) -> str:
    """A local Ray cluster for the module, after tiny_engine filled the compilation cache."""
    import ray

    from jaxserve.jobs.ray_replicas import local_cluster

    with local_cluster(ray, num_cpus=2, object_store_memory=100 << 20):
        yield ray.get_runtime_context().gcs_address


@needs_ray
def test_the_local_cluster_listens_on_the_loopback_address_only(cluster):
    import ray

    assert cluster.startswith("127.0.0.1:")
    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
    assert ray.get(ray.remote(ray.util.get_node_ip_address).remote()) == "127.0.0.1"
    assert listening_beyond_loopback() == []


@needs_ray
def test_two_replicas_write_every_id_once_with_the_single_process_texts(
    cluster, tiny_engine, tmp_path
):
    from jaxserve.jobs.ray_replicas import run_ray

    n = 200
    inp = tmp_path / "in.jsonl"
    _write_input(inp, n)
    run_batch(tiny_engine, inp, tmp_path / "single.jsonl", progress=False)
    summary = run_ray(
        inp, tmp_path / "ray.jsonl", config=CONFIG, replicas=2, min_ready=2, progress=False
    )

    records = _records(tmp_path / "ray.jsonl")
    assert collections.Counter(r["id"] for r in records) == {f"p{i}": 1 for i in range(n)}
    single = {r["id"]: r for r in _records(tmp_path / "single.jsonl")}
    assert {r["id"]: r for r in records} == single  # texts, token counts, finish reasons
    assert summary.completed == n and summary.output_tokens == sum(
        r["output_tokens"] for r in records
    )
    shares = [s.completed for s in summary.replicas]
    queue = 2 * CONFIG.max_num_seqs
    assert sum(shares) == n and min(shares) >= queue, shares  # both filled from the start
    assert all(0 < s.most_held <= queue for s in summary.replicas)  # backpressure held
    assert len({s.pid for s in summary.replicas}) == 2


@needs_ray
def test_a_killed_replica_hands_its_lines_to_the_other(cluster, tmp_path):
    """Deterministic however loaded the machine: lines go out only once both replicas are
    ready (min_ready=2), so replica 0 holds a full queue of lines no other replica can finish,
    and it is killed at its first results, before it could have finished them all (4 slots,
    8 lines), with the job far from done (it finished only what it returned)."""
    from jaxserve.jobs.ray_replicas import run_ray

    n = 80
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp, n, max_tokens=24)
    killed = []

    def kill_replica_0(summary):
        victim = summary.replicas[0]
        if not killed and victim.completed >= 1:
            os.kill(victim.pid, signal.SIGKILL)  # a crash: no clean shutdown, no last word
            killed.append(summary.completed)

    summary = run_ray(
        inp,
        out,
        config=CONFIG,
        replicas=2,
        min_ready=2,
        progress=False,
        on_progress=kill_replica_0,
    )
    assert killed and killed[0] < n, "the kill must land mid-run"
    assert summary.replicas[0].failed is not None and summary.replicas[1].failed is None
    assert summary.retried_lines > 0  # it held lines when it died; they ran on replica 1
    counts = collections.Counter(r["id"] for r in _records(out))
    assert counts == {f"p{i}": 1 for i in range(n)}
    assert summary.completed == n


@needs_ray
def test_sigkill_of_the_driver_then_rerun_leaves_exactly_one_line_per_id(cluster, tmp_path):
    n = 120
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp, n, max_tokens=24)
    command = [
        sys.executable, "-m", "jaxserve.cli", "batch", str(inp), str(out), *CLI_FLAGS,
        "--ray", cluster, "--replicas", "2",
    ]  # fmt: skip
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while first.poll() is None and time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= 10:
            break
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert first.returncode == -signal.SIGKILL, first.stderr.read().decode()[-2000:]
    written = out.read_bytes().count(b"\n")
    assert 10 <= written < n, "the kill must land mid-run"

    # Ray ends the dead driver's replicas; the rerun waits for their CPUs and resumes.
    second = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"resuming, {written} results already written" in second.stderr
    counts = collections.Counter(r["id"] for r in _records(out))
    assert counts == {f"p{i}": 1 for i in range(n)}


def test_without_ray_the_flag_fails_with_one_line_saying_how_to_install_it(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_input(inp, 2)
    hide_ray = (
        "import sys; sys.modules['ray'] = None; from jaxserve.cli import main; "
        f"sys.exit(main(['batch', {str(inp)!r}, {str(out)!r}, '--ray', '--replicas', '2']))"
    )
    done = subprocess.run([sys.executable, "-c", hide_ray], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "jaxserve: error: jaxserve batch --ray needs Ray, which is not installed: "
        "pip install 'jaxserve[ray]'."
    ]
    assert not out.exists()


def test_map_batches_callable_gives_the_single_process_texts_in_row_order(tiny_engine, tmp_path):
    from jaxserve.jobs.ray_replicas import BatchPredictor

    inp = tmp_path / "in.jsonl"
    _write_input(inp, 6)
    run_batch(tiny_engine, inp, tmp_path / "single.jsonl", progress=False)
    single = {r["id"]: r for r in _records(tmp_path / "single.jsonl")}
    rows = [json.loads(line) for line in inp.read_text().splitlines()]
    rows.insert(2, {"id": "bad", "prompt": "", "ignore_eos": True})  # refused, not fatal
    rows.append(dict(rows[0]))  # the same id twice in one batch: both run
    keys = sorted({k for row in rows for k in row})
    # What map_batches hands a callable: a dict of columns, None where a row lacks the key.
    batch = {k: np.array([row.get(k) for row in rows], dtype=object) for k in keys}

    out = BatchPredictor(CONFIG)(batch)
    assert list(out["id"]) == [row["id"] for row in rows]
    for i, row in enumerate(rows):
        if row["id"] == "bad":
            assert out["finish_reason"][i] == "error" and "non-empty" in out["error"][i]
            continue
        assert out["error"][i] is None
        want = single[row["id"]]
        assert out["text"][i] == want["text"]
        assert out["output_tokens"][i] == want["output_tokens"] == row["max_tokens"]


def _as_ray_data_hands_them(rows: list[dict]) -> dict:
    """The columns `map_batches` hands a callable for `rows`, as measured with Ray 2.60 and
    pyarrow 26 (ray.data.from_items(rows).map_batches(...), numpy batches): a numeric column
    that some rows lack is float64 with NaN there, integers included (seed 1001 arrives as
    1001.0); a list column holds each row's list as a numpy array; any other column is
    objects, None where a row lacks the key."""
    batch = {}
    for key in sorted({k for row in rows for k in row}):
        values = [row.get(key) for row in rows]
        present = [v for v in values if v is not None]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
            if len(present) == len(values) and all(isinstance(v, int) for v in present):
                batch[key] = np.array(values, np.int64)
            else:
                batch[key] = np.array([np.nan if v is None else v for v in values], np.float64)
            continue
        column = np.empty(len(values), dtype=object)
        for i, v in enumerate(values):  # one by one: a list must stay one array per row
            if isinstance(v, list):
                v = np.array(v, dtype=object if any(isinstance(x, str) for x in v) else None)
            column[i] = v
        batch[key] = column
    return batch


def test_map_batches_rows_with_missing_values_run_as_their_input_lines(tiny_engine, tmp_path):
    """Rows that lack some sampling keys, as Ray Data fills them: NaN in a float column, an
    integer column turned float (seeds), lists as numpy arrays (stop strings). Each row runs
    as its input line runs in `jaxserve batch`, none refused."""
    from jaxserve.jobs.ray_replicas import BatchPredictor

    inp = tmp_path / "in.jsonl"
    _write_input(inp, 6)  # odd lines seeded and sampled, even ones greedy with no seed
    rows = [json.loads(line) for line in inp.read_text().splitlines()]
    rows[2]["stop"] = [" the", "."]
    rows[3]["stop"] = ["."]
    rows[4] = {"id": "ids", "prompt_token_ids": [1, 403, 407, 261], "max_tokens": 6}
    inp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_batch(tiny_engine, inp, tmp_path / "single.jsonl", progress=False)
    single = {r["id"]: r for r in _records(tmp_path / "single.jsonl")}
    assert single["p2"]["finish_reason"] == "stop"  # its stop strings matter
    batch = _as_ray_data_hands_them(rows)
    assert batch["seed"].dtype == np.float64 and np.isnan(batch["temperature"][0])

    out = BatchPredictor(CONFIG)(batch)
    assert list(out["error"]) == [None] * len(rows)
    for i, row in enumerate(rows):
        want = single[row["id"]]
        assert out["text"][i] == want["text"], row
        assert out["output_tokens"][i] == want["output_tokens"], row
        assert out["finish_reason"][i] == want["finish_reason"], row
