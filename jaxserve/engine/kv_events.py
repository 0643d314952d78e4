"""Publishes the prefix cache's KV events on ZeroMQ, in vLLM's wire format (docs/kv_events.md).

So that a KV-aware router written for vLLM (vLLM's own, llm-d's KV indexer) follows jaxserve's
prefix cache unchanged, everything on the wire is as vLLM's ZmqEventPublisher sends it
(vllm/distributed/kv_events.py, msgspec structs encoded with msgspec.msgpack):

- a PUB socket sends each batch as three frames: the topic, an 8-byte big-endian sequence number
  (0, 1, 2, ... per publisher) and the msgpack payload;
- the payload is an `EventBatch`, an `array_like` struct in every vLLM version: a msgpack array
  `[ts, events, data_parallel_rank]`;
- each event is a tagged struct, laid out one of two ways (`kv_events_format`):
  - "map" (the default), vLLM's layout since vllm-project/vllm#42892: a msgpack map whose first
    key is "type" (the class name), then the fields by name in vLLM's declaration order
    (`{"type": "BlockStored", "block_hashes": ..., "parent_block_hash": ..., "token_ids": ...,
    "block_size": ..., "lora_id": ..., "medium": ..., "lora_name": ...}`). The fields vLLM
    gives a default (`extra_keys`, `group_idx`, ...) are left out, as `omit_defaults` leaves
    them out when they hold it;
  - "array", vLLM's layout before: an array whose first element is the class name, then the
    same fields in the same order (`["BlockStored", block_hashes, parent_block_hash, token_ids,
    block_size, lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`,
    `["AllBlocksCleared"]`), as they were once `lora_name` was added and before `extra_keys`:
    later array-like decoders read them too, as the fields after are optional, and earlier
    ones ignore the trailing fields they do not know;
- an optional ROUTER socket replays: a client sends a start sequence number (8 bytes,
  big-endian) and receives every buffered batch from there as `[seq, payload]`, then
  `[-1 (8 bytes, signed), b""]`.

Concurrency: the engine thread only puts a batch on a bounded queue (`publish`, never blocking);
one thread of its own (`jaxserve-kv-events`) encodes, sends, keeps the replay buffer and answers
replay requests, and is the only one that touches the sockets after they are made. A full queue
drops the batch, counts it and logs a warning; `publish_log` then sends a snapshot of the whole
cache (`KVEventLog.snapshot`) once the queue has room, so subscribers hold it exactly again.
pyzmq and msgpack are imported here only when an engine publishes (the `serve` extra).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import threading
import time

from jaxserve.scheduling.kv_events import (
    KV_EVENTS_FORMATS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventLog,
)

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay, as vLLM's
INSTALL_HINT = 'pip install -e ".[serve]"'


def event_fields(event: KVEvent) -> list:
    """One event as msgspec encodes vLLM's tagged array-like struct: the tag (the class name),
    then the fields in vLLM's order. jaxserve has no integer adapter ids: lora_id is None and
    the adapter travels as lora_name."""
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            None,  # lora_id: vLLM's deprecated integer adapter id
            event.medium,
            event.lora_name,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"{event!r} is not a KV event.")


# The names of each event's fields on the wire, in vLLM's declaration order: the map layout's
# keys after "type", and the array layout's elements after the tag.
FIELD_NAMES = {
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


def event_map(event: KVEvent) -> dict:
    """One event as msgspec encodes vLLM's tagged struct without `array_like`: "type" (msgspec's
    tag field) holding the class name first, then every field by name in vLLM's order. Fields
    with a default in vLLM are absent, as `omit_defaults` drops them when they hold it, and
    jaxserve never sets them."""
    tag, *values = event_fields(event)
    return {"type": tag, **dict(zip(FIELD_NAMES[tag], values, strict=True))}


def encode_batch(
    ts: float, events: list[KVEvent], data_parallel_rank: int = 0, wire_format: str = "map"
) -> bytes:
    """A batch's payload: vLLM's EventBatch (array-like in every layout) in msgpack, its events
    laid out as `wire_format` says ("map" or "array", docs/kv_events.md)."""
    import msgpack

    if wire_format == "map":
        encoded = [event_map(e) for e in events]
    elif wire_format == "array":
        encoded = [event_fields(e) for e in events]
    else:
        raise ValueError(f"wire_format={wire_format!r} must be one of {KV_EVENTS_FORMATS}.")
    return msgpack.packb([float(ts), encoded, data_parallel_rank])


def _import_zmq():
    try:
        import msgpack  # noqa: F401 - checked now, used on the publisher's thread
        import zmq
    except ImportError as e:
        raise ImportError(
            f"kv_events_endpoint needs pyzmq and msgpack, which are not installed ({e}); "
            f"install them with {INSTALL_HINT}."
        ) from e
    return zmq


class KVEventPublisher:
    """vLLM's PUB / ROUTER publisher of KV event batches, fed without blocking."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        max_queue_batches: int = 10_000,
        replay_batches: int = 10_000,
        data_parallel_rank: int = 0,
        wire_format: str = "map",
    ):
        if wire_format not in KV_EVENTS_FORMATS:
            raise ValueError(f"wire_format={wire_format!r} must be one of {KV_EVENTS_FORMATS}.")
        zmq = _import_zmq()
        self.wire_format = wire_format
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_batches)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=replay_batches
        )
        self._seq = itertools.count()
        self.num_dropped = 0  # batches dropped on a full queue
        self._resync = False  # a batch was dropped: `publish_log` sends a snapshot next
        self.num_sent = 0
        self._last_warning = -float("inf")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            # vLLM's rule, so its command lines mean the same here: a wildcard host, ipc:// and
            # inproc:// bind (routers connect to the engine); a named host connects (to an
            # indexer that binds, as llm-d's does).
            binds = (
                "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            )
            if binds:
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(
                f"Cannot open the KV events sockets at kv_events_endpoint={endpoint!r}, "
                f"kv_events_replay_endpoint={replay_endpoint!r}: {e}."
            ) from e
        self._running = True
        self._thread = threading.Thread(target=self._run, name="jaxserve-kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "KV events: publishing on %s (%s), replay on %s, topic %r, %s layout",
            endpoint,
            "bound" if binds else "connected",
            replay_endpoint,
            topic,
            wire_format,
        )

    def publish(self, events: list[KVEvent]) -> bool:
        """Queues one batch for sending, never waiting; False when the queue was full and the
        batch was dropped (counted, and logged at most every 10 s)."""
        try:
            self._queue.put_nowait((time.time(), events))
            return True
        except queue.Full:
            self.num_dropped += 1
            now = time.monotonic()
            if now - self._last_warning >= 10.0:
                self._last_warning = now
                logger.warning(
                    "KV events: the publisher's queue is full (%d batches); dropped a batch of "
                    "%d events (%d batches dropped so far). Subscribers get a snapshot of the "
                    "cache once it drains.",
                    self._queue.maxsize,
                    len(events),
                    self.num_dropped,
                )
            return False

    def publish_log(self, log: KVEventLog) -> None:
        """Publishes the events `log` recorded since the last call as one batch (nothing when
        there are none); after a dropped batch, a snapshot of the whole cache instead, until
        one is queued."""
        if not (len(log) or self._resync):
            return
        events = log.take()
        if self._resync:
            events = log.snapshot()  # what the dropped batches told, and everything else
        self._resync = not self.publish(events)

    def flush(self, timeout: float = 5.0) -> bool:
        """Waits until every batch queued so far is sent (or dropped by a failed send); False
        when `timeout` seconds passed first. For tests and shutdown, never the engine loop."""
        done = self._queue.all_tasks_done
        with done:
            return done.wait_for(lambda: not self._queue.unfinished_tasks, timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Sends what is queued (for up to `timeout` seconds), then closes the sockets."""
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):  # then the thread ends at its next empty poll
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    # ---- the publisher's thread -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._answer_replay()
                except Exception:
                    logger.exception("KV events: answering a replay request failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if item is None:
                self._queue.task_done()
                return
            ts, events = item
            try:
                payload = encode_batch(ts, events, self._rank, self.wire_format)
                seq = next(self._seq)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.num_sent += 1
            except Exception:
                logger.exception("KV events: sending a batch failed")
            finally:
                self._queue.task_done()

    def _answer_replay(self) -> None:
        """Sends the buffered batches from the requested sequence number on, then the end."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning(
                "KV events: a replay request must be [identity, b'', 8-byte start], got %d "
                "frames; ignored.",
                len(frames),
            )
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
