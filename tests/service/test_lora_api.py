"""LoRA adapters through the front ends: the OpenAI `model` field, /v1/models, vLLM's
load/unload routes behind --allow-runtime-lora, and the gRPC `lora` field.

The embedded stories260k with random adapters written in PEFT's saved format (numpy and
safetensors: the layout is what tests/models/test_lora_parity.py checks against peft itself).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import openai
import pytest
from safetensors.numpy import save_file

import checkpoints
from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.models.lora import TARGET_MODULES, module_shapes
from service.gen.jaxserve.v1 import jaxserve_pb2 as pb
from tests.service.conftest import SMALL, serving

PROMPT = "Once upon a time"


def save_peft(folder, config, *, seed: int, rank: int = 4):
    """A random LoRA on every projection of every layer, as peft's save_pretrained writes it."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (n_in, n_out) in module_shapes(config).items():
            block = "self_attn" if module[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, n_in**-0.5, (rank, n_in))
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, rank**-0.5, (n_out, rank))
    folder.mkdir(parents=True)
    save_file(
        {k: v.astype(np.float32) for k, v in tensors.items()}, folder / "adapter_model.safetensors"
    )
    peft_config = dict(
        peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(TARGET_MODULES)
    )
    (folder / "adapter_config.json").write_text(json.dumps(peft_config))
    return folder


@pytest.fixture(scope="module")
def stories():
    return checkpoints.load_model()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, stories):
    root = tmp_path_factory.mktemp("adapters")
    return [save_peft(root / name, stories.config, seed=i) for i, name in enumerate("abc")]


@pytest.fixture(scope="module")
def lora_engine(stories, folders) -> Engine:
    """The embedded stories260k with adapters tiny-a and tiny-b from the command line."""
    lora = (f"tiny-a={folders[0]}", f"tiny-b={folders[1]}")
    config = EngineConfig(**SMALL, lora=lora, max_lora_rank=8, show_progress=False)
    return Engine(config, model=stories)


def post(server, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.server.http_port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_runtime_loading_is_off_without_its_flag(lora_engine, folders):
    with serving(lora_engine, http_port=0) as server:
        code, _ = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "y"})
        assert code == 404


@pytest.fixture(scope="module")
def server(lora_engine):
    with serving(lora_engine, http_port=0, allow_runtime_lora=True) as handle:
        yield handle


def complete(client, model: str, **kwargs) -> list[str]:
    params = dict(max_tokens=12, temperature=0.0) | kwargs
    response = client.completions.create(model=model, prompt=PROMPT, **params)
    assert response.model == model
    return [c.text for c in response.choices]


def test_models_lists_the_adapters_with_the_base_as_parent(server):
    cards = server.openai().models.list().data
    base = cards[0].id
    assert [(c.id, getattr(c, "parent", None)) for c in cards] == [
        (base, None),
        ("tiny-a", base),
        ("tiny-b", base),
    ]
    assert server.openai().models.retrieve("tiny-b").root == "b"  # the folder's name, no path


def test_the_model_field_picks_the_adapter_and_n_carries_it(server):
    client = server.openai()
    base_id = client.models.list().data[0].id
    base = complete(client, base_id)
    a, b = complete(client, "tiny-a"), complete(client, "tiny-b")
    assert len({base[0], a[0], b[0]}) == 3  # each adapter changes the greedy text
    assert complete(client, "tiny-a") == a  # and serves it again the same way
    # n = 2 with a seed: sample i is the single request of seed + i, under the same adapter.
    pair = complete(client, "tiny-a", n=2, seed=7, temperature=1.0)
    assert pair == [complete(client, "tiny-a", seed=s, temperature=1.0)[0] for s in (7, 8)]
    assert pair != complete(client, base_id, n=2, seed=7, temperature=1.0)


def test_an_unknown_model_is_a_404(server):
    with pytest.raises(openai.NotFoundError, match="'tiny-z' does not exist"):
        complete(server.openai(), "tiny-z")


def test_grpc_names_the_adapter(server):
    client = server.openai()
    with grpc.insecure_channel(server.target) as channel:
        generate = channel.unary_unary(
            "/jaxserve.v1.JaxServe/GenerateUnary",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        sampling = pb.SamplingOptions(max_tokens=12, temperature=0.0)
        reply = generate(pb.GenerateRequest(text=PROMPT, sampling=sampling, lora="tiny-b"))
        assert reply.text == complete(client, "tiny-b")[0]
        with pytest.raises(grpc.RpcError) as err:
            generate(pb.GenerateRequest(text=PROMPT, sampling=sampling, lora="tiny-z"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'tiny-z' is not loaded" in err.value.details()


def test_adapters_load_and_unload_while_serving(server, folders, lora_engine):
    client = server.openai()
    before = lora_engine.metrics.stats.compiles_after_warmup
    load = {"lora_name": "tiny-c", "lora_path": str(folders[2])}
    assert post(server, "/v1/load_lora_adapter", load)[0] == 200
    c = complete(client, "tiny-c")
    assert c != complete(client, "tiny-a") and "tiny-c" in [m.id for m in client.models.list()]
    code, text = post(server, "/v1/load_lora_adapter", load)
    assert code == 400 and "'tiny-c' is loaded already" in text
    code, text = post(server, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": "/nope"})
    assert code == 400 and "adapter_config.json does not exist" in text
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "tiny-c"})[0] == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "tiny-c")
    code, text = post(server, "/v1/unload_lora_adapter", {"lora_name": "tiny-c"})
    assert code == 404 and "not loaded" in text
    # Three adapters passed through two slots: nothing compiled.
    assert lora_engine.metrics.stats.compiles_after_warmup == before == 0
