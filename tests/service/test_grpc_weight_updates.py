"""The operator's calls over gRPC (jaxserve.v1.Admin: service/admin.py, docs/rl.md): new
weights from a folder, sleep and wake-up, behind --allow-weight-updates and the bearer token,
on a server with no HTTP port; the same checks and sentences as the HTTP routes
(test_weight_updates.py, whose perturbed folder and fresh engine these tests reuse).
"""

from __future__ import annotations

import json
import shutil

import grpc
import jax
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from safetensors.numpy import load_file, save_file

import checkpoints
from jaxserve.runtime import compiles
from service.lifecycle import State
from service.server import ServerOptions
from tests.service.conftest import serving
from tests.service.test_weight_updates import (
    PROMPT,
    TOKEN,
    call,
    fresh_greedy_text,
    write_perturbed,
)

ADMIN = "jaxserve.v1.Admin"


@pytest.fixture(scope="module")
def new_folder(tmp_path_factory):
    return write_perturbed(tmp_path_factory.mktemp("weights") / "new", seed=1)


@pytest.fixture(scope="module")
def expected(new_folder) -> str:
    return fresh_greedy_text(new_folder)


def complete(client) -> str:
    """The greedy completion of PROMPT over gRPC (as test_weight_updates.GREEDY)."""
    reply = client.generate_unary(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    return reply.text


def code_of(fn, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    """(status code, message) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kwargs)
    return err.value.code(), err.value.details()


def services(channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    md = [("authorization", f"Bearer {TOKEN}")]
    [reply] = stub.ServerReflectionInfo(iter([request]), metadata=md, timeout=10)
    return [s.name for s in reply.list_services_response.service]


def admin_calls(client):
    return {
        "UpdateWeightsFromDisk": lambda: client.update_weights_from_disk("/tmp", timeout=30),
        "Sleep": lambda: client.sleep(1, timeout=30),
        "WakeUp": lambda: client.wake_up(timeout=30),
        "IsSleeping": lambda: client.is_sleeping(timeout=30),
    }


@pytest.fixture
def admin(engine):
    """A gRPC-only server with the operator's calls and a token, and its client; awake and the
    original weights put back after."""
    with (
        serving(engine, auth_token=TOKEN, allow_weight_updates=True) as server,
        server.client(token=TOKEN) as client,
    ):
        try:
            yield server, client
        finally:
            client.wake_up(timeout=60)
            client.update_weights_from_disk(str(checkpoints.DEFAULT_MODEL_DIR), timeout=120)


def test_the_flag_needs_no_http_port_but_a_token_off_the_loopback():
    ServerOptions(allow_weight_updates=True)  # gRPC alone serves the calls
    with pytest.raises(ValueError, match="needs an auth token"):
        ServerOptions(host="0.0.0.0", allow_weight_updates=True)
    ServerOptions(host="0.0.0.0", allow_weight_updates=True, auth_token=TOKEN)


def test_admin_is_unimplemented_without_the_flag(engine):
    with serving(engine, auth_token=TOKEN) as server, server.client(token=TOKEN) as client:
        for name, fn in admin_calls(client).items():
            assert code_of(fn)[0] == grpc.StatusCode.UNIMPLEMENTED, name
        assert ADMIN not in services(client.channel)
        assert not engine.is_sleeping


def test_every_admin_call_needs_the_token(admin, engine):
    server, _ = admin
    version = engine.weights_version
    for token in (None, "wrong"):
        with server.client(token=token) as stranger:
            for name, fn in admin_calls(stranger).items():
                code, message = code_of(fn)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (name, token)
                assert "bearer token" in message
    assert not engine.is_sleeping and engine.weights_version == version
    assert ADMIN in services(admin[1].channel)


def test_a_folder_swapped_in_over_grpc_serves_as_a_fresh_engine(
    admin, engine, new_folder, expected
):
    _, client = admin
    before = complete(client)
    assert before != expected  # the perturbation shows, so the equality below means something
    mark = compiles.serving()
    version = engine.weights_version
    reply = client.update_weights_from_disk(str(new_folder), timeout=120)
    assert reply.success and reply.weights_version == version + 1
    assert reply.message == f"Serving the weights of {new_folder} (version {version + 1})."
    assert complete(client) == expected
    assert compiles.serving() - mark == 0, compiles.recent()


def test_a_bad_folder_is_invalid_argument_naming_it_as_http_does(engine, tmp_path):
    missing = tmp_path / "nowhere"
    a_file = tmp_path / "weights.safetensors"
    a_file.write_bytes(b"")
    other = tmp_path / "other"  # another model of the same shapes: its norms' epsilon differs
    shutil.copytree(checkpoints.DEFAULT_MODEL_DIR, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    shapes = tmp_path / "shapes"  # one tensor a row short
    shutil.copytree(checkpoints.DEFAULT_MODEL_DIR, shapes)
    tensors = load_file(shapes / "model.safetensors")
    name = next(n for n, a in tensors.items() if a.ndim == 2)
    save_file({**tensors, name: tensors[name][:-1]}, shapes / "model.safetensors")
    cases = [
        (missing, "no such path"),
        (a_file, "a file"),
        (other, "rms_norm_eps"),
        (shapes, name),
    ]
    with (
        serving(engine, http_port=0, auth_token=TOKEN, allow_weight_updates=True) as server,
        server.client(token=TOKEN) as client,
    ):
        before = complete(client)
        version = engine.weights_version
        for path, reason in cases:
            code, message = code_of(client.update_weights_from_disk, str(path), timeout=120)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, message)
            assert str(path) in message and reason in message, message
            assert message.endswith("."), message  # a whole sentence
            status, body = call(
                server, "POST", "/update_weights_from_disk", {"model_path": str(path)}
            )
            assert status == 400 and body["error"]["message"] == message
        code, message = code_of(
            client.update_weights_from_disk, str(other), load_format="pt", timeout=120
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "load_format='pt'" in message
        assert engine.weights_version == version
        assert complete(client) == before  # still serving the weights it had


def test_sleep_refuses_generation_until_wake_up_serves_the_same(admin, engine):
    _, client = admin
    before = complete(client)
    pool = sum(a.nbytes for a in jax.tree.leaves(engine.runner.kv))
    assert client.is_sleeping() is False
    code, message = code_of(client.sleep, 3)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "level=3" in message
    assert client.is_sleeping() is False
    mark = compiles.serving()
    reply = client.sleep(2, timeout=60)
    assert reply.is_sleeping and reply.level == 2 and reply.freed_bytes >= pool
    assert client.is_sleeping() is True
    code, message = code_of(complete, client)
    assert code == grpc.StatusCode.UNAVAILABLE and "asleep" in message, message
    code, message = code_of(lambda: list(client.generate(PROMPT, max_tokens=4, timeout=30)))
    assert code == grpc.StatusCode.UNAVAILABLE and "asleep" in message, message
    code, message = code_of(client.sleep, 1)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "asleep already" in message
    # Its weights are on the host at level 2: nothing to place new ones like (HTTP: 503).
    code, _ = code_of(client.update_weights_from_disk, str(checkpoints.DEFAULT_MODEL_DIR))
    assert code == grpc.StatusCode.UNAVAILABLE
    client.wake_up(timeout=60)
    assert client.is_sleeping() is False
    client.wake_up(timeout=60)  # awake: nothing to do, no error
    assert complete(client) == before
    assert compiles.serving() - mark == 0, compiles.recent()
    reply = client.sleep(timeout=60)  # unset: level 1
    assert reply.level == 1 and client.is_sleeping() is True
    client.wake_up(timeout=60)
    assert complete(client) == before


async def _set_state(lifecycle, state: State) -> None:
    lifecycle.state = state  # on the server's loop, where every handler reads it


def test_wake_up_and_is_sleeping_answer_while_draining_as_over_http(engine):
    """A draining server refuses new work (generation, Sleep, weights) with UNAVAILABLE but
    still answers IsSleeping and WakeUp, as the HTTP routes do (they are not admitted)."""
    with (
        serving(engine, http_port=0, auth_token=TOKEN, allow_weight_updates=True) as server,
        server.client(token=TOKEN) as client,
    ):
        client.sleep(1, timeout=60)
        lifecycle = server.server.lifecycle
        server.call(_set_state(lifecycle, State.DRAINING))
        try:
            for fn in (lambda: complete(client), lambda: client.sleep(2)):
                code, message = code_of(fn)
                assert code == grpc.StatusCode.UNAVAILABLE and "draining" in message, message
            assert call(server, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
            assert client.is_sleeping() is True
            client.wake_up(timeout=60)
            assert client.is_sleeping() is False
            assert call(server, "POST", "/wake_up") == (200, {"is_sleeping": False})
        finally:
            server.call(_set_state(lifecycle, State.SERVING))
            client.wake_up(timeout=60)
