"""jaxserve replicas on Ray Serve: several engines behind one OpenAI HTTP address, each request
routed to the replica whose prefix cache most likely holds its prompt.

Why a Serve deployment of our own and not Ray Serve LLM's `LLMServer`: `ray.serve.llm` (where
its `build_openai_app` and `PrefixCacheAffinityRouter` are exported) refuses to import unless
vLLM or SGLang is installed, and its engine interface is written around theirs. Serve's own
request-router API (`ray.serve.request_router.RequestRouter`, public) is what that router is
built on, so jaxserve's router (`PrefixAffinityRouter`, below) is one too.

The data flow, one direction, one typed object per hop:

    client --HTTP--> Serve's proxy --> `Ingress` (FastAPI, catch-all) --`Call`--> the router
    picks a `Replica` --> the replica's own jaxserve HTTP app on 127.0.0.1 (the whole OpenAI
    front end: validation, streaming, errors, metrics) --> back as a `Head` then body chunks.

Each replica is one `JaxServeServer` (service/server.py) with its HTTP API on a loopback port of
its own and no gRPC, so every route behaves as on `jaxserve serve --http-port`; the hop inside
the replica costs a local connection per request. A replica whose engine failed fails Serve's
health check and is replaced. A request whose replica dies before its first byte is sent again
once to another; one that dies mid-stream ends with an error event (streamed) or a 503.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import os
import random
import socket
from collections.abc import AsyncIterator, Sequence

from fastapi import Request  # module level: FastAPI resolves the route's annotations here

logger = logging.getLogger("jaxserve.ray_serve")

SERVE_MISSING = 'Ray Serve is not installed: pip install -e ".[serve]"'
ROUTERS = ("prefix", "pow2")
# Prompt text is hashed in chunks of this many characters: a chunk is roughly a KV page of
# tokens for English text (16 tokens of ~4 characters), the unit the prefix cache shares.
CHUNK_CHARS = 64
# Every answer names the replica that gave it (host:pid), for operators and tests.
REPLICA_HEADER = "x-jaxserve-replica"
_HOP_BY_HOP = {"connection", "content-length", "transfer-encoding", "keep-alive", "host"}


@dataclasses.dataclass(frozen=True)
class Call:
    """One HTTP request on its way from the ingress to a replica.

    `prefix_keys[i]` is a hash of the prompt's first (i + 1) * CHUNK_CHARS characters: two
    calls share a key exactly where their prompts share that prefix, which is what the router
    matches on."""

    method: str
    path: str  # with the query string, e.g. "/v1/models?x=1"
    headers: tuple[tuple[str, str], ...]
    body: bytes
    prefix_keys: tuple[bytes, ...] = ()


@dataclasses.dataclass(frozen=True)
class Head:
    """The first item a replica yields for a call: the status and headers of its answer."""

    status: int
    headers: tuple[tuple[str, str], ...]


def prompt_text(path: str, body: bytes) -> str:
    """The text a request's prefix is matched on: a completion's prompt (token ids as decimal
    text), a chat's messages (role and content in order); "" for other routes or bodies that do
    not parse (the replica answers those; routing them by load alone is right)."""
    if not body or not path.startswith(("/v1/completions", "/v1/chat/completions")):
        return ""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    if "messages" in data and isinstance(data["messages"], list):
        parts = []
        for m in data["messages"]:
            if isinstance(m, dict):
                parts.append(f"{m.get('role', '')}\n{_content_text(m.get('content'))}\n")
        return "".join(parts)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch of prompts goes where its first one's prefix is
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prefix_keys(text: str, chunk_chars: int = CHUNK_CHARS) -> tuple[bytes, ...]:
    """Chained hashes of `text`'s whole chunks of `chunk_chars` characters (see `Call`)."""
    keys, h = [], b""
    for i in range(0, len(text) - chunk_chars + 1, chunk_chars):
        h = hashlib.blake2b(h + text[i : i + chunk_chars].encode(), digest_size=12).digest()
        keys.append(h)
    return tuple(keys)


def make_call(method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes) -> Call:
    """The `Call` for one HTTP request, its prefix keys computed once here in the ingress."""
    kept = tuple((k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP)
    return Call(method, path, kept, body, prefix_keys(prompt_text(path, body)))


def _import_serve():
    try:
        from ray import serve
    except ImportError:
        raise ImportError(SERVE_MISSING + ".") from None
    return serve


try:  # Ray is an extra: without it the routers are None and `serve_on_ray` says how to install
    from ray.serve.request_router import FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter
except ImportError:
    RequestRouter = None

if RequestRouter is not None:

    class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
        """Sends a request to the replica that last served the longest prefix of its prompt,
        unless that replica's queue is `imbalance` requests longer than the shortest one's (then
        the power of two choices: two random replicas, the shorter queue wins). A prompt no
        replica has served goes to the replica credited with the fewest prefix keys (then the
        shorter queue), so that new prefixes spread evenly over the caches.

        The table maps prefix keys (`Call.prefix_keys`) to a replica, newest first, at most
        `max_keys` of them (the oldest forgotten first, as the replicas' caches forget them);
        a replica that dies leaves it. It is a guess at what each cache holds, not a view of
        it: a replica may have evicted a page the table still credits it with. Not FIFO
        (Serve's FIFOMixin hands a chosen replica to the oldest request waiting, whatever its
        prompt): each request goes to the replica chosen for it."""

        def initialize_state(self, imbalance: int = 8, max_keys: int = 200_000):
            self._imbalance = imbalance
            self._max_keys = max_keys
            self._owner: collections.OrderedDict[bytes, object] = collections.OrderedDict()
            self._owned: collections.Counter = collections.Counter()  # keys per replica

        def _queue_len(self, replica) -> int:
            n = self.replica_queue_len_cache.get(replica.replica_id)
            return 0 if n is None else n

        def _best_match(self, keys: Sequence[bytes], candidates: dict):
            for key in reversed(keys):  # the longest shared prefix first
                owner = self._owner.get(key)
                if owner in candidates:
                    return candidates[owner]
            return None

        async def choose_replicas(self, candidate_replicas, pending_request=None):
            if not candidate_replicas:
                return []
            call = _call_of(pending_request)
            by_id = {r.replica_id: r for r in candidate_replicas}
            best = None if call is None else self._best_match(call.prefix_keys, by_id)
            shortest = min(self._queue_len(r) for r in candidate_replicas)
            if best is None and call is not None and call.prefix_keys:
                best = min(
                    candidate_replicas,
                    key=lambda r: (self._owned[r.replica_id], self._queue_len(r)),
                )
            if best is not None and self._queue_len(best) - shortest <= self._imbalance:
                rest = [r for r in candidate_replicas if r.replica_id != best.replica_id]
                return [[best], rest] if rest else [[best]]
            return [_two_choices(candidate_replicas)]

        def on_request_routed(self, pending_request, replica_id, result):
            call = _call_of(pending_request)
            if call is None:
                return
            for key in call.prefix_keys:
                before = self._owner.get(key)
                if before != replica_id:
                    if before is not None:
                        self._owned[before] -= 1
                    self._owned[replica_id] += 1
                self._owner[key] = replica_id
                self._owner.move_to_end(key)
            while len(self._owner) > self._max_keys:
                _, owner = self._owner.popitem(last=False)
                self._owned[owner] -= 1

        def on_replica_actor_died(self, replica_id):
            super().on_replica_actor_died(replica_id)
            for key in [k for k, v in self._owner.items() if v == replica_id]:
                del self._owner[key]
            self._owned.pop(replica_id, None)

    class PowerOfTwoRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
        """Two random replicas, the shorter queue wins: Serve's default policy, here so that
        `--ray-router pow2` measures the same code path as the prefix router without it."""

        async def choose_replicas(self, candidate_replicas, pending_request=None):
            return [_two_choices(candidate_replicas)] if candidate_replicas else []


_ROUTER_PATHS = {
    "prefix": "service.ray_serve.PrefixAffinityRouter",
    "pow2": "service.ray_serve.PowerOfTwoRouter",
}


def _two_choices(replicas: list) -> list:
    return random.sample(replicas, min(2, len(replicas)))


def _call_of(pending_request) -> Call | None:
    """The request's `Call`, found by its field: the ingress, pickled by value, may hold its own
    copy of the class, so an isinstance check would miss it."""
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(getattr(arg, "prefix_keys", None), tuple):
            return arg
    return None


def keep_serve_grpc_on_loopback() -> None:
    """In a Serve replica's process: its inter-deployment gRPC server binds 127.0.0.1, not every
    interface ("[::]:0", Ray 2.60's replica.py, with no option for it).

    Only for a cluster on this machine's loopback (jaxserve's local one): on a cluster of several
    nodes the other nodes' proxies and handles reach replicas at their node's address. It
    replaces a private name of Ray's; where a Ray lacks it, nothing changes and
    tests/service/test_ray_serve.py says what listens beyond the loopback."""
    try:
        from ray.serve._private import replica
    except ImportError:
        return
    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "jaxserve_loopback", False):
        return

    def on_loopback(server, address: str):
        return original(server, address.replace("[::]", "127.0.0.1", 1))

    on_loopback.jaxserve_loopback = True
    replica.add_port_to_grpc_server = on_loopback


class Replica:
    """One Serve replica: a jaxserve engine and its OpenAI HTTP app on a loopback port."""

    async def __init__(self, config, server_options: dict, loopback: bool = True):
        import aiohttp

        from jaxserve.engine.async_engine import AsyncEngine
        from service.server import JaxServeServer, ServerOptions

        if loopback:
            keep_serve_grpc_on_loopback()
        options = ServerOptions(
            **{**server_options, "host": "127.0.0.1", "grpc": False, "http_port": 0},
            metrics_port=None,
        )
        self._server = JaxServeServer(lambda: AsyncEngine(config), options)
        await self._server.start()
        await self._server.wait_ready()  # raises the warm-up's error: Serve retries the replica
        self._base = f"http://127.0.0.1:{self._server.http_port}"
        self._name = f"{socket.gethostname()}:{os.getpid()}"
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )
        logger.info("replica %d serving on %s", os.getpid(), self._base)

    async def handle(self, call: Call) -> AsyncIterator[Head | bytes]:
        """Streams the local HTTP app's answer to `call`: a `Head`, then its body's chunks."""
        async with self._session.request(
            call.method, self._base + call.path, headers=list(call.headers), data=call.body
        ) as resp:
            kept = [(k, v) for k, v in resp.headers.items() if k.lower() not in _HOP_BY_HOP]
            headers = (*kept, (REPLICA_HEADER, self._name))
            yield Head(resp.status, headers)
            async for chunk in resp.content.iter_any():
                yield chunk

    async def info(self) -> dict:
        """Where this replica runs (its process id and its HTTP app's port): for tests and
        operators."""
        return {"pid": os.getpid(), "name": self._name, "http": self._base}

    async def check_health(self) -> None:
        """Serve's health check: a replica whose engine failed is replaced."""
        if self._server.failed.is_set():
            raise RuntimeError("the replica's engine failed; Serve replaces the replica")

    async def __del__(self):
        try:
            await self._session.close()
            await self._server.stop(0)
        except Exception:  # the process is going away either way
            pass


def _ingress_class(serve):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # the OpenAI routes only

    @serve.ingress(app)
    class Ingress:
        """Serve's HTTP entry: every route of the OpenAI API forwarded to a replica."""

        def __init__(self, replicas, loopback: bool = True):
            if loopback:
                keep_serve_grpc_on_loopback()
            self._replicas = replicas.options(stream=True)

        async def _open(self, call: Call):
            """The replica's stream and its `Head`, trying a second replica once if the first
            died before answering (nothing was sent to the client yet)."""
            for attempt in (1, 2):
                stream = self._replicas.handle.remote(call)
                try:
                    return stream, await stream.__anext__()
                except Exception as e:  # a dead replica: RayActorError and its kin
                    if attempt == 2:
                        raise
                    logger.warning("a replica failed before answering (%s); trying another", e)

        async def forward(self, request: Request, path: str):
            path = "/" + path + (f"?{request.url.query}" if request.url.query else "")
            call = make_call(request.method, path, request.headers.items(), await request.body())
            try:
                stream, head = await self._open(call)
            except Exception as e:
                return JSONResponse(
                    {
                        "error": {
                            "message": f"The replica serving this request failed: {e}. Retry it.",
                            "type": "ServiceUnavailable",
                            "param": None,
                            "code": 503,
                        }
                    },
                    status_code=503,
                )
            media = dict((k.lower(), v) for k, v in head.headers).get("content-type", "")

            async def body():
                try:
                    async for chunk in stream:
                        yield chunk
                except Exception as e:
                    logger.warning("a replica failed mid-answer: %s", e)
                    if media.startswith("text/event-stream"):
                        err = {
                            "error": {
                                "message": f"The replica serving this stream failed: {e}.",
                                "type": "ServiceUnavailable",
                                "param": None,
                                "code": 503,
                            }
                        }
                        yield f"data: {json.dumps(err)}\n\n".encode()

            return StreamingResponse(body(), status_code=head.status, headers=dict(head.headers))

        # Real classes, not this module's postponed strings: Serve pickles the class by value,
        # and FastAPI would look the strings up in globals the pickle does not carry.
        forward.__annotations__ = {"request": Request, "path": str}  # noqa: RUF012
        app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])(forward)

    return Ingress


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayServeOptions:
    """How many replicas, on what, routed how."""

    replicas: int = 2
    max_replicas: int | None = None  # autoscale from `replicas` to this on queue length
    router: str = "prefix"  # or "pow2"
    cpus_per_replica: float = 1.0
    devices_per_replica: int = 1
    max_ongoing_requests: int = 256  # per replica: Serve queues the rest in the ingress
    target_ongoing_requests: float = 32.0  # the autoscaler's target, per replica

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"--ray-replicas {self.replicas} must be at least 1.")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(
                f"--ray-max-replicas {self.max_replicas} is below --ray-replicas "
                f"{self.replicas}: it is the autoscaler's upper bound."
            )
        if self.router not in ROUTERS:
            raise ValueError(f"--ray-router {self.router!r} is not one of {', '.join(ROUTERS)}.")
        if self.cpus_per_replica <= 0:
            raise ValueError(f"--ray-cpus-per-replica {self.cpus_per_replica} must be > 0.")


def build_app(
    config,
    server_options: dict,
    options: RayServeOptions,
    actor_options: dict,
    loopback: bool = True,
):
    """The Serve application: `Ingress` in front of `options.replicas` `Replica`s; `loopback`:
    the cluster is this machine's loopback alone (`keep_serve_grpc_on_loopback`)."""
    serve = _import_serve()
    from ray.serve.config import RequestRouterConfig

    scaling = {}
    if options.max_replicas is not None and options.max_replicas > options.replicas:
        scaling["autoscaling_config"] = {
            "min_replicas": options.replicas,
            "max_replicas": options.max_replicas,
            "target_ongoing_requests": options.target_ongoing_requests,
        }
    else:
        scaling["num_replicas"] = options.replicas
    replica = serve.deployment(
        Replica,
        name="JaxserveReplica",
        ray_actor_options=actor_options,
        max_ongoing_requests=options.max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=_ROUTER_PATHS[options.router]
        ),
        health_check_period_s=2,
        health_check_timeout_s=30,
        **scaling,
    ).bind(config, server_options, loopback)
    ingress = serve.deployment(
        _ingress_class(serve),
        name="JaxserveIngress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,
    )
    return ingress.bind(replica, loopback)


def app_builder(args: dict):
    """`serve run service.ray_serve:app_builder model=PATH replicas=2 router=prefix ...`: the
    same application from Serve's own CLI (a config file's `import_path`). Engine options are
    `jaxserve serve`'s flags without the dashes, underscores for hyphens."""
    import argparse

    from jaxserve.engine_args import add_engine_args, engine_config_from_args
    from jaxserve.jobs.ray_replicas import _actor_options, import_ray, is_loopback

    args = dict(args)
    max_replicas = args.pop("max_replicas", None)
    options = RayServeOptions(
        replicas=int(args.pop("replicas", 2)),
        max_replicas=None if max_replicas is None else int(max_replicas),
        router=args.pop("router", "prefix"),
        cpus_per_replica=float(args.pop("cpus_per_replica", 1)),
        devices_per_replica=int(args.pop("devices_per_replica", 1)),
    )
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    argv = []
    for key, value in args.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    config = engine_config_from_args(parser.parse_args(argv), show_progress=False)
    ray = import_ray()
    actor = _actor_options(ray, options.devices_per_replica, options.cpus_per_replica)
    address = os.environ.get("RAY_ADDRESS")
    return build_app(config, {}, options, actor, loopback=address is None or is_loopback(address))


def serve_on_ray(
    config,
    server_options: dict,
    options: RayServeOptions,
    http_port: int,
    address: str | None,
    host: str = "127.0.0.1",
) -> int:
    """`jaxserve serve --ray-replicas N`: starts (or joins, with `address`) a Ray cluster, runs
    the application with Serve's HTTP proxy on 127.0.0.1:`http_port`, and serves until
    SIGTERM/SIGINT; then Serve shuts down (replicas drain their calls first)."""
    import contextlib
    import signal

    from jaxserve.jobs.ray_replicas import (
        _actor_options,
        _check_reachable,
        import_ray,
        is_loopback,
        local_cluster,
        loopback_only,
    )

    serve = _import_serve()  # first: without Ray at all, its message names the serve extra
    ray = import_ray()
    with contextlib.ExitStack() as stack:
        if address is None:
            stack.enter_context(local_cluster(ray))
        else:
            _check_reachable(address)
            stack.enter_context(loopback_only())
            ray.init(address=address, include_dashboard=False)
            stack.callback(ray.shutdown)
        actor = _actor_options(ray, options.devices_per_replica, options.cpus_per_replica)
        serve.start(http_options={"host": host, "port": http_port})
        stack.callback(serve.shutdown)
        loopback = address is None or is_loopback(address)
        app = build_app(config, server_options, options, actor, loopback=loopback)
        serve.run(app, name="jaxserve")
        logger.info(
            "serving %d replica(s) on http://%s:%d (router %s)",
            options.replicas,
            host,
            http_port,
            options.router,
        )
        print(f"serving on http://{host}:{http_port} ({options.replicas} replicas)", flush=True)
        stop = asyncio.Event()

        async def wait():
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()

        asyncio.run(wait())
    return 0
