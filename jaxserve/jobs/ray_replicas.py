"""`jaxserve batch --ray`: one resumable batch job over many engine replicas on a Ray cluster.

Batch jobs outgrow one host long before they outgrow one model replica; the scale-out is more
replicas, each its own engine over a share of the input, placed by an existing distributed
runtime (Ray) rather than a home-made one. Ray is an optional extra (`pip install
'jaxserve[ray]'`); nothing else in jaxserve imports this module.

What runs where, and what is bounded:
- The driver (the caller's thread) is the only reader of the input and the only writer of the
  output. It reuses batch_job.BatchRun, so resume, bad-line reports and durability are those of
  the single-process `jaxserve batch`: a rerun after a crash or a SIGKILL skips the ids already
  written and runs the rest.
- Each replica is a Ray actor (`_Replica`) holding one Engine, tensor-parallel over its K
  devices, fed through batch_job.EngineFeed (so a line gives the same record wherever it runs).
  The driver keeps at most one call in flight per replica: `work(new_lines)` queues the lines,
  steps the engine until some requests finish and returns their records. The engine's last step
  may still be running on the device when the call returns, so the round trip overlaps it.
- Backpressure: a replica never holds more than `queue_lines` lines (running and waiting), and
  the driver reads the input only to refill a replica with room, so no process's memory grows
  with the file.
- A cluster the job starts itself (no address) listens on the loopback address only and
  lives in a Ray temp folder of its own (`local_cluster`): a batch job opens no port to the
  network, and no file of an earlier cluster sends it elsewhere.
- Failures: a replica whose call fails (its actor or node died, or its engine raised) is
  dropped, and the lines it held go, first in line, to the others. Results reach the output only
  through the driver, and a dropped replica's results never arrive, so no id is written twice.
  With every replica gone the job stops with an error; a rerun resumes it.

Users with a Ray Data pipeline use `BatchPredictor` with `Dataset.map_batches` instead.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from jaxserve.engine_config import EngineConfig
from jaxserve.jobs.batch_job import BatchRun, BatchSummary, EngineFeed, Line, parse_line
from jaxserve.sampling_params import SamplingParams

RAY_MISSING = "jaxserve batch --ray needs Ray, which is not installed: pip install 'jaxserve[ray]'"


class RayMissing(ImportError):
    """Ray is not installed; the message says how to install it."""


def import_ray():
    """The `ray` module, or RayMissing with the one line that says how to install it."""
    try:
        import ray
    except ImportError:
        raise RayMissing(RAY_MISSING + ".") from None
    return ray


@dataclasses.dataclass
class ReplicaStats:
    """One replica's share of a job, and where it ran."""

    index: int
    host: str = ""
    pid: int = 0
    devices: list[str] = dataclasses.field(default_factory=list)
    ready_s: float = 0.0  # from the job's start until its engine was built and compiled
    completed: int = 0
    output_tokens: int = 0
    most_held: int = 0  # the most lines it held at once (running and queued)
    failed: str | None = None  # why it was dropped mid-job


@dataclasses.dataclass
class RayBatchSummary(BatchSummary):
    """BatchSummary plus each replica's share and the lines a failed replica handed back.

    `elapsed_s` counts from the first replica ready (start-up excluded, as in run_batch, whose
    engine is built before it starts); `startup_s` is the time until then.
    """

    startup_s: float = 0.0

    replicas: list[ReplicaStats] = dataclasses.field(default_factory=list)
    retried_lines: int = 0


class _Replica:
    """The body of one replica actor: an engine and the lines queued on it."""

    def __init__(self, config: EngineConfig, include_token_ids: bool):
        from jaxserve.engine.build import build_engine

        self.engine = build_engine(config)
        self.feed = EngineFeed(self.engine, include_token_ids)

    def info(self) -> dict:
        """Where this replica runs (for progress, the summary and tests that kill it)."""
        import socket

        devices = [str(d) for d in self.engine.sharding.mesh.devices.flat]
        return {"host": socket.gethostname(), "pid": os.getpid(), "devices": devices}

    def work(
        self, lines: list[Line], min_wait_s: float, max_wait_s: float, low_water: int
    ) -> tuple[list[dict], list[tuple[str, str]]]:
        """Queues `lines`, then steps until requests finish; (records, [(id, reason refused)]).

        Returns once something finished and either `min_wait_s` passed (fewer, larger round
        trips) or the queue ran down to `low_water` (refill before slots go idle); or after
        `max_wait_s` in any case, so the driver's progress stays fresh.
        """
        refused = [(line.id, r) for line in lines if (r := self.feed.add(line)) is not None]
        records: list[dict] = []
        start = time.monotonic()
        while self.engine.has_unfinished():
            records += self.feed.step()
            waited = time.monotonic() - start
            if waited >= max_wait_s or (
                records and (waited >= min_wait_s or len(self.feed) <= low_water)
            ):
                break
        return records, refused


# Ray reads it at import: "0" makes the loopback address the node's address (it is meant for
# laptops, where Ray otherwise binds only the loopback address anyway).
_CLUSTER_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_loopback(address: str | None) -> bool:
    """Whether `address` (HOST:PORT, or ray://HOST:PORT) names this machine's loopback."""
    host = (address or "").removeprefix("ray://").rpartition(":")[0].strip("[]")
    return host in _LOOPBACK


@contextlib.contextmanager
def loopback_only():
    """Inside: Ray in this process, and the processes it starts, take 127.0.0.1 as this node's
    address, and keep a given 127.0.0.1:PORT as it is.

    By default Ray on Linux takes the machine's outward address for a local cluster and binds
    every server (GCS, raylets, workers) to all interfaces, and rewrites a loopback address it
    is given to the outward one, which a loopback-only cluster does not answer. Its switch is
    an environment variable it reads when imported, so the value it read is set here too
    (a private constant: where a Ray version lacks it, `start_local_cluster` still checks the
    address the node got). Both are restored on exit.
    """
    from ray._private import ray_constants

    before = os.environ.get(_CLUSTER_VAR)
    had = hasattr(ray_constants, "ENABLE_RAY_CLUSTER")
    constant = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[_CLUSTER_VAR] = "0"  # the processes Ray starts read it when they import Ray
    if had:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_CLUSTER_VAR, None)
        else:
            os.environ[_CLUSTER_VAR] = before
        if had:
            ray_constants.ENABLE_RAY_CLUSTER = constant


@contextlib.contextmanager
def local_cluster(ray, **init_kwargs):
    """A new Ray cluster on this machine for the block, bound to the loopback address only,
    then shut down.

    Every local cluster jaxserve starts (`jaxserve batch --ray` without an address, the tests)
    starts here: a batch job has no reason to open ports on the network. It gets a Ray temp
    folder of its own, so no file left by an earlier cluster there (`ray_current_cluster`,
    which `ray.init()` without an address follows) can send it to another cluster, and
    `address="local"` ignores RAY_ADDRESS. Raises RuntimeError, with the cluster shut down, if
    Ray gave the node any other address.
    """
    temp_dir = tempfile.mkdtemp(prefix="jaxserve-ray-")
    try:
        with loopback_only():
            ray.init(address="local", include_dashboard=False, _temp_dir=temp_dir, **init_kwargs)
            try:
                node = ray.util.get_node_ip_address()
                if node != "127.0.0.1":
                    raise RuntimeError(
                        f"Ray gave the local cluster's node the address {node}, not 127.0.0.1, "
                        f"so it listens beyond this machine; this Ray ({ray.__version__}) no "
                        f"longer honours {_CLUSTER_VAR}=0 (jaxserve/jobs/ray_replicas.py)."
                    )
                yield
            finally:
                ray.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def _check_reachable(address: str | None) -> None:
    """ConnectionError at once for a HOST:PORT nothing listens on (ray.init would retry for
    minutes); other forms ("auto", "ray://...", None) are left to Ray."""
    import socket

    host, sep, port = (address or "").rpartition(":")
    if not sep or not port.isdigit() or "/" in address:
        return
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as e:
        raise ConnectionError(
            f"No Ray cluster answers at {address} ({e}); start one there with "
            f"`ray start --head --port={port}`, or give --ray no address for a local one."
        ) from None


def _actor_options(ray, devices_per_replica: int, cpus_per_replica: float) -> dict:
    """Ray resources for one replica: K GPUs or K TPU chips where the cluster has them (Ray then
    makes only those visible to the actor); on CPUs, K simulated devices."""
    have = ray.cluster_resources()
    options: dict = {"num_cpus": cpus_per_replica}
    if have.get("GPU", 0) > 0:
        options["num_gpus"] = devices_per_replica
    elif have.get("TPU", 0) > 0:
        options["resources"] = {"TPU": devices_per_replica}
    elif devices_per_replica > 1:
        flag = f"--xla_force_host_platform_device_count={devices_per_replica}"
        flags = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
        options["runtime_env"] = {"env_vars": {"XLA_FLAGS": flags}}
    return options


@dataclasses.dataclass
class _Handle:
    """The driver's view of one replica: its actor, its call in flight, the lines it holds."""

    actor: object
    stats: ReplicaStats
    ready: bool = False
    call: object | None = None  # the ObjectRef of the call in flight
    held: dict[str, Line] = dataclasses.field(default_factory=dict)


def run_ray(
    input_path: str | Path,
    output_path: str | Path,
    *,
    config: EngineConfig | None = None,
    replicas: int = 1,
    devices_per_replica: int = 1,
    address: str | None = None,
    defaults: SamplingParams | None = None,
    stop_on_error: bool = False,
    include_token_ids: bool = False,
    progress: bool = True,
    log=None,
    queue_lines: int | None = None,
    cpus_per_replica: float = 1.0,
    actor_options: dict | None = None,
    min_ready: int = 1,
    min_wait_s: float = 0.05,
    max_wait_s: float = 1.0,
    on_progress: Callable[[RayBatchSummary], None] | None = None,
) -> RayBatchSummary:
    """Runs every input line not yet in the output over `replicas` engines on Ray.

    `config` is each replica's EngineConfig (its tensor_parallel is set to
    `devices_per_replica`). `address`: a cluster to join ("auto": the one started on this
    machine with `ray start`); None starts a local one for this job, unless this process is
    already connected. `actor_options` (Ray's: runtime_env, accelerator_type,
    scheduling_strategy, ...) replace the replicas' defaults. `queue_lines` bounds the lines one
    replica holds (default 2 x max_num_seqs: every slot busy and as many waiting). Lines go
    out once `min_ready` replicas are ready (1: at once; all: even shares from the first line).
    `on_progress` is called with the summary so far each time results are written. Raises what
    run_batch raises, RayMissing without Ray, and RuntimeError once every replica has failed
    (the output holds what finished; rerun).
    """
    ray = import_ray()
    if replicas < 1 or devices_per_replica < 1:
        raise ValueError(f"{replicas=} and {devices_per_replica=} must both be >= 1.")
    config = dataclasses.replace(
        config or EngineConfig(),
        tensor_parallel=devices_per_replica,
        mesh_shape=None,
        show_progress=False,
    )
    queue = queue_lines or 2 * config.max_num_seqs
    with contextlib.ExitStack() as cluster:  # the cluster this job started, if any, ends last
        if not ray.is_initialized():  # before the output is touched: a wrong address changes
            _check_reachable(address)  # no file
            if address is None:
                cluster.enter_context(local_cluster(ray))
            else:
                if is_loopback(address):  # a cluster on this machine's loopback: kept as given
                    cluster.enter_context(loopback_only())
                ray.init(address=address, include_dashboard=False)
                cluster.callback(ray.shutdown)
        summary = RayBatchSummary()
        handles: list[_Handle] = []
        job: BatchRun | None = None
        try:
            job = BatchRun(
                input_path,
                output_path,
                defaults=defaults,
                stop_on_error=stop_on_error,
                progress=progress,
                log=log,
                summary=summary,
            )
            options = _actor_options(ray, devices_per_replica, cpus_per_replica)
            options |= actor_options or {}
            actor_class = ray.remote(_Replica).options(**options)
            for i in range(replicas):
                h = _Handle(actor_class.remote(config, include_token_ids), ReplicaStats(i))
                h.call = h.actor.info.remote()  # resolves once the engine is built and compiled
                handles.append(h)
            summary.replicas = [h.stats for h in handles]
            waits = (min_wait_s, max_wait_s, queue // 2)
            driver = _Driver(ray, job, handles, queue, waits, options)
            driver.run(min(min_ready, replicas), on_progress)
        finally:
            if job is not None:
                job.close()
            for h in handles:
                ray.kill(h.actor)
    if job.stop_error is not None:
        raise job.stop_error
    return summary


class _Driver:
    """The driver loop: refill replicas with room, write what comes back, requeue a failed
    replica's lines, until the input is read and nothing is held."""

    def __init__(self, ray, job: BatchRun, handles: list[_Handle], queue: int, waits, options):
        self.ray, self.job, self.handles, self.queue = ray, job, handles, queue
        self.waits, self.options = waits, options
        self.summary: RayBatchSummary = job.summary  # type: ignore[assignment]
        self.retry: collections.deque[Line] = collections.deque()  # a failed replica's lines
        self.last_error = ""
        self.started = job.start
        self.late_s = 120.0  # then say which replicas are still starting, again at 4x, 16x, ...

    def run(self, min_ready: int, on_progress) -> None:
        while True:
            live = [h for h in self.handles if h.stats.failed is None]
            ready = [h for h in live if h.ready]
            if len(ready) >= min(min_ready, len(live)):
                min_ready = 0  # once started, a replica that fails or lags stops nothing
                for h in ready:
                    if h.call is None:
                        self.refill(h)
            if not (self.retry or self.job.reading or any(h.held for h in live)):
                return  # all written; a replica still waiting for resources is not needed
            calls = {h.call: h for h in live if h.call is not None}
            if not calls:
                raise RuntimeError(
                    f"All {len(self.handles)} replicas failed, the last with: {self.last_error} "
                    "The output holds what finished; rerun the same command to resume."
                )
            self.warn_if_late(live)
            done, _ = self.ray.wait(list(calls), num_returns=1, timeout=1.0)
            for ref in done:
                h = calls[ref]
                h.call = None
                try:
                    result = self.ray.get(ref)
                except Exception as e:  # the actor, its node or its engine failed
                    self.drop(h, e)
                    continue
                if h.ready:
                    self.take(h, *result)
                    if on_progress is not None:
                        on_progress(self.summary)
                else:
                    self.mark_ready(h, result)
            self.show_rates()

    def refill(self, h: _Handle) -> None:
        lines: list[Line] = []
        while len(h.held) + len(lines) < self.queue:
            line = self.retry.popleft() if self.retry else self.job.next_line()
            if line is None:
                break
            lines.append(line)
        h.held.update((line.id, line) for line in lines)
        h.stats.most_held = max(h.stats.most_held, len(h.held))
        if h.held:  # with nothing held it idles until a failure hands lines back
            h.call = h.actor.work.remote(lines, *self.waits)

    def take(self, h: _Handle, records: list[dict], refused: list[tuple[str, str]]) -> None:
        for rid, reason in refused:
            self.job.reject(h.held.pop(rid), reason)
        for record in records:
            del h.held[record["id"]]
            h.stats.completed += 1
            h.stats.output_tokens += record["output_tokens"]
        self.job.write(records)

    def drop(self, h: _Handle, error: Exception) -> None:
        """A failed replica: its lines go first to the others; its results never arrive."""
        self.last_error = h.stats.failed = " ".join(str(error).split())[:500]
        self.retry.extend(h.held.values())
        self.summary.retried_lines += len(h.held)
        self.job.say(
            f"replica {h.stats.index} failed; {len(h.held)} lines go to the others: "
            f"{self.last_error[:200]}"
        )
        h.held.clear()
        self.ray.kill(h.actor)

    def mark_ready(self, h: _Handle, info: dict) -> None:
        h.ready = True
        now = time.perf_counter()
        h.stats.ready_s = now - self.started
        h.stats.host, h.stats.pid, h.stats.devices = info["host"], info["pid"], info["devices"]
        if not any(o.ready for o in self.handles if o is not h):  # rates count from here
            self.summary.startup_s, self.job.start = h.stats.ready_s, now

    def warn_if_late(self, live: list[_Handle]) -> None:
        if time.perf_counter() - self.started < self.late_s:
            return
        if waiting := [h.stats.index for h in live if not h.ready]:
            self.job.say(
                f"replicas {waiting} not ready after {self.late_s:.0f} s: still loading and "
                f"compiling, or waiting for resources (each asks {self.options}; the cluster "
                f"has {self.ray.available_resources()} free)"
            )
        self.late_s *= 4

    def show_rates(self) -> None:
        now = time.perf_counter() - self.started

        def rate(s: ReplicaStats) -> str:
            return "failed" if s.failed else f"{s.completed / max(now - s.ready_s, 1e-9):.1f}"

        each = ", ".join(f"r{h.stats.index} {rate(h.stats)}" for h in self.handles if h.ready)
        rates = f"{self.job.tokens_per_s():.1f} tok/s; lines/s {each}"
        self.job.bar.set_postfix_str(rates, refresh=False)


class BatchPredictor:
    """A Ray Data `map_batches` callable: one engine per actor, a batch of rows in, results out.

        ds = ray.data.read_json("prompts.jsonl")
        ds = ds.map_batches(BatchPredictor, fn_constructor_kwargs={"config": EngineConfig()},
                            concurrency=2, batch_size=64, num_cpus=1)   # num_gpus=K on GPUs

    Rows carry the keys of a `jaxserve batch` input line (prompt or prompt_token_ids, id,
    max_tokens, temperature, seed, ...); each batch comes back with its columns plus text,
    prompt_tokens, output_tokens, finish_reason and error (None, or why the row was not run).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        defaults: SamplingParams | None = None,
        include_token_ids: bool = False,
    ):
        from jaxserve.engine.build import build_engine

        self.engine = build_engine(config or EngineConfig(show_progress=False))
        self.feed = EngineFeed(self.engine, include_token_ids)
        self.defaults = defaults or SamplingParams(max_tokens=256, temperature=0.0)
        self.queue = 2 * self.engine.config.max_num_seqs

    def __call__(self, batch: dict) -> dict:
        """Generates for every row of `batch` (columns of equal length: numpy arrays or lists)."""
        import numpy as np

        columns = {k: (v.tolist() if hasattr(v, "tolist") else list(v)) for k, v in batch.items()}
        n = len(next(iter(columns.values()), []))
        results: list[dict] = [{} for _ in range(n)]
        lines: collections.deque[Line] = collections.deque()
        for i in range(n):
            row = {k: _plain(k, v[i]) for k, v in columns.items() if not _missing(v[i])}
            try:  # the same checks as an input line of `jaxserve batch`
                _, prompt, params, lora = parse_line(json.dumps(row).encode(), i + 1, self.defaults)
            except (TypeError, ValueError) as e:  # TypeError: a value JSON cannot hold
                results[i] = {"error": str(e)}
                continue
            lines.append(Line(i + 1, str(i), prompt, params, lora))  # row index: ids may repeat
        while lines or self.engine.has_unfinished():
            while lines and len(self.feed) < self.queue:
                line = lines.popleft()
                if (reason := self.feed.add(line)) is not None:
                    results[line.lineno - 1] = {"error": reason}
            for record in self.feed.step():
                results[int(record.pop("id"))] = record | {"error": None}
        out = dict(batch)
        out["text"] = np.array([r.get("text", "") for r in results], dtype=object)
        out["prompt_tokens"] = np.array([r.get("prompt_tokens", 0) for r in results], np.int64)
        out["output_tokens"] = np.array([r.get("output_tokens", 0) for r in results], np.int64)
        out["finish_reason"] = _objects([r.get("finish_reason", "error") for r in results])
        out["error"] = _objects([r.get("error") for r in results])
        if self.feed.include_token_ids:
            out["token_ids"] = _objects([r.get("token_ids", []) for r in results])
        return out


def _objects(values: list):
    """A 1-D object array of `values` (np.array would make equal-length lists a 2-D array)."""
    import numpy as np

    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):  # one by one: a slice would broadcast lists
        array[i] = value
    return array


def _missing(value) -> bool:
    """Ray Data fills a key some rows lack with None (or NaN in a float column)."""
    return value is None or (isinstance(value, float) and value != value)


# Keys whose values are integers. Ray Data hands an integer column that some rows lack as
# floats (measured, Ray 2.60 with pyarrow 26: seeds [1001, missing] arrive as [1001.0, nan]),
# which parse_line rightly refuses from a JSON line: here 1001.0 means 1001.
_INTEGER_KEYS = frozenset({"id", "max_tokens", "top_k", "seed", "beam_width"})


def _plain(key: str, value):
    """A row's value as a JSON input line would give it: a list for Ray Data's numpy array of
    a list column (a row's `stop` arrives as array(['.'], dtype=object)), and an int for an
    integral float under an integer key. Anything else is left for parse_line to judge."""
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        value = value.tolist()
    if key in _INTEGER_KEYS and isinstance(value, float) and value.is_integer():
        value = int(value)
    return value
