"""`jaxserve bench --soak SECONDS`: a real `jaxserve serve` under long mixed traffic, with
cancels and deadlines, checked for leaks, compiles, wrong answers and memory growth.

A soak finds what a benchmark does not: slots or pages that a cancelled request never gives
back, a status code no client should see, one request's tokens delivered to another, a compile
triggered by some rare shape, memory creeping up. It starts the server as a subprocess on
loopback (so its RSS is the server's alone), measures its capacity briefly with a closed loop,
then offers Poisson traffic near that capacity for the given time:

- streaming Generate and GenerateUnary, token-id and text prompts (text ones tokenized first
  through Tokenize, so the prompt length is known), greedy and seeded sampling, stop strings,
  logprobs; greedy prompts recur, so each repeat must reproduce (a prefix of) the first answer;
- a random `cancel_share` of requests cancelled at a random point (after some tokens, or after a
  random delay, which may fall before admission), a `deadline_share` given a short deadline, and
  a few reusing the id of a request just cancelled (INVALID_ARGUMENT is then also acceptable).

Each request's status code is checked against what its fate allows; every OK answer is checked
for its own prompt length, token count, finish reason and logprobs. Once the traffic stops and
the server is idle, its Prometheus gauges must show no slot and no page held, and its compile
counter no compile since warm-up. The server's RSS is sampled every second.

Threads: one dispatcher draws each request's plan in order (so a seed fixes the traffic) and
hands it to a bounded pool of client threads; a log reader drains the server's stderr; an RSS
sampler polls the process. gRPC channels are several, each its own connection.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jaxserve.bench.workload import LengthMix

# What each fate may end with; anything else is an unexpected error.
EXPECTED = {
    "normal": {"OK"},
    "cancel": {"OK", "CANCELLED"},
    "deadline": {"OK", "DEADLINE_EXCEEDED"},
    "reuse": {"OK", "INVALID_ARGUMENT"},  # an id still held by a cancelled request
}
_STORY = (
    "once upon a time there was a little girl named lily she liked to play in the park with "
    "her big red ball one day the sun was warm and a small dog ran to say hello"
)
_WORDS = tuple(_STORY.split())
_FINISH = {1: "stop", 2: "length", 3: "abort", 4: "error"}


class SoakError(RuntimeError):
    """The soak could not run (the server did not start or died); the message says why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoakSpec:
    """One soak: how long, how hard, and the `jaxserve serve` flags of its server."""

    duration_s: float
    rate: float | None = None  # offered requests/s; None: `load` x the measured capacity
    load: float = 0.9
    probe_s: float | None = None  # capacity probe; None: a tenth of the soak, 5 to 30 s
    serve_flags: tuple[str, ...] = ()
    mix: LengthMix = dataclasses.field(default_factory=LengthMix)
    cancel_share: float = 0.2
    deadline_share: float = 0.05
    reuse_share: float = 0.03
    deadline_range_s: tuple[float, float] = (0.02, 0.5)
    seed: int = 0
    max_in_flight: int = 256  # client threads; arrivals beyond wait (and are counted late)
    out_dir: Path | None = None  # soak.json and server.log
    command: str = ""

    def __post_init__(self):
        if not self.duration_s > 0:
            raise ValueError(f"The soak's duration_s={self.duration_s} must be > 0 seconds.")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"The soak's rate={self.rate} must be > 0 requests/s.")
        shares = (self.cancel_share, self.deadline_share, self.reuse_share)
        if min(shares) < 0 or sum(shares) > 1:
            raise ValueError(f"Shares cancel/deadline/reuse={shares} must be >= 0, summing <= 1.")


@dataclasses.dataclass
class Plan:
    """One request as drawn by the dispatcher, and what it may end with."""

    index: int
    fate: str  # a key of EXPECTED
    method: str  # "stream" or "unary"
    request_id: str
    ids: list[int] | None  # token-id prompt, or None for `text`
    text: str | None
    sampling: dict
    cancel_after_tokens: int | None = None
    cancel_after_s: float | None = None
    deadline_s: float | None = None
    # A later request reuses this id, and may reach the server first: INVALID_ARGUMENT is then
    # this request's fair answer too.
    id_shared: bool = False

    def allows(self, code: str) -> bool:
        return code in EXPECTED[self.fate] or (self.id_shared and code == "INVALID_ARGUMENT")


@dataclasses.dataclass
class Outcome:
    plan: Plan
    code: str
    detail: str = ""
    problems: list[str] = dataclasses.field(default_factory=list)  # wrong answers


# ---- the server process -------------------------------------------------------------------


class ServerProcess:
    """`jaxserve serve` on free loopback ports; its log, metrics and memory."""

    def __init__(self, flags: tuple[str, ...], log_path: Path | None, timeout_s: float = 900):
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--host=127.0.0.1", "--port=0"]
        cmd += ["--metrics-port=0", "--log-format=json", "--grace-period=10", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.errors: list[str] = []  # ERROR-level log lines
        self._events: dict[str, dict] = {}
        self._seen = threading.Condition()
        self._log = open(log_path, "wb") if log_path else None  # noqa: SIM115 (closed in stop)
        threading.Thread(target=self._read_log, daemon=True).start()
        listening = self._wait_for("listening", timeout_s)
        self.port, self.metrics_port = listening["port"], listening["metrics_port"]
        self.ready_info = self._wait_for("serving", timeout_s)

    def _read_log(self) -> None:
        for raw in self.proc.stderr:
            if self._log:
                self._log.write(raw)
            line = raw.decode("utf-8", "replace").rstrip()
            self.tail.append(line)
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if entry.get("level") in ("ERROR", "CRITICAL"):
                self.errors.append(line)
            with self._seen:
                self._events.setdefault(entry.get("msg", ""), entry)
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def _wait_for(self, msg: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        with self._seen:
            while msg not in self._events:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    tail = "\n".join(self.tail)
                    raise SoakError(f"jaxserve serve never logged {msg!r}; its log ends:\n{tail}")
                self._seen.wait(0.5)
            return self._events[msg]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_bytes(self) -> int | None:
        """Resident memory (psutil if installed, else /proc); None once the process is gone."""
        try:
            import psutil

            return psutil.Process(self.proc.pid).memory_info().rss
        except ImportError:
            pass
        except Exception:  # psutil.NoSuchProcess: it exited
            return None
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                kb = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
            return kb * 1024
        except (OSError, StopIteration):
            return None

    def metrics(self) -> dict[str, float]:
        """The /metrics samples, keyed by name{labels} as Prometheus prints them."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self, timeout_s: float = 30) -> int | None:
        """SIGTERM (a drain), then SIGKILL if it lingers; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log:
            self._log.close()
            self._log = None
        return self.proc.returncode


# ---- traffic ------------------------------------------------------------------------------


class Traffic:
    """Draws plans in order from one seeded generator (the dispatcher's thread only)."""

    def __init__(self, spec: SoakSpec, vocab_size: int, context: int, has_tokenizer: bool):
        self.spec, self.vocab, self.context = spec, vocab_size, context
        self.has_tokenizer = has_tokenizer
        self.rng = random.Random(spec.seed)
        low = 3 if vocab_size > 3 else 0  # skip BOS/EOS/pad on most vocabularies
        lo, hi = spec.mix.prompt_range
        # Greedy prompts drawn from this pool recur, so their answers can be compared.
        self.pool = [
            [self.rng.randrange(low, vocab_size) for _ in range(self.rng.randint(lo, hi))]
            for _ in range(16)
        ]
        self._low = low
        self._last_cancelled: Plan | None = None
        self.count = 0

    def draw(self, *, normal_only: bool = False) -> Plan:
        s, rng = self.spec, self.rng
        i, self.count = self.count, self.count + 1
        u = 1.0 if normal_only else rng.random()
        fate = "normal"
        if u < s.cancel_share:
            fate = "cancel"
        elif u < s.cancel_share + s.deadline_share:
            fate = "deadline"
        elif u < s.cancel_share + s.deadline_share + s.reuse_share and self._last_cancelled:
            fate = "reuse"
        prompt_len, max_tokens = s.mix.draw(rng)
        greedy = rng.random() < 0.5
        ids, text = None, None
        if self.has_tokenizer and rng.random() < 0.3:
            text = " ".join(rng.choice(_WORDS) for _ in range(max(1, prompt_len // 2)))
        elif greedy and rng.random() < 0.5:
            ids = list(rng.choice(self.pool))
        else:
            ids = [rng.randrange(self._low, self.vocab) for _ in range(prompt_len)]
        n = len(ids) if ids is not None else prompt_len  # text: about a token a word, plus BOS
        sampling = {"max_tokens": max(1, min(max_tokens, self.context - n - 8))}
        if greedy:
            sampling["temperature"] = 0.0
        else:
            sampling.update(temperature=0.8, top_p=0.9, top_k=40, seed=rng.randrange(2**32))
        sampling["ignore_eos"] = rng.random() < 0.7
        if rng.random() < 0.1:
            sampling["stop"] = [rng.choice(_WORDS)]
        if rng.random() < 0.1:
            sampling["logprobs"] = rng.randint(0, 3)
        rid = f"soak-{s.seed}-{i}" if rng.random() < 0.8 else ""
        if fate == "reuse":
            self._last_cancelled.id_shared = True
            rid, self._last_cancelled = self._last_cancelled.request_id, None
        plan = Plan(i, fate, "stream" if rng.random() < 0.75 else "unary", rid, ids, text, sampling)
        if fate == "cancel":
            if plan.method == "stream" and rng.random() < 0.5:
                plan.cancel_after_tokens = rng.randint(1, sampling["max_tokens"])
            else:
                plan.cancel_after_s = rng.uniform(0.0, 0.5)
            self._last_cancelled = plan if rid else None
        elif fate == "deadline":
            plan.deadline_s = rng.uniform(*s.deadline_range_s)
        return plan


def run_one(stub, metadata, plan: Plan, tokenize, greedy_seen: dict, lock) -> Outcome:
    """Sends one plan and checks what came back; never raises."""
    import grpc

    from service.grpc.client import make_request

    try:
        ids = plan.ids if plan.ids is not None else tokenize(plan.text)
    except grpc.RpcError as e:
        return Outcome(plan, f"TOKENIZE_{e.code().name}", e.details() or "")
    prompt = plan.ids if plan.ids is not None else plan.text
    request = make_request(prompt, request_id=plan.request_id, **plan.sampling)
    tokens, logprobs, last, timer = [], 0, None, None
    try:
        if plan.method == "stream":
            call = stub.Generate(request, timeout=plan.deadline_s, metadata=metadata)
            if plan.cancel_after_s is not None:
                timer = threading.Timer(plan.cancel_after_s, call.cancel)
                timer.start()
            for resp in call:
                tokens += resp.token_ids
                logprobs += len(resp.logprobs)
                last = resp
                if plan.cancel_after_tokens is not None and len(tokens) >= plan.cancel_after_tokens:
                    call.cancel()  # the next read raises CANCELLED
        else:
            future = stub.GenerateUnary.future(request, timeout=plan.deadline_s, metadata=metadata)
            if plan.cancel_after_s is not None:
                try:
                    future.result(timeout=plan.cancel_after_s)
                except grpc.FutureTimeoutError:
                    future.cancel()
            last = future.result()
            tokens, logprobs = list(last.token_ids), len(last.logprobs)
    except grpc.FutureCancelledError:
        return Outcome(plan, "CANCELLED")
    except grpc.RpcError as e:
        return Outcome(plan, e.code().name, e.details() or "")
    except Exception as e:  # a client-side failure is a finding too, never a crash of the soak
        return Outcome(plan, "CLIENT_ERROR", repr(e))
    finally:
        if timer is not None:
            timer.cancel()
    out = Outcome(plan, "OK")
    out.problems = check_answer(plan, ids, tokens, logprobs, last, greedy_seen, lock)
    return out


def check_answer(plan: Plan, ids, tokens, logprobs, last, greedy_seen, lock) -> list[str]:
    """What is wrong with an OK answer: another request's usage, a token count or finish reason
    that does not match, or a repeated greedy prompt answered differently."""
    p, sampling = [], plan.sampling
    if last is None or not last.finish_reason:
        return ["the call ended OK without a final response (no finish reason)"]
    reason = _FINISH.get(last.finish_reason, str(last.finish_reason))
    if plan.request_id and last.request_id != plan.request_id:
        p.append(f"request_id {last.request_id!r} in the answer, {plan.request_id!r} sent")
    if last.usage.prompt_tokens != len(ids):
        p.append(f"usage.prompt_tokens={last.usage.prompt_tokens}, the prompt has {len(ids)}")
    if last.usage.completion_tokens != len(tokens):
        p.append(f"usage.completion_tokens={last.usage.completion_tokens}, {len(tokens)} received")
    if reason not in ("stop", "length"):
        p.append(f"finish_reason={reason} on an OK call")
    elif len(tokens) > sampling["max_tokens"]:
        p.append(f"{len(tokens)} tokens for max_tokens={sampling['max_tokens']}")
    elif (
        sampling["ignore_eos"]
        and not sampling.get("stop")
        and len(tokens) != sampling["max_tokens"]
    ):
        p.append(f"{len(tokens)} tokens with EOS ignored, max_tokens={sampling['max_tokens']}")
    if "logprobs" in sampling and logprobs != len(tokens):
        p.append(f"{logprobs} logprobs for {len(tokens)} tokens")
    if sampling.get("temperature") == 0.0 and not sampling.get("stop") and not p:
        with lock:
            first = greedy_seen.setdefault(tuple(ids), tuple(tokens))
        n = min(len(first), len(tokens))
        if tuple(tokens[:n]) != first[:n]:
            p.append(f"greedy answer {tokens[:8]}... differs from this prompt's first {first[:8]}")
    return [f"request {plan.index} ({plan.method}, {plan.fate}): {x}" for x in p]


# ---- the run ------------------------------------------------------------------------------


class _Client:
    """Several channels (each its own connection) and the shared checking state."""

    def __init__(self, target: str, n: int = 4):
        import grpc

        from service.auth import metadata
        from service.gen.jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

        # A local subchannel pool per channel: otherwise gRPC shares one connection among them.
        opts = [("grpc.use_local_subchannel_pool", 1)]
        self.channels = [grpc.insecure_channel(target, options=opts) for _ in range(n)]
        self.stubs = [pb_grpc.JaxServeStub(c) for c in self.channels]
        self.metadata = metadata(os.environ.get("JAXSERVE_AUTH_TOKEN") or None)
        self.greedy_seen: dict = {}
        self.lock = threading.Lock()

    def tokenize(self, text: str) -> list[int]:
        from service.gen.jaxserve.v1 import jaxserve_pb2 as pb

        reply = self.stubs[0].Tokenize(pb.TokenizeRequest(text=text), metadata=self.metadata)
        return list(reply.token_ids)

    def send(self, plan: Plan) -> Outcome:
        stub = self.stubs[plan.index % len(self.stubs)]
        return run_one(stub, self.metadata, plan, self.tokenize, self.greedy_seen, self.lock)

    def close(self) -> None:
        for c in self.channels:
            c.close()


def measure_capacity(client: _Client, traffic: Traffic, concurrency: int, seconds: float):
    """Completed requests/s of a closed loop of plain (never cancelled) requests."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def loop():
        while time.monotonic() < stop_at:
            with lock:
                plan = traffic.draw(normal_only=True)
            out = client.send(plan)
            with lock:
                outcomes.append(out)

    start = time.monotonic()
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    return sum(o.code == "OK" for o in outcomes) / elapsed, outcomes


@dataclasses.dataclass
class _Observed:
    """What a soak saw of its server, filled in as it runs (RSS in bytes, times in s)."""

    info: object = None  # the server's ModelInfo
    warm_metrics: dict = dataclasses.field(default_factory=dict)  # once warmed up
    final_metrics: dict = dataclasses.field(default_factory=dict)  # once idle (or timed out)
    idle: bool = False
    capacity: float | None = None
    rate: float = 0.0
    traffic_s: float = 0.0
    late: int = 0
    probe: list = dataclasses.field(default_factory=list)  # Outcomes of the capacity probe
    outcomes: list = dataclasses.field(default_factory=list)  # Outcomes of the soak proper
    rss: list = dataclasses.field(default_factory=list)  # (s since traffic began, bytes)
    # (s since traffic began, jaxserve_host_kv_pages_used), every RSS_TIMELINE_STEP_S
    host_pages: list = dataclasses.field(default_factory=list)
    rss_ready: int | None = None
    rss_start: int | None = None
    rss_end: int | None = None
    died: bool = False  # exited before the soak stopped it
    exit_code: int | None = None


def run_soak(spec: SoakSpec, log=print) -> dict:
    """Runs the soak; returns the report (see `format_report`). Raises SoakError if the server
    cannot start."""
    if spec.out_dir is not None:
        spec.out_dir.mkdir(parents=True, exist_ok=True)
    log(f"soak: starting jaxserve serve {' '.join(spec.serve_flags)}")
    server = ServerProcess(spec.serve_flags, spec.out_dir / "server.log" if spec.out_dir else None)
    seen = _Observed()
    client = _Client(server.target)
    try:
        _drive(spec, server, client, seen, log)
    finally:
        client.close()
        seen.died = not server.alive()
        seen.exit_code = server.stop()
    return _report(spec, server, seen)


def _drive(spec: SoakSpec, server: ServerProcess, client: _Client, seen: _Observed, log) -> None:
    from service.grpc.client import JaxServeClient

    with JaxServeClient(server.target) as info_client:
        seen.info = info = info_client.model_info()
        try:
            info_client.tokenize("hello")
            has_tokenizer = True
        except Exception:  # a model without a tokenizer: token-id prompts only
            has_tokenizer = False
    seen.rss_ready = server.rss_bytes()
    seen.warm_metrics = server.metrics()
    traffic = Traffic(spec, info.vocab_size, info.context_length, has_tokenizer)
    seen.rate = spec.rate
    if seen.rate is None:
        probe_s = spec.probe_s or min(30.0, max(5.0, spec.duration_s / 10))
        log(f"soak: measuring capacity for {probe_s:.0f} s")
        concurrency = info.limits.max_num_seqs
        seen.capacity, seen.probe = measure_capacity(client, traffic, concurrency, probe_s)
        if seen.capacity <= 0:
            raise SoakError(f"No request finished OK in the {probe_s:.0f} s capacity probe.")
        seen.rate = spec.load * seen.capacity
    log(f"soak: {seen.rate:.2f} requests/s for {spec.duration_s:.0f} s")
    t0 = time.monotonic()
    seen.rss_start = server.rss_bytes()
    stop_sampling = threading.Event()

    def sample_rss():
        next_scrape = 0.0
        while not stop_sampling.wait(1.0):
            value, t = server.rss_bytes(), time.monotonic() - t0
            if value is not None:
                seen.rss.append((t, value))
            if t >= next_scrape:  # what the host tier holds, to read the RSS against
                next_scrape = t + RSS_TIMELINE_STEP_S
                try:
                    used = server.metrics().get("jaxserve_host_kv_pages_used")
                except OSError:
                    continue
                if used is not None:
                    seen.host_pages.append((round(t, 1), int(used)))

    threading.Thread(target=sample_rss, daemon=True).start()
    try:
        seen.outcomes, seen.late = _offer(client, traffic, spec, seen.rate, server)
        seen.traffic_s = time.monotonic() - t0
        log(f"soak: traffic done ({len(seen.outcomes)} requests); waiting for the server to idle")
        seen.idle, seen.final_metrics = _wait_idle(server)
        seen.rss_end = server.rss_bytes()
    finally:
        stop_sampling.set()


def _offer(client: _Client, traffic: Traffic, spec: SoakSpec, rate: float, server):
    """Poisson arrivals at `rate` for the soak's duration; returns (outcomes, late arrivals)."""
    rng = random.Random(spec.seed + 1)
    futures, late = [], 0
    slots = threading.BoundedSemaphore(spec.max_in_flight)
    start = time.monotonic()
    next_at = start

    def send(plan):
        try:
            return client.send(plan)
        finally:
            slots.release()

    with ThreadPoolExecutor(spec.max_in_flight, thread_name_prefix="soak") as pool:
        while next_at < start + spec.duration_s and server.alive():
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if not slots.acquire(timeout=0):  # every client thread busy: wait, and count it
                late += 1
                slots.acquire()
            futures.append(pool.submit(send, traffic.draw()))
            next_at += rng.expovariate(rate)
    return [f.result() for f in futures], late


def _wait_idle(server: ServerProcess, timeout_s: float = 60.0) -> tuple[bool, dict]:
    """Polls /metrics until nothing runs, waits or holds a slot or page; (idle?, last sample)."""
    deadline = time.monotonic() + timeout_s
    names = ("jaxserve_num_running", "jaxserve_num_waiting", "jaxserve_slots_used")
    while True:
        try:
            m = server.metrics() if server.alive() else {}
        except OSError:  # it died between the check and the scrape
            m = {}
        if m and all(m.get(n) == 0 for n in (*names, "jaxserve_kv_pages_used")):
            return True, m
        if time.monotonic() > deadline or not m:
            return False, m
        time.sleep(0.2)


def _report(spec: SoakSpec, server: ServerProcess, seen: _Observed) -> dict:
    info, final, rss, outcomes = seen.info, seen.final_metrics, seen.rss, seen.outcomes
    by_fate: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    unexpected, wrong = [], []
    for o in [*seen.probe, *outcomes]:
        if not o.plan.allows(o.code):
            unexpected.append(f"request {o.plan.index} ({o.plan.fate}): {o.code}: {o.detail}")
        wrong += o.problems
    for o in outcomes:
        by_fate[o.plan.fate][o.code] += 1
    by_code = collections.Counter(o.code for o in outcomes)
    names = ("slots_used", "kv_pages_used", "num_running", "num_waiting")
    leaks = {
        k: None if f"jaxserve_{k}" not in final else int(final[f"jaxserve_{k}"]) for k in names
    }
    compiles = None
    if "jaxserve_compiles_total" in final:
        before = seen.warm_metrics["jaxserve_compiles_total"]
        compiles = int(final["jaxserve_compiles_total"] - before)
    mib = lambda b: None if b is None else round(b / 2**20, 1)  # noqa: E731
    middle = min(rss, key=lambda s: abs(s[0] - seen.traffic_s / 2))[1] if rss else None
    peak = max((b for _, b in rss), default=None)
    growth = None if peak is None or seen.rss_start is None else peak - seen.rss_start
    failures = []
    if seen.died:
        tail = "\n".join(server.tail)
        failures.append(f"The server died during the soak; its log ends:\n{tail}")
    if unexpected:
        failures.append(f"{len(unexpected)} requests ended with an unexpected status code.")
    if wrong:
        failures.append(f"{len(wrong)} OK answers were wrong (another request's, or malformed).")
    if not seen.idle or any(v != 0 for v in leaks.values()):
        failures.append(f"The server did not settle to zero once idle: {leaks}.")
    if compiles is not None and compiles != 0:
        failures.append(f"The server compiled {compiles} times after warm-up (must be 0).")
    if not seen.died and seen.exit_code != 0:
        failures.append(f"The server exited with {seen.exit_code} after SIGTERM (expected 0).")
    return {
        "command": spec.command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "server": {
            "model": info.model,
            "dtype": info.dtype,
            "context_length": info.context_length,
            "max_num_seqs": info.limits.max_num_seqs,
            "max_num_batched_tokens": info.limits.max_num_batched_tokens,
            "num_kv_pages": info.limits.num_kv_pages,
            "flags": list(spec.serve_flags),
            "warmup_s": server.ready_info.get("warmup_s"),
            # The KV pools as the server's 'serving' line gave them: the host tier's bytes are
            # what its RSS may grow by as host pages are first used (kv_transfer.py).
            "kv_bytes": server.ready_info.get("kv_bytes"),
            "host_kv_bytes": server.ready_info.get("host_kv_bytes"),
            "host_kv_pages": server.ready_info.get("host_kv_pages"),
            # Host pages in use once idle: the host tier keeps what the device pool evicted.
            "host_kv_pages_used_end": _int_or_none(final.get("jaxserve_host_kv_pages_used")),
        },
        "duration_s": round(seen.traffic_s, 1),
        "capacity_rps": None if seen.capacity is None else round(seen.capacity, 2),
        "rate_rps": round(seen.rate, 2),
        "late_arrivals": seen.late,
        "requests": len(outcomes),
        "probe_requests": len(seen.probe),
        "by_code": dict(by_code.most_common()),
        "by_fate": {f: dict(c.most_common()) for f, c in sorted(by_fate.items())},
        "unexpected": {"count": len(unexpected), "examples": unexpected[:20]},
        "wrong_answers": {"count": len(wrong), "examples": wrong[:20]},
        "server_calls": _labelled(final, "jaxserve_grpc_calls_total"),
        "finished_by_reason": _labelled(final, "jaxserve_requests_finished_total"),
        "idle": seen.idle,
        "leaks": leaks,
        "compiles_after_warmup": compiles,
        "rss_mib": {
            "ready": mib(seen.rss_ready),
            "start": mib(seen.rss_start),
            "middle": mib(middle),
            "end": mib(seen.rss_end),
            "max": mib(peak),
            "growth": mib(growth),
        },
        "rss_timeline_mib": rss_timeline(rss, RSS_TIMELINE_STEP_S),
        "host_kv_pages_used_timeline": [list(x) for x in seen.host_pages],
        "server_error_logs": {"count": len(server.errors), "examples": server.errors[:10]},
        "server_exit_code": seen.exit_code,
        "failures": failures,
        "ok": not failures,
    }


RSS_TIMELINE_STEP_S = 10.0


def _int_or_none(value) -> int | None:
    return None if value is None else int(value)


def rss_timeline(samples: list, step_s: float) -> list[list[float]]:
    """The RSS samples (s since traffic began, bytes) thinned to the first one in each `step_s`
    of the soak, as [s, MiB] pairs: growth over time, short enough to read in soak.json."""
    out, next_at = [], 0.0
    for t, b in samples:
        if t >= next_at:
            out.append([round(t, 1), round(b / 2**20, 1)])
            next_at = (t // step_s + 1) * step_s
    return out


def _labelled(metrics: dict, name: str) -> dict[str, int]:
    """The samples of one labelled counter, keyed by their label values."""
    out = {}
    for key, value in metrics.items():
        if key.startswith(name + "{") and value:
            labels = key[len(name) + 1 : -1].split(",")
            out["/".join(x.split("=", 1)[1] for x in labels)] = int(value)
    return dict(sorted(out.items()))


def format_report(r: dict) -> str:
    """The soak's findings as a few lines for the terminal."""
    s = r["server"]
    lines = [
        f"soak: {r['requests']} requests in {r['duration_s']} s at {r['rate_rps']} req/s "
        f"(capacity {r['capacity_rps']} req/s; {r['late_arrivals']} arrivals late), "
        f"{s['model']} ({s['dtype']}), max_num_seqs={s['max_num_seqs']}, "
        f"context={s['context_length']}",
        "by status: " + ", ".join(f"{k} {v}" for k, v in r["by_code"].items()),
    ]
    for fate, codes in r["by_fate"].items():
        lines.append(f"  {fate:8} " + ", ".join(f"{k} {v}" for k, v in codes.items()))
    lines.append("server calls: " + ", ".join(f"{k} {v}" for k, v in r["server_calls"].items()))
    lines.append(f"unexpected status codes: {r['unexpected']['count']}")
    lines += [f"  {x}" for x in r["unexpected"]["examples"][:10]]
    lines.append(f"wrong answers: {r['wrong_answers']['count']}")
    lines += [f"  {x}" for x in r["wrong_answers"]["examples"][:10]]
    leaks = ", ".join(f"{k} {v}" for k, v in r["leaks"].items())
    lines.append(f"once idle: {leaks}" + ("" if r["idle"] else " (never settled)"))
    lines.append(f"compiles after warm-up: {r['compiles_after_warmup']}")
    m = r["rss_mib"]
    lines.append(
        f"server RSS MiB: ready {m['ready']}, start {m['start']}, middle {m['middle']}, "
        f"end {m['end']}, max {m['max']} (growth {m['growth']})"
    )
    if s.get("host_kv_bytes") is not None:
        lines.append(
            f"host KV tier: {s['host_kv_bytes'] / 2**20:.1f} MiB, {s['host_kv_pages_used_end']} "
            f"of its {s['host_kv_pages']} pages used once idle (device pool "
            f"{(s['kv_bytes'] or 0) / 2**20:.1f} MiB)"
        )
    lines.append(f"server ERROR log lines: {r['server_error_logs']['count']}")
    lines.append(f"server exit status after SIGTERM: {r['server_exit_code']}")
    lines += [f"FAIL: {f}" for f in r["failures"]] or ["soak: PASS"]
    return "\n".join(lines)
