"""The model runner: one jitted step (forward + logits + sampling) over bucketed shapes.

    runner = ModelRunner(model, RunnerConfig(...))
    runner.precompile()                     # every (num_tokens, num_seqs) bucket, once
    out = runner.execute(batch, sampling)   # async dispatch; np.asarray(out.token_ids) syncs

The runner owns the device state (params and the donated KV pool) and never looks at requests:
it runs whatever packed batch it is given. Shapes come only from buckets, so serving never traces
again after `precompile`; `num_compiles` counts traces to prove it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Sequence

import jax

from checkpoints.loaded import LoadedModel, model_for
from jaxserve.batch import SeqChunk, StepBatch, pack_chunks
from jaxserve.kv_pages import KVPages, init_kv_pages
from jaxserve.sampling import SampleOutput, SamplingBatch, sample

logger = logging.getLogger(__name__)


def bucket_ladder(smallest: int, largest: int, factor: int = 2) -> tuple[int, ...]:
    """smallest, smallest*factor, ... capped by (and always ending at) largest."""
    if smallest < 1 or largest < smallest or factor < 2:
        raise ValueError(f"Invalid bucket ladder: {smallest=}, {largest=}, {factor=}.")
    sizes, size = [], smallest
    while size < largest:
        sizes.append(size)
        size *= factor
    sizes.append(largest)
    return tuple(sizes)


def pick_bucket(ladder: Sequence[int], n: int) -> int:
    """The smallest bucket that holds n."""
    for size in ladder:
        if size >= n:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {ladder[-1]}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """Device-side sizes: the KV pool and the bucket ladders the step is compiled for."""

    num_pages: int
    page_size: int
    max_model_len: int
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    attention_backend: str = "auto"

    def __post_init__(self):
        if self.num_pages < 1 or self.page_size < 1:
            raise ValueError(f"Need {self.num_pages=} >= 1 and {self.page_size=} >= 1.")
        if list(self.token_buckets) != sorted(set(self.token_buckets)) or not self.token_buckets:
            raise ValueError(f"token_buckets={self.token_buckets} must be strictly increasing.")
        if list(self.seq_buckets) != sorted(set(self.seq_buckets)) or not self.seq_buckets:
            raise ValueError(f"seq_buckets={self.seq_buckets} must be strictly increasing.")

    @property
    def pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.page_size)

    def buckets(self) -> list[tuple[int, int]]:
        """Every (num_tokens, num_seqs) shape a step can take: a sequence runs >= 1 token."""
        shapes = []
        for t in self.token_buckets:
            for s in self.seq_buckets:
                shapes.append((t, s))
                if s >= t:  # a larger seq bucket would only ever hold empty rows
                    break
        return shapes


class ModelRunner:
    """Holds params and the KV pool on the device and runs bucketed steps."""

    def __init__(self, model: LoadedModel, config: RunnerConfig):
        self.model = model
        self.config = config
        self.module = model_for(model.config, model.dtype, config.attention_backend)
        self.kv: KVPages = init_kv_pages(
            model.config,
            num_pages=config.num_pages,
            page_size=config.page_size,
            dtype=model.dtype,
        )
        self.num_compiles = 0
        # The pool is donated: the step updates it in place instead of copying it every step.
        self._step = jax.jit(self._step_impl, donate_argnums=(1,))

    def _step_impl(self, params, kv: KVPages, batch: StepBatch, sampling: SamplingBatch):
        self.num_compiles += 1  # runs only while tracing: counts compilations
        hidden, kv = self.module.apply({"params": params}, kv, batch)
        logits = self.module.apply(
            {"params": params}, hidden[batch.logits_indices], method=self.module.logits
        )
        return sample(logits, sampling), kv

    def execute(self, batch: StepBatch, sampling: SamplingBatch) -> SampleOutput:
        """Dispatches one step; returns device arrays without waiting for them."""
        out, self.kv = self._step(self.model.params, self.kv, batch, sampling)
        return out

    def pack(self, chunks: Sequence[SeqChunk]) -> StepBatch:
        """Pads host chunks to the smallest bucket that holds them."""
        num_tokens = pick_bucket(self.config.token_buckets, sum(len(c.token_ids) for c in chunks))
        num_seqs = pick_bucket(self.config.seq_buckets, len(chunks))
        return pack_chunks(
            chunks,
            page_size=self.config.page_size,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            pages_per_seq=self.config.pages_per_seq,
            num_pages=self.config.num_pages,
        )

    def precompile(self, progress: bool = True) -> float:
        """Compiles every bucket now (writing nothing to the cache); returns seconds spent."""
        from tqdm import tqdm

        start = time.perf_counter()
        buckets = self.config.buckets()
        for num_tokens, num_seqs in tqdm(
            buckets, desc="compiling", disable=not progress, unit="bucket"
        ):
            # All-padding batches: every token writes past the pool's end, so no page changes.
            batch = pack_chunks(
                [],
                page_size=self.config.page_size,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                pages_per_seq=self.config.pages_per_seq,
                num_pages=self.config.num_pages,
            )
            out = self.execute(batch, SamplingBatch.empty(num_seqs))
            jax.block_until_ready(out.token_ids)
        return time.perf_counter() - start


@functools.cache
def enable_compilation_cache(path: str) -> None:
    """Points JAX's persistent compilation cache at `path` (start-up compiles then reload)."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
