"""KV events on a real engine over real ZeroMQ sockets on 127.0.0.1 (docs/kv_events.md).

The subscriber here is written from vLLM's published schema (vllm/distributed/kv_events.py),
not from jaxserve's code: each message is [topic, 8-byte big-endian sequence number, msgpack
payload], the payload `[ts, events, data_parallel_rank]`, each event laid out as the engine was
configured: in "map" (vLLM since #42892) a map keyed by field name with the class name under
"type", in "array" (vLLM before) an array whose first element is the class name. Replaying the
events of a random workload on a pool small enough to evict (and a host tier small enough to
evict too) must give exactly the pages the engine's prefix cache holds, device and host tier,
with no sequence number skipped.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time

import msgpack
import pytest
import zmq

from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.kv_events import external_hash
from tests.engine.conftest import TINY, drain

PAGE = 16
VOCAB = 512  # stories260k
TOPIC = b"kv@test@stories"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# vLLM's fields of each event, in its order: the map layout's keys after "type", the array
# layout's elements after the tag.
VLLM_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _named(event, wire_format: str) -> tuple[str, dict]:
    """One event as (class name, fields by name), read as a consumer of `wire_format` does."""
    if wire_format == "map":
        assert isinstance(event, dict), f"a map-layout event must be a map: {event!r}"
        tag = event.get("type")
        assert tag in VLLM_FIELDS, f"unknown event {tag!r}"
        assert tuple(event) == ("type", *VLLM_FIELDS[tag]), event
        return tag, {k: v for k, v in event.items() if k != "type"}
    assert isinstance(event, list), f"an array-layout event must be an array: {event!r}"
    tag, *values = event
    assert tag in VLLM_FIELDS, f"unknown event {tag!r}"
    assert len(values) == len(VLLM_FIELDS[tag]), event
    return tag, dict(zip(VLLM_FIELDS[tag], values, strict=True))


class Subscriber:
    """vLLM's KV event consumer, minimal: the set of (medium, block hash) held, per message."""

    def __init__(self, ctx: zmq.Context, port: int, wire_format: str = "map"):
        self.wire_format = wire_format
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        # The engine's endpoint names a host, so it connects (vLLM's rule): the subscriber
        # binds, as llm-d's indexer does.
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.seqs: list[int] = []
        self.payloads: dict[int, bytes] = {}
        self.held: set[tuple[str, int]] = set()
        self.tokens: dict[int, list[int]] = {}  # block hash -> its tokens
        self.first_pages: set[tuple[int, ...]] = set()  # tokens of blocks with no parent

    def settle(self, seconds: float = 0.5) -> None:
        """Lets the subscription reach the engine's PUB before its first batch: a socket takes
        in a new connection only while its owner calls it, so this polls meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert not self.sock.poll(50), "a batch came before any request"

    def receive(self, count: int, timeout_s: float = 30.0) -> None:
        """Takes messages until `count` were received in all."""
        deadline = time.monotonic() + timeout_s
        while len(self.seqs) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"received {len(self.seqs)} of {count} batches"
            if self.sock.poll(int(left * 1000)):
                topic, seq, payload = self.sock.recv_multipart()
                assert topic == TOPIC and len(seq) == 8
                self.seqs.append(int.from_bytes(seq, "big"))
                self.payloads[self.seqs[-1]] = payload
                self.apply(payload)

    def apply(self, payload: bytes) -> None:
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and abs(ts - time.time()) < 600 and rank == 0
        for event in events:
            tag, f = _named(event, self.wire_format)
            if tag == "BlockStored":
                hashes, parent, tokens, medium = (
                    f["block_hashes"],
                    f["parent_block_hash"],
                    f["token_ids"],
                    f["medium"],
                )
                assert f["block_size"] == PAGE and len(tokens) == len(hashes) * PAGE
                assert f["lora_id"] is None and f["lora_name"] is None
                assert medium in ("GPU", "CPU")
                # A run continues a page announced before, or starts a sequence.
                assert parent is None or parent in self.tokens, f"unknown parent {parent}"
                if parent is None:
                    self.first_pages.add(tuple(tokens[:PAGE]))
                for i, h in enumerate(hashes):
                    assert 0 <= h < 2**64
                    assert (medium, h) not in self.held, f"{medium} block {h} stored twice"
                    self.held.add((medium, h))
                    page_tokens = tokens[i * PAGE : (i + 1) * PAGE]
                    assert self.tokens.setdefault(h, page_tokens) == page_tokens
            elif tag == "BlockRemoved":
                for h in f["block_hashes"]:
                    medium = f["medium"]
                    assert (medium, h) in self.held, f"{medium} block {h} removed, never stored"
                    self.held.discard((medium, h))
            else:  # AllBlocksCleared: _named checked it has no fields
                self.held.clear()


def _cache_of(engine: Engine) -> set[tuple[str, int]]:
    """The engine's prefix cache, as a router should see it."""
    s = engine.scheduler
    return {("GPU", external_hash(h)) for h in s.kv.published_hashes()} | {
        ("CPU", external_hash(h)) for h in s.offload.host.cached_hashes()
    }


def _socket_fds() -> int:
    """The process's open sockets, once no socket closed by an earlier test (ZeroMQ closes
    them on its own threads) is still going: two readings 0.2 s apart agree."""
    count, deadline = -1, time.monotonic() + 5
    while time.monotonic() < deadline:
        last, count = count, 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own fd is closed by now
                count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        if count == last:
            break
        time.sleep(0.2)
    return count


def _workload(engine: Engine, rng: random.Random, n: int) -> list[list[int]]:
    """`n` requests, many sharing prefixes of one to three pages, some sampled twice."""
    stems = [[rng.randrange(3, VOCAB) for _ in range(3 * PAGE)] for _ in range(3)]
    prompts = []
    for _ in range(n):
        stem = rng.choice(stems)[: PAGE * rng.randint(0, 3)]
        prompt = stem + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 2 * PAGE))]
        for _ in range(rng.choice([1, 1, 2])):  # a prompt twice: its samples share pages
            params = SamplingParams(
                max_tokens=rng.randint(1, 24),
                temperature=rng.choice([0.0, 1.0]),
                seed=rng.randrange(1000),
                ignore_eos=True,
            )
            engine.add_request(prompt, params)
        prompts.append(prompt)
    return prompts


@pytest.fixture(scope="module")
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.mark.parametrize("wire_format", ["map", "array"])
def test_events_rebuild_the_prefix_cache_and_replay_fills_a_gap(stories_engine, ctx, wire_format):
    port, replay_port = _free_port(), _free_port()
    sub = Subscriber(ctx, port, wire_format)
    engine = Engine(
        EngineConfig(
            num_pages=10,
            page_size=PAGE,
            host_kv_gb=3e-5,  # a few dozen host pages: the host tier evicts too
            kv_events_endpoint=f"tcp://127.0.0.1:{port}",
            kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
            kv_events_topic=TOPIC.decode(),
            kv_events_format=wire_format,
            **TINY,
        ),
        model=stories_engine.model,
    )
    try:
        sub.settle()
        publisher = engine.kv_events
        rng = random.Random(45)
        every_prompt = []
        for _ in range(3):
            prompts = _workload(engine, rng, 10)
            every_prompt += prompts
            drain(engine)
            assert publisher.flush()
            sub.receive(publisher.num_sent)
            assert sub.held == _cache_of(engine)
        assert publisher.num_dropped == 0
        stats, offload = engine.scheduler.kv.stats, engine.scheduler.offload.stats
        assert stats.evictions > 0 and offload.pages_offloaded > 0 and offload.host_evictions > 0
        assert {m for m, _ in sub.held} == {"GPU", "CPU"}
        # Each prompt's first full page was announced with its tokens and no parent, and every
        # page announced with no parent is the first of some request's tokens.
        firsts = {tuple(p[:PAGE]) for p in every_prompt if len(p) >= PAGE}
        assert {tuple(p[:PAGE]) for p in prompts if len(p) >= PAGE} <= sub.first_pages
        assert all(
            page in firsts or any(page[: len(p)] == tuple(p) for p in every_prompt)
            for page in sub.first_pages
        )
        # New weights drop the cache: one AllBlocksCleared, and the set is empty again.
        engine.update_weights(engine.model.params)
        assert publisher.flush()
        sub.receive(publisher.num_sent)
        assert sub.held == _cache_of(engine) == set()
        _workload(engine, rng, 4)
        drain(engine)
        assert publisher.flush()
        sub.receive(publisher.num_sent)
        assert sub.held == _cache_of(engine) != set()
        # No batch lost or reordered: every sequence number from 0, in order.
        assert sub.seqs == list(range(publisher.num_sent))

        # A subscriber that missed everything from `start` on asks the replay socket.
        start = len(sub.seqs) // 2
        # A DEALER, as a REQ would take only the first of the replies: [b"", start] is what a
        # REQ sends, and each reply comes back as [b"", seq, payload].
        req = ctx.socket(zmq.DEALER)
        req.connect(f"tcp://127.0.0.1:{replay_port}")
        req.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = []
        while True:
            assert req.poll(10_000), "the replay socket did not answer"
            empty, seq, payload = req.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        req.close(linger=0)
        assert [s for s, _ in replayed] == list(range(start, len(sub.seqs)))
        assert all(payload == sub.payloads[s] for s, payload in replayed)
        late = Subscriber.__new__(Subscriber)
        late.held, late.tokens, late.first_pages = set(), {}, set()
        late.wire_format = wire_format
        for seq in range(start):
            late.apply(sub.payloads[seq])
        for _, payload in replayed:
            late.apply(payload)
        assert late.held == _cache_of(engine)
    finally:
        engine.close()
        sub.sock.close(linger=0)


def test_off_opens_no_socket_and_records_nothing(stories_engine):
    before = _socket_fds()
    engine = Engine(EngineConfig(num_pages=10, page_size=PAGE, **TINY), model=stories_engine.model)
    _workload(engine, random.Random(3), 6)
    drain(engine)
    s = engine.scheduler
    assert engine.kv_events is None and s.kv.events is None and s.offload.host.events is None
    assert s.kv.published_hashes()  # the cache itself is on
    assert _socket_fds() == before
    engine.close()


def test_a_bad_endpoint_is_refused_with_its_value():
    with pytest.raises(ValueError, match=r"kv_events_endpoint='127\.0\.0\.1:5557' must be"):
        EngineConfig(kv_events_endpoint="127.0.0.1:5557")
    with pytest.raises(ValueError, match=r"'tcp://localhost' must name a host and a port"):
        EngineConfig(kv_events_endpoint="tcp://localhost")
    with pytest.raises(ValueError, match="need kv_events_endpoint"):
        EngineConfig(kv_events_replay_endpoint="tcp://127.0.0.1:5558")
