"""`jaxserve serve --ray-replicas N` (service/ray_serve.py): the prefix keys and the router's
choices on their own, then two replicas of stories260k on a loopback Ray cluster: the OpenAI
routes through Serve, prefix affinity, and a replica killed mid-load.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from service import ray_serve
from service.ray_serve import RayServeOptions, make_call, prefix_keys, prompt_text

needs_serve = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None or ray_serve.RequestRouter is None,
    reason='Ray Serve is an optional extra (pip install -e ".[serve]")',
)


# ---- prefix keys --------------------------------------------------------------------------------


def test_prompts_share_keys_exactly_as_far_as_their_chunks_agree():
    a = "x" * 200 + "alpha" * 20
    b = "x" * 200 + "beta" * 25
    ka, kb = prefix_keys(a, 64), prefix_keys(b, 64)
    assert len(ka) == len(a) // 64 and len(kb) == len(b) // 64
    assert ka[:3] == kb[:3]  # the first 192 characters are the same
    assert ka[3] != kb[3]  # the fourth chunk holds 8 x then different text
    assert all(x != y for x, y in zip(ka[3:], kb[3:], strict=False))  # chained: apart for good
    assert prefix_keys("short", 64) == ()
    # Chained: texts apart in their first chunk share no key, however alike the rest.
    c, d = prefix_keys("A" * 64 + "same" * 40, 64), prefix_keys("B" * 64 + "same" * 40, 64)
    assert not set(c) & set(d)


def test_the_text_a_request_is_routed_by():
    assert prompt_text("/v1/completions", json.dumps({"prompt": "Once"}).encode()) == "Once"
    assert prompt_text("/v1/completions", json.dumps({"prompt": [1, 2, 3]}).encode()) == "1 2 3"
    batch = json.dumps({"prompt": ["first", "second"]}).encode()
    assert prompt_text("/v1/completions", batch) == "first"
    chat = {
        "messages": [
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ]
    }
    assert prompt_text("/v1/chat/completions", json.dumps(chat).encode()) == (
        "system\nBe kind.\nuser\nHi\n"
    )
    assert prompt_text("/v1/models", b"") == ""
    assert prompt_text("/v1/completions", b"{not json") == ""
    assert prompt_text("/v1/completions", b"[1, 2]") == ""


def test_a_call_drops_hop_by_hop_headers_and_keeps_the_rest():
    call = make_call(
        "POST",
        "/v1/completions",
        [("Content-Length", "9"), ("authorization", "Bearer t"), ("Host", "x"), ("x-a", "1")],
        json.dumps({"prompt": "p" * 130}).encode(),
    )
    assert call.headers == (("authorization", "Bearer t"), ("x-a", "1"))
    assert len(call.prefix_keys) == 2


def test_options_are_checked():
    with pytest.raises(ValueError, match="--ray-replicas 0 must be at least 1"):
        RayServeOptions(replicas=0)
    with pytest.raises(ValueError, match="--ray-max-replicas 1 is below --ray-replicas 2"):
        RayServeOptions(replicas=2, max_replicas=1)
    with pytest.raises(ValueError, match="--ray-router 'random' is not one of prefix, pow2"):
        RayServeOptions(router="random")


# ---- the router's choices, without a cluster ----------------------------------------------------


class _Replica:
    def __init__(self, name):
        self.replica_id = name


class _Pending:
    def __init__(self, call):
        self.args = [call]


def _router(queue_lens: dict, imbalance=8):
    router = ray_serve.PrefixAffinityRouter.__new__(ray_serve.PrefixAffinityRouter)
    router.initialize_state(imbalance=imbalance)
    router._queue_len = lambda r: queue_lens[r.replica_id]
    return router


def _choose(router, replicas, text):
    call = make_call("POST", "/v1/completions", [], json.dumps({"prompt": text}).encode())
    import asyncio

    ranks = asyncio.run(router.choose_replicas(replicas, _Pending(call)))
    return ranks, call


@needs_serve
def test_the_router_sticks_to_a_prefix_spreads_new_ones_and_yields_to_a_long_queue():
    a, b = _Replica("a"), _Replica("b")
    lens = {"a": 0, "b": 0}
    router = _router(lens, imbalance=3)
    sys_1, sys_2 = "S1 " + "x" * 300, "S2 " + "y" * 300
    ranks, call = _choose(router, [a, b], sys_1 + " question one")
    first = ranks[0][0]
    router.on_request_routed(_Pending(call), first.replica_id, None)
    # The same system prompt, another question: the same replica, the other one ranked after it.
    ranks, _ = _choose(router, [a, b], sys_1 + " another question")
    assert ranks[0] == [first] and ranks[1] == [b if first is a else a]
    # A new prefix goes to the replica credited with fewer keys: the other one.
    ranks, call = _choose(router, [a, b], sys_2 + " hello")
    other = ranks[0][0]
    assert other is not first
    router.on_request_routed(_Pending(call), other.replica_id, None)
    # The owner's queue 4 longer than the shortest (over the imbalance of 3): two choices.
    lens[first.replica_id] = 4
    ranks, _ = _choose(router, [a, b], sys_1 + " third question")
    assert len(ranks) == 1 and set(ranks[0]) == {a, b}
    lens[first.replica_id] = 3  # at the imbalance: still the owner
    ranks, _ = _choose(router, [a, b], sys_1 + " fourth question")
    assert ranks[0] == [first]


@needs_serve
def test_the_router_prefers_the_longest_match_among_the_replicas_it_may_use():
    a, b, c = _Replica("a"), _Replica("b"), _Replica("c")
    router = _router({"a": 0, "b": 0, "c": 0})
    base = "p" * 200
    _, short = _choose(router, [a, b, c], base)
    router.on_request_routed(_Pending(short), "a", None)
    _, long = _choose(router, [a, b, c], base + "q" * 200)
    router.on_request_routed(_Pending(long), "b", None)
    router.on_request_routed(_Pending(short), "a", None)  # the short prompt again, on a
    # a now holds the first 3 keys, b the 3 after them: the longest match is b's.
    ranks, _ = _choose(router, [a, b, c], base + "q" * 200 + " and more")
    assert ranks[0] == [b]
    ranks, _ = _choose(router, [a, c], base + "q" * 200 + " and more")
    assert ranks[0] == [a]  # b is not a candidate (busy, or gone): the longest left, a's
    ranks, _ = _choose(router, [c], base + "q" * 200)
    assert ranks == [[c]]  # only c may take it: c, though it holds none of it


@needs_serve
def test_the_router_forgets_the_oldest_keys_beyond_its_bound():
    a, b = _Replica("a"), _Replica("b")
    router = _router({"a": 0, "b": 0})
    router._max_keys = 4
    _, call = _choose(router, [a, b], "z" * 64 * 6)
    router.on_request_routed(_Pending(call), "a", None)
    assert len(router._owner) == 4 and router._owned["a"] == 4
    assert call.prefix_keys[0] not in router._owner and call.prefix_keys[-1] in router._owner


# ---- two replicas on a loopback cluster ---------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port, body, timeout=120):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers.get(ray_serve.REPLICA_HEADER), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get(ray_serve.REPLICA_HEADER), e.read()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`jaxserve serve --ray-replicas 2` of the embedded model, prefix router: its HTTP port."""
    port = _free_port()
    cmd = [
        sys.executable, "-m", "jaxserve.cli", "serve", "--ray-replicas", "2",
        "--http-port", str(port), "--log-format", "text", "--max-num-seqs", "8",
        "--max-model-len", "256",
    ]  # fmt: skip
    path = tmp_path_factory.mktemp("ray-serve") / "server.log"
    with open(path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while "serving on" not in path.read_text():
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}):\n{path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("the replicas were not serving within 400 s")
            time.sleep(1)
        yield port
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@needs_serve
@pytest.mark.slow
def test_the_openai_routes_answer_through_serve(cluster):
    port = cluster
    status, replica, body = _post(port, {"prompt": "Once upon a time", "max_tokens": 8})
    assert status == 200 and replica
    out = json.loads(body)
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] == 8
    status, _, body = _post(port, {"prompt": "x", "max_tokens": -1})
    assert status == 400 and json.loads(body)["error"]["param"] == "max_tokens"
    status, _, body = _post(port, {"prompt": "Once", "max_tokens": 3, "stream": True})
    events = [line for line in body.decode().split("\n\n") if line]
    assert status == 200 and events[-1] == "data: [DONE]" and len(events) == 4
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
        assert json.loads(resp.read())["data"][0]["id"] == "stories260k"
    from tests.bench.test_batch_ray import listening_beyond_loopback

    assert listening_beyond_loopback() == []


@needs_serve
@pytest.mark.slow
def test_each_system_prompt_stays_on_one_replica(cluster):
    port = cluster
    systems = [f"System {i}: " + " ".join(f"rule{i}x{j}" for j in range(30)) for i in range(4)]
    served: dict[int, set[str]] = {}
    for user in range(4):
        for i, system in enumerate(systems):
            status, replica, _ = _post(
                port, {"prompt": f"{system} user {user} asks", "max_tokens": 2}
            )
            assert status == 200
            served.setdefault(i, set()).add(replica)
    assert all(len(names) == 1 for names in served.values()), served
    assert len(set().union(*served.values())) == 2  # and the prefixes spread over both


@needs_serve
@pytest.mark.slow
def test_a_killed_replica_fails_only_its_own_calls_and_is_replaced(cluster):
    port = cluster
    names = set()
    for i in range(12):  # new prefixes alternate between the replicas: learn both names
        names.add(_post(port, {"prompt": f"{i} " * 80 + "go", "max_tokens": 1})[1])
    assert len(names) == 2
    victim = sorted(names)[0]
    victim_pid = int(victim.rpartition(":")[2])

    def stream(i):
        body = {"prompt": f"story {i} " * 10, "max_tokens": 190, "ignore_eos": True}
        return _post(port, body | {"stream": True}, timeout=180)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        calls = [pool.submit(stream, i) for i in range(16)]
        time.sleep(0.5)
        os.kill(victim_pid, signal.SIGKILL)
        results = [c.result(timeout=200) for c in calls]
    finished, failed = 0, 0
    for status, replica, body in results:
        text = body.decode()
        if status == 200 and text.rstrip().endswith("data: [DONE]"):
            finished += 1
            continue
        failed += 1
        # The victim's calls end with an error: a 503, or an error event in the stream.
        assert replica in (victim, None), (status, replica, text[-300:])
        assert status == 503 or '"error"' in text, (status, text[-300:])
    assert finished >= 1
    print(f"{finished} finished, {failed} ended with an error")  # shown with -s: how the kill fell
    # Serve replaces the replica: a new name answers within the deadline.
    deadline, seen = time.monotonic() + 240, set()
    while time.monotonic() < deadline and not (seen - names):
        status, replica, _ = _post(port, {"prompt": f"{time.time()} " * 6, "max_tokens": 1})
        if status == 200:
            seen.add(replica)
        time.sleep(0.5)
    assert seen - names, f"no new replica answered; seen {seen}, before {names}"
    assert victim not in seen


@needs_serve
@pytest.mark.slow
def test_serve_runs_the_app_builder_as_its_cli_would():
    """`serve run service.ray_serve:app_builder replicas=1 ...` calls the builder with its
    key=value arguments and runs what it returns: the same here, on a loopback cluster."""
    from ray import serve

    from jaxserve.jobs.ray_replicas import import_ray, local_cluster

    ray = import_ray()
    port = _free_port()
    with local_cluster(ray):
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            app = ray_serve.app_builder(
                {"replicas": "1", "router": "pow2", "max_num_seqs": "4", "max_model_len": "256"}
            )
            serve.run(app, name="built")
            status, replica, body = _post(port, {"prompt": "Once upon a time", "max_tokens": 5})
            assert status == 200 and replica
            assert json.loads(body)["usage"]["completion_tokens"] == 5
        finally:
            serve.shutdown()
