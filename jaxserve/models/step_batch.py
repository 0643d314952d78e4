"""The ragged step batch: what one model step reads besides params and the KV pool.

One step runs any mix of prefill chunks and single decode tokens from different sequences. Their
tokens are flattened into one row of `T` tokens (a bucket size), sequence `s` owning
`token_ids[query_start[s]:query_start[s + 1]]`; sequences are padded to `S` rows (another bucket).
Padding tokens write nowhere and padding sequences have no tokens, so the jitted step sees the same
shapes for every plan that fits the bucket and never retraces.

Three indices, not to be confused:
- a KV slot (`slot_mapping`, vLLM's name): one token's place in the KV pool, page * page_size +
  offset;
- a batch slot (`Request.slot`, `feed_slots`, `sample_slots`, the input batch's and the sampler's
  per-slot arrays): the place a running request holds from admission to finish, 0..max_num_seqs;
- a row, or sequence `s`: its place in this step's batch, 0..S, in plan order; the host's
  per-row work (engine.py) and the sampling batch count in rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

# A slot index past every batch slot: its writes are dropped.
NO_SLOT = 2**30


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Device-side metadata of one ragged step (int32; numpy on the host, jax on the device)."""

    token_ids: jax.Array  # i32[T] tokens of all sequences, back to back, then padding (0)
    positions: jax.Array  # i32[T] position of each token within its sequence (0 for padding)
    slot_mapping: jax.Array  # i32[T] slot written (page * page_size + offset); padding: past end
    query_start: jax.Array  # i32[S + 1] sequence s owns tokens [query_start[s], query_start[s + 1])
    kv_lens: jax.Array  # i32[S] tokens in sequence s's cache after this step (0: padding)
    page_tables: jax.Array  # i32[S, P] pages of sequence s in order; unused entries are 0
    logits_indices: jax.Array  # i32[S] token index of each sequence's last token (0: padding)
    num_seqs: jax.Array  # i32[] number of real sequences
    # Asynchronous scheduling: the step keeps each batch slot's last sampled token on the device
    # (ModelRunner.last_tokens), so a step can run a token the host has not seen yet.
    feed_slots: jax.Array  # i32[T] token i is slot feed_slots[i]'s last sampled token; -1: no
    sample_slots: jax.Array  # i32[S] slot that keeps sequence s's sampled token; NO_SLOT: none
    # Multi-LoRA (models/lora.py): token i runs with the adapter in device slot lora_slots[i].
    lora_slots: jax.Array  # i32[T] adapter slot of each token; 0: the base model alone
    # Speculative verification (runtime/sampling.py, `verify`). Sequence s with num_proposals[s]
    # = k > 0 runs its last token then k proposals; the logits of its first k queries are
    # sampled in the extra rows extra_start[s] .. + k - 1, which follow the real sequences
    # (rows [num_seqs, num_rows) sample but attend nothing). None: a batch without them.
    num_proposals: jax.Array = None  # i32[S] proposals of sequence s (0: none)
    extra_start: jax.Array = None  # i32[S] first extra row of sequence s's proposals
    num_rows: jax.Array = None  # i32[] rows that sample: the sequences, then the extra rows
    # Hybrid KV pools (kv_pool.KVLayout): the page tables and write slots of groups 1..G-1
    # (group 0's are page_tables and slot_mapping), [0, ...] for a uniform pool, whose step
    # then slices nothing out and runs as before. The write slots travel from the host rather
    # than being derived on the device from the tables: a token's row is not in the batch (only
    # query_start), so the device would need a search per token per group per step, while the
    # host already computes slot_mapping the same way and the extra words are few (gemma3-1b:
    # 6 per token). None: a batch built without them (uniform only).
    group_tables: jax.Array = None  # i32[G-1, S, P] like page_tables, per extra group
    group_slots: jax.Array = None  # i32[G-1, T] like slot_mapping, per extra group
    # Per-step work list of the attention backend (xla_blocked.StepPlan), derived on the device
    # from the fields above once per step, before the layer loop; None on the host.
    attention_plan: Any = None
    # The adapters' slot arrays (lora.empty_slots' tree), set by the step on the device; None on
    # the host and when the engine serves no adapters (then the model adds nothing).
    lora: Any = None


def real_tokens(batch: StepBatch) -> jax.Array:  # i32[]
    """How many of the step's tokens are real: the sequences' tokens come first, back to back,
    and the bucket's padding after them (pack_chunks)."""
    return batch.query_start[batch.num_seqs]


jax.tree_util.register_dataclass(
    StepBatch,
    data_fields=[f.name for f in dataclasses.fields(StepBatch)],
    meta_fields=[],
)


@dataclasses.dataclass(frozen=True)
class SeqChunk:
    """Host description of one sequence's share of a step: the tokens it runs this step."""

    token_ids: Sequence[int]  # new tokens this step: a prefill chunk, or the one decode token
    start_pos: int  # position of token_ids[0]; equals the tokens already in the cache
    page_table: Sequence[int]  # pages holding this sequence's cache, covering start_pos + len
    lora_slot: int = 0  # the device slot of its adapter (models/lora.py); 0: none
    # Hybrid KV pools: the page tables of groups 1..G-1 (kv_pool.KVLayout), each covering
    # start_pos + len like page_table; (): every group reads page_table (warm-ups, tests).
    group_tables: Sequence[Sequence[int]] = ()


def pack_chunks(
    chunks: Sequence[SeqChunk],
    *,
    page_size: int,
    num_tokens: int,
    num_seqs: int,
    pages_per_seq: int,
    num_pages: int,
    num_groups: int = 1,
) -> StepBatch:
    """Pads `chunks` into a numpy `StepBatch` of bucket shape (num_tokens, num_seqs), with the
    tables and write slots of `num_groups` - 1 extra KV groups (kv_pool.KVLayout)."""
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens or len(chunks) > num_seqs:
        raise ValueError(
            f"{len(chunks)} sequences with {total} tokens do not fit the bucket "
            f"({num_tokens=}, {num_seqs=})."
        )
    # Padding tokens write to slot num_pages * page_size: out of range, so the scatter drops them.
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, num_pages * page_size, np.int32)
    query_start = np.full(num_seqs + 1, total, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    page_tables = np.zeros((num_seqs, pages_per_seq), np.int32)
    logits_indices = np.zeros(num_seqs, np.int32)
    lora_slots = np.zeros(num_tokens, np.int32)
    extra = num_groups - 1
    group_tables = np.zeros((extra, num_seqs, pages_per_seq), np.int32)
    group_slots = np.full((extra, num_tokens), num_pages * page_size, np.int32)
    offset = 0
    for s, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        if n < 1:
            raise ValueError(f"Sequence {s} has no tokens to run in this step.")
        end_pos = chunk.start_pos + n
        if len(chunk.page_table) * page_size < end_pos or len(chunk.page_table) > pages_per_seq:
            raise ValueError(
                f"Sequence {s} needs {end_pos} cache slots but its page table has "
                f"{len(chunk.page_table)} pages of {page_size} (at most {pages_per_seq})."
            )
        pos = np.arange(chunk.start_pos, end_pos, dtype=np.int32)
        table = np.asarray(chunk.page_table, np.int32)
        token_ids[offset : offset + n] = chunk.token_ids
        positions[offset : offset + n] = pos
        slot_mapping[offset : offset + n] = table[pos // page_size] * page_size + pos % page_size
        query_start[s] = offset
        kv_lens[s] = end_pos
        page_tables[s, : len(table)] = table
        logits_indices[s] = offset + n - 1
        lora_slots[offset : offset + n] = getattr(chunk, "lora_slot", 0)
        groups = getattr(chunk, "group_tables", ())
        if extra and groups and len(groups) != extra:
            raise ValueError(
                f"Sequence {s} has {len(groups)} extra group tables; the pool has {extra}."
            )
        for g in range(extra):
            t = np.asarray(groups[g] if groups else chunk.page_table, np.int32)
            if len(t) * page_size < end_pos or len(t) > pages_per_seq:
                raise ValueError(
                    f"Sequence {s} needs {end_pos} cache slots but group {g + 1}'s table has "
                    f"{len(t)} pages of {page_size} (at most {pages_per_seq})."
                )
            group_tables[g, s, : len(t)] = t
            group_slots[g, offset : offset + n] = t[pos // page_size] * page_size + pos % page_size
        offset += n
    return StepBatch(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start=query_start,
        kv_lens=kv_lens,
        page_tables=page_tables,
        logits_indices=logits_indices,
        num_seqs=np.int32(len(chunks)),
        # Host-known tokens only; nothing kept (jaxserve.runtime.input_batch packs with slots).
        feed_slots=np.full(num_tokens, -1, np.int32),
        sample_slots=np.full(num_seqs, NO_SLOT, np.int32),
        num_proposals=np.zeros(num_seqs, np.int32),
        extra_start=np.zeros(num_seqs, np.int32),
        num_rows=np.int32(len(chunks)),
        lora_slots=lora_slots,
        group_tables=group_tables,
        group_slots=group_slots,
    )


@dataclasses.dataclass(frozen=True)
class StepWords:
    """A step's host inputs (a tree of StepBatch and SamplingBatch) as ONE int32 array.

    On the CPU every array passed to a jitted call is a transfer of its own (~1.5 ms a step for
    the ~30 arrays of a step, measured on `tiny`), so the runner ships one, and the step slices
    the fields back out (`from_words`). `layout` is static: the jitted step compiles once per
    layout, that is once per bucket.
    """

    words: np.ndarray  # i32[N] every leaf's values, as int32 bits, back to back
    layout: tuple  # (treedef, ((shape, dtype str), ...)), one entry per leaf


def to_words(tree) -> StepWords:
    """Every leaf of `tree` (host arrays of 4-byte dtypes or bool) in one int32 array."""
    leaves, treedef = jax.tree.flatten(tree)
    parts, specs = [], []
    for leaf in leaves:
        a = np.asarray(leaf)  # not ascontiguousarray: it turns a 0-d array into 1-d
        if not a.flags.c_contiguous:
            a = a.copy()
        if a.dtype == np.bool_:
            words = a.astype(np.int32)
        elif a.dtype.itemsize == 4:
            words = a.view(np.int32)
        else:
            raise ValueError(f"A step input of dtype {a.dtype} cannot travel as int32 words.")
        parts.append(words.reshape(-1))
        specs.append((a.shape, a.dtype.str))
    return StepWords(np.concatenate(parts), (treedef, tuple(specs)))


def _fields(words, layout: tuple, convert):
    """The tree `to_words` packed, each leaf `convert(part, dtype)` of its slice of `words`."""
    treedef, specs = layout
    leaves, offset = [], 0
    for shape, dtype in specs:
        size = math.prod(shape)
        leaves.append(convert(words[offset : offset + size].reshape(shape), np.dtype(dtype)))
        offset += size
    return jax.tree.unflatten(treedef, leaves)


def _device_leaf(part: jax.Array, dtype: np.dtype) -> jax.Array:
    if dtype == np.bool_:
        return part != 0
    if dtype == np.int32:
        return part
    return jax.lax.bitcast_convert_type(part, dtype)


def from_words(words: jax.Array, layout: tuple):
    """The tree `to_words` packed, sliced back out of words (i32[N]) inside the jitted step."""
    return _fields(words, layout, _device_leaf)


def words_views(words: np.ndarray, layout: tuple):
    """The tree `to_words` packed, as numpy views into `words` (i32[N], on the host).

    Writing a field writes the words: a packer fills a step in place and ships the words as they
    are. Views of 4-byte dtypes have the field's dtype; a bool field (no 4-byte bool exists) is an
    int32 view holding 0 or 1, which reads as a truth value the same way.
    """
    return _fields(words, layout, _host_view)


def _host_view(part: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return part if dtype == np.bool_ else part.view(dtype)
