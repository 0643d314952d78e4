"""KV events without a model: the wire bytes are vLLM's, and the log follows the cache exactly.

The golden payloads below were encoded by msgspec 0.23 from vLLM's own struct declarations, not
by the code under test, so the encoder must match an independent encoder byte for byte:

- GOLDEN_ARRAY, the array layout: vllm/distributed/kv_events.py after `lora_name` was added and
  before `extra_keys` (EventBatch and the events array_like, omit_defaults, tagged by class
  name);
- GOLDEN_MAP, the map layout: the same file after vllm-project/vllm#42892 (v0.28 and main:
  EventBatch still array_like; the events without array_like, so tagged maps under "type",
  omit_defaults, with every field vLLM has added since, all defaulted to None and so left out).
"""

from __future__ import annotations

import logging
import random
import re
import subprocess
import sys
import time
import types

import msgpack
import pytest

from jaxserve.engine.kv_events import KVEventPublisher, encode_batch
from jaxserve.engine_config import EngineConfig
from jaxserve.scheduling.host_pool import HostPagePool
from jaxserve.scheduling.kv_cache_manager import KVCacheManager, PageHasher
from jaxserve.scheduling.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
    external_hash,
)

# msgspec.msgpack.encode(KVEventBatch(ts=1765000000.25, events=EVENTS, data_parallel_rank=0)),
# KVEventBatch as vLLM declared it before #42892 (array-like events).
GOLDEN_ARRAY = bytes.fromhex(
    "93cb41da4cf0d01000009498ab426c6f636b53746f72656492cfffffffffffffffff07c09800017fcc80ccffcd"
    "0100cdffffce0001000004c0a3475055c098ab426c6f636b53746f726564910907940506070804c0a3435055a3"
    "73716c93ac426c6f636b52656d6f7665649207cf8000000000000000a347505591b0416c6c426c6f636b73436c"
    "656172656400"
)
# The same batch, KVEventBatch as vLLM declares it since #42892 (events as tagged maps).
GOLDEN_MAP = bytes.fromhex(
    "93cb41da4cf0d01000009488a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfff"
    "ffffffffffffff07b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739800017fcc80ccff"
    "cd0100cdffffce00010000aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c"
    "6f72615f6e616d65c088a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739109b17061"
    "72656e745f626c6f636b5f6861736807a9746f6b656e5f6964739405060708aa626c6f636b5f73697a6504a76c"
    "6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65a373716c83a474797065ac426c6f636b52"
    "656d6f766564ac626c6f636b5f6861736865739207cf8000000000000000a66d656469756da347505581a47479"
    "7065b0416c6c426c6f636b73436c656172656400"
)
EVENTS = [
    BlockStored((2**64 - 1, 7), None, (0, 1, 127, 128, 255, 256, 65535, 65536), 4, None, "GPU"),
    BlockStored((9,), 7, (5, 6, 7, 8), 4, "sql", "CPU"),
    BlockRemoved((7, 2**63), "GPU"),
    AllBlocksCleared(),
]

# vLLM's required fields of each event, in its order (vllm/distributed/kv_events.py), written
# here rather than taken from the code under test.
VLLM_FIELDS = {
    "BlockStored": [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": [],
}


def test_the_array_payload_is_what_msgspec_encodes_from_vllms_array_like_structs():
    assert encode_batch(1765000000.25, EVENTS, 0, "array") == GOLDEN_ARRAY


def test_the_map_payload_is_what_msgspec_encodes_from_vllms_current_structs():
    assert encode_batch(1765000000.25, EVENTS, 0, "map") == GOLDEN_MAP
    assert encode_batch(1765000000.25, EVENTS) == GOLDEN_MAP  # the default


def test_an_unknown_format_is_refused_with_its_value():
    expected = r"kv_events_format='json' must be one of \('map', 'array'\)"
    with pytest.raises(ValueError, match=expected):
        EngineConfig(kv_events_endpoint="tcp://127.0.0.1:5557", kv_events_format="json")
    with pytest.raises(ValueError, match=r"wire_format='Map' must be one of"):
        encode_batch(0.0, EVENTS, 0, "Map")
    assert EngineConfig().kv_events_format == "map"


def decode_events(payload: bytes, wire_format: str) -> list[tuple[str, dict]]:
    """A payload's events as (tag, fields by name), read the way a consumer of `wire_format`
    reads them, strictly: the batch is [ts, events, rank]; in "map" each event is a map whose
    first key is "type" and whose other keys are vLLM's fields, in its order; in "array" each
    is [tag, *those fields]."""
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and rank == 0
    decoded = []
    for event in events:
        if wire_format == "map":
            assert isinstance(event, dict), event
            tag = event["type"]
            assert list(event) == ["type", *VLLM_FIELDS[tag]], event
            fields = {k: v for k, v in event.items() if k != "type"}
        else:
            assert isinstance(event, list), event
            tag, *values = event
            assert len(values) == len(VLLM_FIELDS[tag]), event
            fields = dict(zip(VLLM_FIELDS[tag], values, strict=True))
        decoded.append((tag, fields))
    return decoded


def test_hashes_are_the_low_64_bits_of_the_digest_as_vllm_sends_them():
    digest = bytes(range(32))
    assert external_hash(digest) == int.from_bytes(digest, "big") & (2**64 - 1)


def _replay(events, held: set, firsts: set | None = None, wire_format: str = "map") -> None:
    """A subscriber's state from vLLM's schema, strict: no double store, no unknown removal, a
    run's parent announced before, and a run without one starting a sequence (`firsts`: the
    hashes of the sequences' first pages)."""
    for tag, f in decode_events(encode_batch(0.0, events, 0, wire_format), wire_format):
        if tag == "BlockStored":
            parent = f["parent_block_hash"]
            if parent is None:
                assert firsts is None or f["block_hashes"][0] in firsts
            else:
                assert firsts is None or any(parent == h for _, h in held)
            for h in f["block_hashes"]:
                assert (f["medium"], h) not in held
                held.add((f["medium"], h))
        elif tag == "BlockRemoved":
            for h in f["block_hashes"]:
                held.remove((f["medium"], h))
        else:
            held.clear()


def _cache(kv: KVCacheManager, host: HostPagePool) -> set:
    return {("GPU", external_hash(h)) for h in kv.published_hashes()} | {
        ("CPU", external_hash(h)) for h in host.cached_hashes()
    }


@pytest.mark.parametrize("wire_format", ["map", "array"])
@pytest.mark.parametrize("seed", range(5))
def test_the_log_follows_publishes_evictions_the_host_tier_and_drops(seed, wire_format):
    """Sequences share prefixes in a pool too small for them; evicted pages go to a small host
    tier, which evicts too. After every change the replayed events equal the cache, and a
    snapshot alone rebuilds it."""
    rng = random.Random(seed)
    ps = 4
    kv, host = KVCacheManager(12, ps, 8), HostPagePool(6)
    log = KVEventLog(ps)
    kv.events = host.events = log
    kv.on_evict = lambda page, h: host.offer(h)
    hasher = PageHasher(ps)
    stems = [[rng.randrange(50) for _ in range(3 * ps)] for _ in range(3)]
    held: set = set()
    firsts: set = set()
    for step in range(60):
        tokens = rng.choice(stems)[: ps * rng.randint(0, 3)]
        tokens += [rng.randrange(50) for _ in range(rng.randint(1, 3 * ps))]
        hashes: list[bytes] = []
        hasher.extend(hashes, tokens)
        if hashes:
            firsts.add(external_hash(hashes[0]))
        prefix = kv.match(hashes, len(tokens))
        if kv.allocate(f"s{step}", len(tokens), prefix):
            kv.publish(f"s{step}", hashes, len(tokens), lambda a, b, t=tokens: t[a:b])
            kv.free(f"s{step}")
        if rng.random() < 0.05:
            kv.drop_published()
            host.drop_cached()
        _replay(log.take(), held, firsts, wire_format)
        assert held == _cache(kv, host)
        kv.check_invariants()
        host.check_invariants()
    assert kv.stats.evictions and host.stats.host_evictions
    rebuilt: set = set()
    _replay(log.snapshot(), rebuilt, wire_format=wire_format)
    assert rebuilt == held


def test_a_full_queue_drops_and_counts_and_a_snapshot_follows():
    """With nothing draining the queue, a batch is dropped, not waited for; the next batch
    queued is then the whole cache, so a subscriber that lost the dropped one is exact again."""
    publisher = KVEventPublisher("inproc://kv-events-full", max_queue_batches=1)
    try:
        publisher._queue.put(None)  # its thread ends on it: nothing drains the queue now
        publisher._thread.join(5)
        log = KVEventLog(2)
        log.stored([b"a" * 32], None, [1, 2])
        publisher.publish_log(log)  # queued
        log.stored([b"b" * 32], b"a" * 32, [3, 4])
        publisher.publish_log(log)  # dropped: the queue holds one batch
        assert publisher.num_dropped == 1 and not len(log)
        _, first = publisher._queue.get_nowait()
        publisher.publish_log(log)  # no new event, but the snapshot is owed
        _, second = publisher._queue.get_nowait()
        assert [type(e) for e in first] == [BlockStored]
        assert second == log.snapshot() and len(second) == 3  # a clear, then both pages
        publisher.publish_log(log)
        assert publisher._queue.empty()  # owed no more
    finally:
        publisher._close_sockets()


def test_dropped_batches_are_counted_and_warned_of_at_most_every_10_s(monkeypatch, caplog):
    from jaxserve.engine import kv_events

    publisher = KVEventPublisher("inproc://kv-events-warn", max_queue_batches=1)
    try:
        publisher._queue.put(None)  # its thread ends on it: nothing drains the queue now
        publisher._thread.join(5)
        assert publisher.publish([]) is True  # the one batch the queue holds
        clock = iter([100.0, 105.0, 110.0, 115.0])  # the publisher's own clock, no one else's
        fake = types.SimpleNamespace(time=time.time, monotonic=lambda: next(clock))
        monkeypatch.setattr(kv_events, "time", fake)
        with caplog.at_level("WARNING", logger=kv_events.logger.name):
            results = [publisher.publish([BlockRemoved((1,), "GPU")] * n) for n in (3, 1, 2, 1)]
        assert results == [False] * 4 and publisher.num_dropped == 4
        # Warned at 100 s and again at 110 s (10 s later), not at 105 or 115.
        # Only the warnings: the constructor's INFO line is captured too wherever an earlier
        # test left the logger at INFO.
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert warned == [
            "KV events: the publisher's queue is full (1 batches); dropped a batch of "
            f"{n} events ({k} batches dropped so far). Subscribers get a snapshot of the "
            "cache once it drains."
            for n, k in ((3, 1), (2, 3))
        ]
    finally:
        publisher._close_sockets()


def test_without_pyzmq_the_option_names_the_extra_and_the_engine_never_imports_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "zmq", None)  # what `import zmq` meets without pyzmq
    with pytest.raises(ImportError, match=re.escape('pip install -e ".[serve]"')):
        KVEventPublisher("tcp://127.0.0.1:5557")
    code = "import sys; import jaxserve.engine.core; print('zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_a_taken_replay_port_fails_at_start_naming_both_endpoints():
    import zmq

    ctx = zmq.Context()
    taken = ctx.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(
            ValueError, match=rf"kv_events_replay_endpoint='tcp://127.0.0.1:{port}'"
        ):
            KVEventPublisher("inproc://kv-events-taken", f"tcp://127.0.0.1:{port}")
    finally:
        taken.close(linger=0)
        ctx.term()
