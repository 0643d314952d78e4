"""The gauges a router reads (docs/routing.md): queue, running, KV-cache use, cache config and
LoRA adapters, against the engine's own state; and /metrics as promtool and its lint rules see it.

The embedded stories260k with three random adapters (test_lora_api.py's `save_peft`) and one
adapter slot, so requests of the others wait while one adapter's run.
"""

from __future__ import annotations

import collections
import json
import re
import shutil
import subprocess
import time
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import checkpoints
from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.request import RequestStatus
from tests.engine.conftest import drain
from tests.service.conftest import SMALL, serving
from tests.service.test_lora_api import save_peft

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    """stories260k with adapters tiny-a, tiny-b and tiny-c and one device slot for them."""
    stories = checkpoints.load_model()
    root = tmp_path_factory.mktemp("router-adapters")
    lora = tuple(
        f"{name}={save_peft(root / name, stories.config, seed=i)}"
        for i, name in enumerate(("tiny-a", "tiny-b", "tiny-c"))
    )
    config = EngineConfig(**SMALL, lora=lora, max_loras=1, max_lora_rank=8, show_progress=False)
    return Engine(config, model=stories)


def scrape(engine: Engine) -> dict[str, list]:
    """Every sample of the engine's registry, by name, as an exposition parser reads it."""
    samples = collections.defaultdict(list)
    text = generate_latest(engine.metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append(sample)
    return samples


def value(samples: dict[str, list], name: str) -> float:
    (sample,) = samples[name]
    return sample.value


def unfinished(engine: Engine) -> list:
    """The engine's unfinished requests, as their own status says (not the scheduler's lists)."""
    return [t.request for t in engine.outputs.tracked.values()]


def test_queue_running_and_kv_use_are_the_engines_state(engine):
    # A finished request leaves its full pages cached and held by none: free, not in use.
    engine.add_request(list(range(1, 60)), PARAMS)
    drain(engine)
    kv = engine.scheduler.kv
    assert kv.num_cached_pages >= 3
    # Four 40-token prompts against a 32-token budget: some run (one chunked), some wait.
    for i in range(4):
        engine.add_request(list(range(100 + 40 * i, 140 + 40 * i)), PARAMS)
    engine.step()
    samples = scrape(engine)
    requests = unfinished(engine)
    running = [r for r in requests if r.status == RequestStatus.RUNNING]
    waiting = [r for r in requests if r.status in WAITING]
    assert running and waiting
    assert value(samples, "jaxserve_num_running") == len(running)
    assert value(samples, "jaxserve_num_waiting") == len(waiting)
    held = {page for r in running for page in kv.table_of(r.request_id)}
    assert held and kv.num_cached_pages >= 3  # the cached pages are still there, unheld
    pool = engine.runner.kv.num_pages
    assert value(samples, "jaxserve_kv_cache_usage_perc") == pytest.approx(len(held) / pool)
    assert value(samples, "jaxserve_kv_pages_used") == len(held)
    assert value(samples, "jaxserve_kv_pages") == pool
    drain(engine)
    samples = scrape(engine)
    assert kv.num_cached_pages >= 3
    for name in ("jaxserve_num_running", "jaxserve_num_waiting", "jaxserve_kv_cache_usage_perc"):
        assert value(samples, name) == 0, name


def test_cache_config_labels_are_the_pools_page_size_and_pages(engine):
    (sample,) = scrape(engine)["jaxserve_cache_config_info"]
    pool = engine.runner.kv  # the device array's own shape: [layers, pages, page_size, lanes]
    assert pool.page_size == 16 and pool.num_pages > 16  # the test would not tell them apart
    assert sample.labels == {
        "page_size": str(pool.page_size),
        "num_pages": str(pool.num_pages),
        "block_size": str(pool.page_size),
        "num_gpu_blocks": str(pool.num_pages),
        "enable_prefix_caching": "true",
    }
    assert sample.value == 1


def test_lora_info_names_the_running_and_the_waiting_adapter(engine):
    before = time.time()
    # One slot: tiny-b's request waits until tiny-a's finishes and unpins it.
    engine.add_request([1, 5, 9, 3], PARAMS, lora="tiny-a")
    engine.add_request([1, 7, 2], PARAMS, lora="tiny-b")
    engine.add_request([1, 8, 4], PARAMS)  # the base model: neither list
    engine.step()
    requests = unfinished(engine)
    assert {r.lora_name for r in requests if r.status == RequestStatus.RUNNING} == {"tiny-a", None}
    assert {r.lora_name for r in requests if r.status in WAITING} == {"tiny-b"}
    (sample,) = scrape(engine)["jaxserve_lora_requests_info"]
    assert sample.labels == {
        "max_lora": "1",
        "running_lora_adapters": "tiny-a",
        "waiting_lora_adapters": "tiny-b",
    }
    assert before <= sample.value <= time.time()  # a Unix time: when this state was set
    # Another of the running adapter runs beside it; a third adapter waits too.
    engine.add_request([1, 6, 6], PARAMS, lora="tiny-a")
    engine.add_request([1, 6], PARAMS, lora="tiny-c")
    engine.step()
    requests = unfinished(engine)
    assert sum(r.lora_name == "tiny-a" and r.status == RequestStatus.RUNNING for r in requests) == 2
    (sample,) = scrape(engine)["jaxserve_lora_requests_info"]
    assert sample.labels["running_lora_adapters"] == "tiny-a"  # once, however many requests
    assert sample.labels["waiting_lora_adapters"] == "tiny-b,tiny-c"
    drain(engine)
    (sample,) = scrape(engine)["jaxserve_lora_requests_info"]
    assert sample.labels["running_lora_adapters"] == sample.labels["waiting_lora_adapters"] == ""


def test_an_adapter_name_with_a_comma_is_refused(engine, tmp_path):
    folder = save_peft(tmp_path / "a", checkpoints.load_model().config, seed=3)
    with pytest.raises(ValueError, match="comma"):
        engine.add_lora("tiny,c", str(folder))


# ---- /metrics as a scraper sees it ---------------------------------------------------------


@pytest.fixture(scope="module")
def exposition(engine) -> dict[str, str]:
    """The text of /metrics on the HTTP port and on the metrics port, after requests of the
    base model and of an adapter (so that labelled series exist), by port."""
    with serving(engine, http_port=0) as server:
        base = f"http://127.0.0.1:{server.server.http_port}"
        for model in (None, "tiny-a"):
            body = {"prompt": "Once upon a time", "max_tokens": 3, "model": model}
            request = urllib.request.Request(
                f"{base}/v1/completions",
                data=json.dumps({k: v for k, v in body.items() if v is not None}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as response:
                assert response.status == 200
        urls = {"http": base, "metrics": f"http://127.0.0.1:{server.server.metrics_port}"}
        return {
            port: urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
            for port, url in urls.items()
        }


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not on PATH (Debian's prometheus package ships it); "
    "test_metrics_follow_promtools_lint_rules checks its rules without it",
)
@pytest.mark.parametrize("port", ["http", "metrics"])
def test_promtool_check_metrics_passes(exposition, port):
    done = subprocess.run(
        [PROMTOOL, "check", "metrics"],
        input=exposition[port],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# promtool's lint (client_golang's promlint): abbreviated units, and units that are not base.
_ABBREVIATED = {"s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d"}
_NOT_BASE = {"minutes", "hours", "days", "weeks", "bits", "inches", "miles", "pounds", "calories"}
_PREFIXES = ("milli", "micro", "nano", "kilo", "mega")
_NOT_BASE |= {p + u for p in _PREFIXES for u in ("seconds", "bytes")}


def lint(text: str) -> list[str]:
    """The problems promtool's `check metrics` reports that this exposition could have: parse
    errors, HELP or TYPE given twice or missing, counters without `_total` and other types
    with it, reserved suffixes, names not snake_case, abbreviated or non-base units. And one
    rule of OpenMetrics that promtool leaves alone: an info metric's value is 1 (but the LoRA
    one's, a Unix time, as the model server protocol says)."""
    problems = []
    kinds, helps = {}, collections.Counter()
    types = collections.Counter()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] += 1
            kinds[name] = kind
        elif line.startswith("# HELP "):
            helps[line.split(" ", 3)[2]] += 1
    problems += [f"{n}: {c} TYPE lines" for n, c in types.items() if c > 1]
    problems += [f"{n}: {c} HELP lines" for n, c in helps.items() if c > 1]
    problems += [f"{n}: no HELP" for n in kinds if not helps[n]]
    for name, kind in kinds.items():
        if kind == "counter" and not name.endswith("_total"):
            problems.append(f'{name}: a counter without the "_total" suffix')
        if kind != "counter" and name.endswith("_total"):
            problems.append(f'{name}: a {kind} with the "_total" suffix')
        if kind not in ("histogram", "summary") and name.endswith(("_bucket", "_count", "_sum")):
            problems.append(f"{name}: a {kind} with a histogram's reserved suffix")
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            problems.append(f"{name}: not snake_case (or a colon)")
        parts = set(name.split("_"))
        problems += [f"{name}: abbreviated unit {p!r}" for p in sorted(parts & _ABBREVIATED)]
        problems += [f"{name}: non-base unit {p!r}" for p in sorted(parts & _NOT_BASE)]
    for family in text_string_to_metric_families(text):  # raises on a malformed exposition
        for sample in family.samples:
            bad = [k for k in sample.labels if not re.fullmatch(r"[a-z_][a-z0-9_]*", k)]
            problems += [f"{sample.name}: label {k!r} not snake_case" for k in bad]
            if sample.name.endswith("_info"):
                if family.type not in ("gauge", "info"):
                    problems.append(f"{sample.name}: an info metric typed {family.type}")
                expected = sample.value if sample.name.endswith("lora_requests_info") else 1
                if sample.value != expected:
                    problems.append(f"{sample.name}: an info metric of value {sample.value}")
    return problems


@pytest.mark.parametrize("port", ["http", "metrics"])
def test_metrics_follow_promtools_lint_rules(exposition, port):
    text = exposition[port]
    for name in (
        "jaxserve_num_waiting",
        "jaxserve_num_running",
        "jaxserve_kv_cache_usage_perc",
        "jaxserve_cache_config_info",
        "jaxserve_lora_requests_info",
    ):
        assert f"\n{name}" in text, name
    assert lint(text) == []
    (lora,) = [
        s
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "jaxserve_lora_requests_info"
    ]
    assert abs(lora.value - time.time()) < 600  # a Unix time, not a count


def test_the_lint_catches_what_promtool_refuses():
    """Each rule of `lint` fails an exposition that promtool 2.42 refuses (the info metric's
    value aside: OpenMetrics' rule, which promtool does not check)."""
    bad = {
        "# HELP x_pages_total p\n# TYPE x_pages_total gauge\nx_pages_total 1\n": "_total",
        "# HELP x_done d\n# TYPE x_done counter\nx_done 1\n": "_total",
        "# HELP x_wait_ms w\n# TYPE x_wait_ms gauge\nx_wait_ms 1\n": "abbreviated",
        "# HELP x_milliseconds w\n# TYPE x_milliseconds gauge\nx_milliseconds 1\n": "non-base",
        "# HELP x_a a\n# TYPE x_a gauge\n# TYPE x_a gauge\nx_a 1\n": "TYPE lines",
        "# TYPE x_b gauge\nx_b 1\n": "no HELP",
        '# HELP x_c_info c\n# TYPE x_c_info gauge\nx_c_info{k="v"} 2\n': "info metric",
    }
    for text, problem in bad.items():
        assert any(problem in p for p in lint(text)), (text, lint(text))
