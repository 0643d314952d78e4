"""A Python client of jaxserve.v1.JaxServe (blocking, thread-safe: one channel, many calls).

    with JaxServeClient("127.0.0.1:50051") as client:
        for response in client.generate("Once upon a time", max_tokens=64, temperature=0):
            print(response.text, end="", flush=True)

`generate()` returns the gRPC call itself: iterate it for responses, `cancel()` it to abort the
request on the server. Errors raise `grpc.RpcError` with the server's status code and message.
`update_weights_from_disk()`, `sleep()`, `wake_up()` and `is_sleeping()` are jaxserve.v1.Admin's
calls (a server with --allow-weight-updates; otherwise UNIMPLEMENTED), for an RL trainer.
Needs grpcio and protobuf only (no JAX), so it runs anywhere.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.auth import metadata
from service.gen.jaxserve.v1 import jaxserve_pb2 as pb
from service.gen.jaxserve.v1 import jaxserve_pb2_grpc as pb_grpc

_SCALARS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "max_tokens",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "beam_width",
    "length_penalty",
    "logprobs_mode",
)


def make_request(
    prompt: str | Sequence[int],
    *,
    request_id: str = "",
    priority: int = 0,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    logit_bias: dict[int, float] | None = None,
    structured_output: dict | None = None,
    **sampling,
) -> pb.GenerateRequest:
    """A GenerateRequest; `sampling` takes SamplingOptions' scalar fields (None: unset), and
    `structured_output` a constraint as vLLM spells it ({"json": schema}, {"regex": ...},
    {"choice": [...]}, {"grammar": ...}, {"json_object": True})."""
    unknown = set(sampling) - set(_SCALARS)
    if unknown:
        raise TypeError(f"Unknown sampling options {sorted(unknown)}; known: {_SCALARS}.")
    options = pb.SamplingOptions(
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        logit_bias=logit_bias or {},
        **{k: v for k, v in sampling.items() if v is not None},
    )
    if structured_output is not None:
        options.structured_output.CopyFrom(_structured(structured_output))
    request = pb.GenerateRequest(sampling=options, priority=priority, request_id=request_id)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def _structured(spec: dict) -> pb.StructuredOutput:
    """The wire form of a constraint given as vLLM's dict (one key)."""
    ((kind, value),) = spec.items()
    if kind == "json":
        return pb.StructuredOutput(
            json_schema=value if isinstance(value, str) else json.dumps(value)
        )
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(choices=list(value)))
    return pb.StructuredOutput(**{kind: value})


class JaxServeClient:
    """Calls one server. TLS when `root_certificates` (PEM) is given or `tls` is set."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        options: Sequence[tuple[str, object]] = (),
    ):
        if tls or root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.secure_channel(target, creds, options=list(options))
        else:
            self.channel = grpc.insecure_channel(target, options=list(options))
        self._metadata = metadata(token)
        self.stub = pb_grpc.JaxServeStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **kwargs
    ) -> grpc.Call:
        """Streams GenerateResponses (iterate the returned call; `cancel()` aborts)."""
        request = make_request(prompt, **kwargs)
        return self.stub.Generate(request, timeout=timeout, metadata=self._metadata)

    def generate_unary(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **kwargs
    ) -> pb.GenerateResponse:
        request = make_request(prompt, **kwargs)
        return self.stub.GenerateUnary(request, timeout=timeout, metadata=self._metadata)

    def tokenize(self, text: str, *, timeout: float | None = None) -> list[int]:
        request = pb.TokenizeRequest(text=text)
        return list(self.stub.Tokenize(request, timeout=timeout, metadata=self._metadata).token_ids)

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        request = pb.GetModelInfoRequest()
        return self.stub.GetModelInfo(request, timeout=timeout, metadata=self._metadata)

    # ---- jaxserve.v1.Admin (docs/rl.md) ----------------------------------------------------

    def update_weights_from_disk(
        self, model_path: str, *, load_format: str = "", timeout: float | None = None
    ) -> pb.UpdateWeightsFromDiskResponse:
        """Serves the weights of a checkpoint folder on the server from the next step on."""
        request = pb.UpdateWeightsFromDiskRequest(model_path=model_path, load_format=load_format)
        return self.admin.UpdateWeightsFromDisk(request, timeout=timeout, metadata=self._metadata)

    def sleep(self, level: int | None = None, *, timeout: float | None = None) -> pb.SleepResponse:
        """Drains, then frees the KV pool (level 2: the weights too); None: the server's 1."""
        request = pb.SleepRequest() if level is None else pb.SleepRequest(level=level)
        return self.admin.Sleep(request, timeout=timeout, metadata=self._metadata)

    def wake_up(self, *, timeout: float | None = None) -> None:
        self.admin.WakeUp(pb.WakeUpRequest(), timeout=timeout, metadata=self._metadata)

    def is_sleeping(self, *, timeout: float | None = None) -> bool:
        request = pb.IsSleepingRequest()
        return self.admin.IsSleeping(request, timeout=timeout, metadata=self._metadata).is_sleeping

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The health service's status name: SERVING, NOT_SERVING, ..."""
        request = health_pb2.HealthCheckRequest(service=service)
        reply = self._health.Check(request, timeout=timeout, metadata=self._metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> JaxServeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
