"""Bearer-token authentication: where the token comes from, and the server's check on every call.

The token is a shared secret, read from a file (preferred: it stays out of `ps` and shell
history) or from the JAXSERVE_AUTH_TOKEN environment variable. Clients send it as gRPC metadata
`authorization: Bearer <token>`. Without TLS it crosses the network in the clear, so the server
warns when a token is set on a plain-text port that is not the loopback.

Every call needs the token unless the server exempts a service by name: `--health-without-auth`
exempts grpc.health.v1.Health, since Kubernetes' gRPC probes cannot send headers. Health
answers only SERVING or NOT_SERVING, so the exemption tells a caller no more than a TCP probe.
"""

from __future__ import annotations

import hmac
import os
import pathlib

import grpc

TOKEN_ENV = "JAXSERVE_AUTH_TOKEN"
_HEADER = "authorization"


def load_token(path: str | os.PathLike | None = None, env: str = TOKEN_ENV) -> str | None:
    """The token from `path` if given, else from the environment; None when neither is set."""
    if path is not None:
        try:
            token = pathlib.Path(path).read_text().strip()
        except OSError as e:
            raise ValueError(f"Cannot read the auth token file {str(path)!r}: {e.strerror}.") from e
        if not token:
            raise ValueError(f"The auth token file {str(path)!r} is empty.")
        return token
    return os.environ.get(env, "").strip() or None


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the token (none without one)."""
    return ((_HEADER, f"Bearer {token}"),) if token else ()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call, health and reflection included, that lacks the token, except calls to
    methods whose full name starts with one of `exempt` (e.g. "/grpc.health.v1.Health/")."""

    def __init__(self, token: str, exempt: tuple[str, ...] = ()):
        self._expected = f"Bearer {token}".encode()
        self._exempt = tuple(exempt)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return None
        if self._exempt and details.method.startswith(self._exempt):
            return handler
        sent = dict(details.invocation_metadata or ()).get(_HEADER, "")
        if isinstance(sent, str):
            sent = sent.encode()
        if hmac.compare_digest(sent, self._expected):  # constant time: no timing oracle
            return handler
        return _refusal(handler, "missing" if not sent else "wrong")


def _refusal(handler: grpc.RpcMethodHandler, what: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED unread."""
    message = f"The bearer token is {what}: send metadata 'authorization: Bearer <token>'."

    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    # No request deserializer: the bytes of an unauthenticated caller are never parsed.
    return make(refuse, response_serializer=handler.response_serializer)
