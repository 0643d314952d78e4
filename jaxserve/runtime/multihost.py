"""Multi-host meshes: one controller process per host, process 0 leads, the others follow.

JAX runs a mesh that spans hosts as multi-controller SPMD: every process runs the same program,
each feeding its own devices, and every jitted step must be called by all of them in the same
order. So one engine runs per host, built identically (same config, same model, same buckets);
only process 0 schedules and serves gRPC, and before each step it broadcasts the packed batch:

    process 0:   schedule -> pack -> StepLink.send(batch) -> step
    process k:   StepLink.receive() -> step                (ModelRunner.follow, until released)

The broadcast is one fixed-shape int32 buffer (the largest bucket's batch, padded), sent with
`jax.experimental.multihost_utils.broadcast_one_to_all`: a jitted sum over the processes' devices,
compiled once at warm-up. The model step itself is XLA's SPMD program over the whole mesh; the
followers' copies of the (replicated) sampled tokens are simply dropped.

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

    def template(self, num_tokens: int, num_seqs: int) -> tuple[StepBatch, SamplingBatch]:
        """An all-padding batch of this shape: the shapes and dtypes a message decodes into."""
        batch = pack_chunks(
            [],
            page_size=self.page_size,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            pages_per_seq=self.pages_per_seq,
            num_pages=self.num_pages,
        )
        return batch, SamplingBatch.empty(num_seqs)


class StepLink:
    """Sends each step's (StepBatch, SamplingBatch) from process 0 to every other process.

    Message: i32[3 + slots], a header [kind, num_tokens, num_seqs] then each array's values (as
    int32 bits) in a slot sized for the largest bucket, so every message has one shape.
    """

    def __init__(
        self,
        *,
        page_size: int,
        pages_per_seq: int,
        num_pages: int,
        max_tokens: int,
        max_seqs: int,
    ):
        self._bucket = _Bucket(page_size, pages_per_seq, num_pages)
        largest = jax.tree.leaves(self._bucket.template(max_tokens, max_seqs))
        sizes = [max(int(np.size(a)), 1) for a in largest]
        self._offsets = np.cumsum([3, *sizes])  # slot i: [offsets[i], offsets[i + 1])
        self._length = int(self._offsets[-1])

    def send(self, batch: StepBatch, sampling: SamplingBatch) -> None:
        """Process 0: hands this step to the followers (blocks until they all have it)."""
        num_tokens, num_seqs = len(batch.token_ids), len(batch.kv_lens)
        message = self._header(_STEP, num_tokens, num_seqs)
        for i, leaf in enumerate(jax.tree.leaves((batch, sampling))):
            bits = _as_int32(leaf)
            message[self._offsets[i] : self._offsets[i] + bits.size] = bits
        self._broadcast(message)

    def receive(self) -> tuple[StepBatch, SamplingBatch] | None:
        """A follower: the next step process 0 sent, or None once it released the followers."""
        message = self._broadcast(np.zeros(self._length, np.int32))
        kind, num_tokens, num_seqs = (int(x) for x in message[:3])
        if kind == _STOP:
            return None
        if kind != _STEP:
            raise RuntimeError(f"Unexpected multi-host message kind {kind}.")
        template = self._bucket.template(num_tokens, num_seqs)
        leaves, treedef = jax.tree.flatten(template)
        values = [
            _from_int32(message[self._offsets[i] : self._offsets[i] + np.size(leaf)], leaf)
            for i, leaf in enumerate(leaves)
        ]
        return jax.tree.unflatten(treedef, values)

    def stop(self) -> None:
        """Process 0: releases the followers from `ModelRunner.follow` (call it once, at exit)."""
        self._broadcast(self._header(_STOP, 0, 0))

    def warm_up(self) -> None:
        """Every process, in step: compiles the broadcast before serving starts."""
        self._broadcast(self._header(_WARM_UP, 0, 0))

    def _header(self, kind: int, num_tokens: int, num_seqs: int) -> np.ndarray:
        message = np.zeros(self._length, np.int32)
        message[:3] = kind, num_tokens, num_seqs
        return message

    def _broadcast(self, message: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(message))


def _as_int32(a) -> np.ndarray:
    """The values of a 4-byte (or bool) array as flat int32 bits."""
    a = np.ascontiguousarray(a).reshape(-1)
    return a.astype(np.int32) if a.dtype == np.bool_ else a.view(np.int32)


def _from_int32(bits: np.ndarray, like) -> np.ndarray:
    like = np.asarray(like)
    values = bits.astype(np.bool_) if like.dtype == np.bool_ else bits.view(like.dtype)
    return values.reshape(like.shape)
