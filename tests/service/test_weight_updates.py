"""The operator's routes for an RL trainer in another process (service/http/admin.py,
docs/rl.md): new weights from a folder over HTTP, sleep and wake-up, behind
--allow-weight-updates and the bearer token; and the AsyncEngine's drain under them.

The folder is the embedded stories260k with every tensor perturbed, written in the Hugging Face
layout (its own safetensors names), so the served text must change and must then equal a fresh
engine's loaded from the same folder.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import checkpoints
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.runtime import compiles
from jaxserve.sampling_params import SamplingParams
from service.server import ServerOptions
from tests.service.conftest import SMALL, serving

TOKEN = "s3cret"
PROMPT = "Once upon a time"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def write_perturbed(folder, seed: int, scale: float = 0.5):
    """stories260k's folder with every tensor moved by relative noise (the same names)."""
    shutil.copytree(checkpoints.DEFAULT_MODEL_DIR, folder)
    tensors = load_file(folder / "model.safetensors")
    rng = np.random.default_rng(seed)
    moved = {
        name: (a * (1 + scale * rng.standard_normal(a.shape))).astype(a.dtype)
        for name, a in tensors.items()
    }
    save_file(moved, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def new_folder(tmp_path_factory):
    return write_perturbed(tmp_path_factory.mktemp("weights") / "new", seed=1)


def fresh_greedy_text(folder) -> str:
    """The greedy text of PROMPT from a fresh engine loaded from `folder`."""
    fresh = LLM(
        engine=Engine(
            EngineConfig(**SMALL, show_progress=False), model=checkpoints.load_model(folder)
        )
    )
    return fresh.generate([PROMPT], GREEDY)[0].text


@pytest.fixture(scope="module")
def expected(new_folder) -> str:
    """The greedy text of a fresh engine loaded from the new folder."""
    return fresh_greedy_text(new_folder)


def call(server, method: str, path: str, body: dict | None = None, token: str | None = TOKEN):
    """(status, parsed JSON body) of one HTTP call to the server's API port."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.server.http_port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers=headers,
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def complete(server) -> tuple[int, object]:
    """The greedy completion of PROMPT over HTTP: (status, text or the error body)."""
    model = call(server, "GET", "/v1/models")[1]["data"][0]["id"]
    body = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    code, out = call(server, "POST", "/v1/completions", body)
    return code, out["choices"][0]["text"] if code == 200 else out


@pytest.fixture
def admin(engine):
    """A server with the operator's routes and a token; the original weights put back after."""
    with serving(engine, http_port=0, auth_token=TOKEN, allow_weight_updates=True) as server:
        try:
            yield server
        finally:
            call(server, "POST", "/wake_up")
            code, out = call(
                server,
                "POST",
                "/update_weights_from_disk",
                {"model_path": str(checkpoints.DEFAULT_MODEL_DIR)},
            )
            assert code == 200, out


def test_the_routes_do_not_exist_without_the_flag(engine):
    with serving(engine, http_port=0, auth_token=TOKEN) as server:
        for method, path in [
            ("POST", "/update_weights_from_disk"),
            ("POST", "/sleep"),
            ("POST", "/wake_up"),
            ("GET", "/is_sleeping"),
        ]:
            code, _ = call(server, method, path, {"model_path": "/tmp"})
            assert code == 404, path


def test_the_flag_needs_a_token_off_the_loopback():
    with pytest.raises(ValueError, match="needs an auth token"):
        ServerOptions(host="0.0.0.0", http_port=0, allow_weight_updates=True)
    ServerOptions(host="0.0.0.0", http_port=0, allow_weight_updates=True, auth_token=TOKEN)


def test_a_folder_swapped_in_over_http_serves_as_a_fresh_engine(
    admin, engine, new_folder, expected
):
    code, before = complete(admin)
    assert code == 200
    assert before != expected  # the perturbation shows, so the equality below means something
    path = {"model_path": str(new_folder)}
    code, out = call(admin, "POST", "/update_weights_from_disk", path, token=None)
    assert code == 401, out
    code, out = call(admin, "POST", "/update_weights_from_disk", path, token="wrong")
    assert code == 401, out
    mark = compiles.serving()
    version = engine.weights_version
    code, out = call(admin, "POST", "/update_weights_from_disk", path)
    assert code == 200, out
    assert out["success"] is True and out["weights_version"] == version + 1
    code, after = complete(admin)
    assert code == 200
    assert after == expected
    assert compiles.serving() - mark == 0, compiles.recent()


def test_a_bad_folder_is_a_400_naming_it(admin, tmp_path):
    missing = tmp_path / "nowhere"
    code, out = call(admin, "POST", "/update_weights_from_disk", {"model_path": str(missing)})
    assert code == 400
    assert str(missing) in out["error"]["message"] and "no such path" in out["error"]["message"]
    assert out["error"]["param"] == "model_path"
    # A folder of another model of the same shapes: its norms' epsilon differs.
    other = tmp_path / "other"
    shutil.copytree(checkpoints.DEFAULT_MODEL_DIR, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    code, out = call(admin, "POST", "/update_weights_from_disk", {"model_path": str(other)})
    assert code == 400, out
    message = out["error"]["message"]
    assert str(other) in message and "another model" in message and "rms_norm_eps" in message
    code, out = call(
        admin, "POST", "/update_weights_from_disk", {"model_path": str(other), "load_format": "pt"}
    )
    assert code == 400 and out["error"]["param"] == "load_format"
    assert complete(admin)[0] == 200  # still serving the weights it had


def test_sleep_refuses_requests_until_wake_up_serves_the_same(admin, engine):
    code, before = complete(admin)
    assert code == 200
    pool = sum(a.nbytes for a in jax.tree.leaves(engine.runner.kv))
    assert call(admin, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    code, out = call(admin, "POST", "/sleep?level=3")
    assert code == 400 and out["error"]["param"] == "level"
    mark = compiles.serving()
    code, out = call(admin, "POST", "/sleep?level=2")
    assert code == 200, out
    assert out["freed_bytes"] >= pool
    assert call(admin, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    code, out = complete(admin)
    assert code == 503 and "asleep" in out["error"]["message"], out
    assert call(admin, "POST", "/wake_up") == (200, {"is_sleeping": False})
    assert complete(admin) == (200, before)
    assert compiles.serving() - mark == 0, compiles.recent()


def test_requests_before_an_update_finish_on_the_old_weights_those_after_on_the_new(
    engine, new_folder, expected
):
    """The AsyncEngine's drain: a request in flight when update_weights is called finishes on
    the old weights; one sent after the call waits, then runs on the new ones."""
    async_engine = AsyncEngine(engine=engine)
    try:

        async def text(prompt=PROMPT, params=GREEDY) -> str:
            out = ""
            async for o in async_engine.generate(prompt, params):
                out += o.text_delta
            return out

        def swap_queued() -> bool:  # the folder is read; the drain has begun
            with async_engine._lock:
                queued = async_engine._barriers + async_engine._commands
                return any(c[0] == "drained" for c in queued)

        async def scenario():
            old = await text()
            long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
            old_long = await text(params=long)
            first = asyncio.ensure_future(text(params=long))
            await asyncio.sleep(0.02)  # let it start
            update = asyncio.ensure_future(async_engine.update_weights(str(new_folder)))
            while not swap_queued():
                await asyncio.sleep(0.001)
            in_flight = not first.done()
            second = asyncio.ensure_future(text())
            results = await asyncio.gather(first, update, second)
            await async_engine.update_weights(str(checkpoints.DEFAULT_MODEL_DIR))
            return old, old_long, in_flight, results

        old, old_long, in_flight, (first, _, second) = asyncio.run(scenario())
        assert in_flight  # the first request was running when the swap was asked for
        assert first == old_long  # all 200 tokens on the old weights
        assert second == expected != old
    finally:
        async_engine.shutdown()
