"""Multi-host meshes: one controller process per host, process 0 leads, the others follow.

JAX runs a mesh that spans hosts as multi-controller SPMD: every process runs the same program,
each feeding its own devices, and every jitted step must be called by all of them in the same
order. So one engine runs per host, built identically (same config, same model, same buckets);
only process 0 schedules and serves gRPC, and before each step it sends the packed batch:

    process 0:   schedule -> pack -> StepLink.send(batch) -> step
    process k:   StepLink.receive() -> step                (ModelRunner.follow, until released)

A message is the step's arrays as one int32 buffer, put in `jax.distributed`'s key-value store
(host to host, beside the devices): `send` does not wait for the followers or for any step, so
process 0 plans and dispatches step t+1 while step t runs, as on one host, and each follower
has step t+1 queued behind step t. The model step itself is XLA's SPMD program over the whole
mesh; the followers' copies of the (replicated) sampled tokens are simply dropped.

Anything else process 0 runs on the global mesh (a jitted function over sharded arrays) would
wait forever for the others: keep such calls inside the step, or send them the same way.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from jaxserve.models.step_batch import StepBatch, pack_chunks
from jaxserve.runtime.sampling import SamplingBatch

logger = logging.getLogger(__name__)

_STOP, _STEP, _WARM_UP = 0, 1, 2


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """`jax.distributed.initialize`, before anything touches a device.

    With no arguments JAX detects the cluster (TPU pod slices, SLURM, Open MPI); otherwise pass
    all three (process 0's host:port, the process count, this process's index).
    """
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
    logger.info(
        "process %d of %d: %d local devices of %d",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def is_leader() -> bool:
    """Whether this process schedules and serves (process 0); the others follow its steps."""
    return jax.process_index() == 0


def agree_min(value: int) -> int:
    """The least of `value` over all processes (e.g. KV pages each host's memory allows)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int32(value))))


@dataclasses.dataclass(frozen=True)
class _Bucket:
    page_size: int
    pages_per_seq: int
    num_pages: int
    num_groups: int = 1  # a hybrid KV pool's groups (kv_pool.KVLayout): their tables travel

    def template(self, num_tokens: int, num_seqs: int) -> tuple[StepBatch, SamplingBatch]:
        """An all-padding batch of this shape: the shapes and dtypes a message decodes into."""
        batch = pack_chunks(
            [],
            page_size=self.page_size,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            pages_per_seq=self.pages_per_seq,
            num_pages=self.num_pages,
            num_groups=self.num_groups,
        )
        return batch, SamplingBatch.empty(num_seqs)


class StepLink:
    """Sends each step's (StepBatch, SamplingBatch) from process 0 to every other process.

    Message: i32[3 + n], a header [kind, num_tokens, num_seqs] then every array of that
    bucket's step, flattened (as int32 bits) one after the other; the receiver splits them by
    the shapes of an all-padding batch of the same bucket.

    Carried by the key-value store of `jax.distributed`'s coordination service (host to host,
    message `n` under key `<link>/<n>`), not by a collective on the devices. A device
    collective (`broadcast_one_to_all`, the first way) queues behind the step in flight on
    every device, so process 0 waited for step t to end before it could dispatch step t+1,
    and asynchronous scheduling was lost across hosts (docs/multihost.md has the measurement).
    Through the store, `send` returns at once and the followers get step t+1 while step t
    runs, so every host has the next step queued.
    """

    # Links made in this process so far: every process builds the same engines in the same
    # order, so the n-th link of each process shares its keys with the n-th of the others.
    _made = 0
    # Messages kept in the store behind the newest. Process 0 sends step t only after taking in
    # step t - 2, whose collectives every follower joined (so every follower read message t - 2
    # and all before); 8 leaves a wide margin.
    KEEP = 8
    # A follower waits this long for a message at a time, then waits again (an idle server
    # sends nothing for hours); any other failure of the store ends `follow` with its error.
    WAIT_MS = 60_000

    def __init__(
        self,
        *,
        page_size: int,
        pages_per_seq: int,
        num_pages: int,
        max_tokens: int,
        max_seqs: int,
        num_groups: int = 1,
    ):
        self._bucket = _Bucket(page_size, pages_per_seq, num_pages, num_groups)
        self._max = (max_tokens, max_seqs)
        self._prefix = f"jaxserve/steps/{StepLink._made}"
        StepLink._made += 1
        self._next = 0  # the number of the next message sent or received

    def send(self, batch: StepBatch, sampling: SamplingBatch) -> None:
        """Process 0: hands this step to the followers; returns without waiting for them."""
        self._put(self._pack(_STEP, batch, sampling))

    def receive(self) -> tuple[StepBatch, SamplingBatch] | None:
        """A follower: the next step process 0 sent, or None once it released the followers."""
        message = self._take()
        kind, num_tokens, num_seqs = (int(x) for x in message[:3])
        if kind == _STOP:
            return None
        if kind != _STEP:
            raise RuntimeError(
                f"Message {self._next - 1} from process 0 has kind {kind}, where a step "
                f"({_STEP}) or the stop ({_STOP}) was due."
            )
        return self._unpack(message, num_tokens, num_seqs)

    def stop(self) -> None:
        """Process 0: releases the followers from `ModelRunner.follow` (call it once, at exit)."""
        self._put(np.array([_STOP, 0, 0], np.int32))

    def warm_up(self) -> None:
        """Every process, in step, before serving: the largest step's message goes through the
        store once (nothing compiles, but a store that cannot carry it fails here rather than
        on a request, and a follower built differently finds out)."""
        batch, sampling = self._bucket.template(*self._max)
        if is_leader():
            self._put(self._pack(_WARM_UP, batch, sampling))
            return
        message = self._take()
        if int(message[0]) != _WARM_UP:
            raise RuntimeError(
                f"The first message from process 0 has kind {int(message[0])}, not warm-up "
                f"({_WARM_UP}): the processes did not build the same engines in the same order."
            )
        self._unpack(message, *self._max)

    @staticmethod
    def _pack(kind: int, batch: StepBatch, sampling: SamplingBatch) -> np.ndarray:
        header = np.array([kind, len(batch.token_ids), len(batch.kv_lens)], np.int32)
        return np.concatenate([header, *map(_as_int32, jax.tree.leaves((batch, sampling)))])

    def _unpack(self, message: np.ndarray, num_tokens: int, num_seqs: int):
        """The (StepBatch, SamplingBatch) of a message of that bucket."""
        leaves, treedef = jax.tree.flatten(self._bucket.template(num_tokens, num_seqs))
        sizes = [int(np.size(leaf)) for leaf in leaves]
        if len(message) != 3 + sum(sizes):
            raise RuntimeError(
                f"Message {self._next - 1} from process 0 holds {len(message) - 3} values where "
                f"a step of {num_tokens} tokens and {num_seqs} sequences has {sum(sizes)}: the "
                "processes were not built with the same configuration."
            )
        ends = np.cumsum([3, *sizes])
        values = [
            _from_int32(message[ends[i] : ends[i + 1]], leaf) for i, leaf in enumerate(leaves)
        ]
        return jax.tree.unflatten(treedef, values)

    def _key(self, n: int) -> str:
        return f"{self._prefix}/{n}"

    def _put(self, message: np.ndarray) -> None:
        store, n = self._store(), self._next
        store.key_value_set_bytes(self._key(n), message.astype(np.int32).tobytes())
        self._next += 1
        if n >= self.KEEP:
            store.key_value_delete(self._key(n - self.KEEP))

    def _take(self) -> np.ndarray:
        store, key = self._store(), self._key(self._next)
        while True:
            try:
                data = store.blocking_key_value_get_bytes(key, self.WAIT_MS)
                break
            except Exception as e:  # jaxlib's runtime error: only a timeout is waited again
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self._next += 1
        return np.frombuffer(data, np.int32)

    @staticmethod
    def _store():
        """The coordination service's client that `jax.distributed.initialize` made."""
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise RuntimeError(
                f"A multi-host step link needs jax.distributed.initialize first (this process "
                f"is {jax.process_index()} of {jax.process_count()} without a coordination "
                "client); call jaxserve.runtime.multihost.initialize before building the engine."
            )
        return client


def _as_int32(a) -> np.ndarray:
    """The values of a 4-byte (or bool) array as flat int32 bits."""
    a = np.ascontiguousarray(a).reshape(-1)
    return a.astype(np.int32) if a.dtype == np.bool_ else a.view(np.int32)


def _from_int32(bits: np.ndarray, like) -> np.ndarray:
    like = np.asarray(like)
    values = bits.astype(np.bool_) if like.dtype == np.bool_ else bits.view(like.dtype)
    return values.reshape(like.shape)
