"""`InputBatch`: the host side of the device batch, kept per batch slot and packed with numpy.

A running request keeps its batch slot (`Request.slot`) from admission to finish, and with it
everything a step needs of it that does not change from step to step: its page table and its
sampling parameters. They live here in arrays indexed by slot and change only by deltas: a slot
that gets a new owner is filled once; a page table grows by the pages the scheduler added since
the last step (a page per `page_size` tokens). Packing a plan is then a handful of vectorised
numpy operations over its rows, with no per-row Python beyond reading the plan itself, so the
host cost of a 256-row decode step stays far below the step. Each token bucket keeps one
buffer, the int32 words the runner ships (batch.StepWords), and packing writes the fields in
place through views into it: no arrays are allocated per step.

Pending tokens (asynchronous scheduling, see scheduler.py) are PENDING_TOKEN in the plan: the
step takes each from `feed_slots` (the slot whose last sampled token it is) on the device.

A hybrid KV pool (kv_pool.KVLayout, `num_groups` > 1) has a page table per group: group 0's is
`tables`, the others' are `group_tables[1:]`, each copied by the same deltas from the
ScheduledSeq's `group_tables`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from jaxserve.models.step_batch import (
    NO_SLOT,
    StepBatch,
    StepWords,
    pack_chunks,
    to_words,
    words_views,
)
from jaxserve.runtime.buckets import pick_bucket
from jaxserve.runtime.sampling import SamplingBatch
from jaxserve.scheduling.request import PENDING_TOKEN, Request
from jaxserve.scheduling.types import ScheduledSeq


class InputBatch:
    """Per-slot host arrays of the running requests; packs plans into bucket-shaped batches."""

    def __init__(
        self,
        *,
        max_seqs: int,
        pages_per_seq: int,
        page_size: int,
        num_pages: int,
        token_buckets: Sequence[int],
        seq_bucket_for: Callable[[int], int],
        num_groups: int = 1,
    ):
        if num_groups < 1:
            raise ValueError(f"An input batch needs num_groups >= 1 KV groups, not {num_groups}.")
        self.max_seqs = max_seqs
        self.num_groups = num_groups
        self.page_size = page_size
        self.num_pages = num_pages
        self.token_buckets = tuple(token_buckets)
        self.seq_bucket_for = seq_bucket_for
        # i32[G, slots, P] each KV group's page tables; `tables` is group 0's (a view).
        self.group_tables = np.zeros((num_groups, max_seqs, pages_per_seq), np.int32)
        self.tables = self.group_tables[0]  # i32[slots, P]
        # Per extra group (1..G-1), the lists copied and their filled lengths, as for group 0.
        self._group_of: list[list] = [[None] * max_seqs for _ in range(num_groups - 1)]
        self._group_len: list[list[int]] = [[0] * max_seqs for _ in range(num_groups - 1)]
        self._table_len = [0] * max_seqs  # pages of tables[slot] that are filled
        # The KV manager's list each row copies (KVCacheManager.table_of): a request that was
        # preempted and admitted again, even to the same slot, has a new one.
        self._table_of: list[list[int] | None] = [None] * max_seqs
        self._owner: list[Request | None] = [None] * max_seqs
        # Sampling parameters by slot, filled when a slot gets its owner.
        self.temperature = np.zeros(max_seqs, np.float32)
        self.top_k = np.zeros(max_seqs, np.int32)
        self.top_p = np.ones(max_seqs, np.float32)
        self.min_p = np.zeros(max_seqs, np.float32)
        self.seeds = np.zeros(max_seqs, np.uint32)
        self.logprobs = np.full(max_seqs, -1, np.int32)  # top-n asked; -1: no logprobs at all
        self.processed = np.zeros(max_seqs, np.bool_)  # logprobs_mode "processed"
        # Prompt logprobs asked, and the prompt's length: a chunk before the prompt's last
        # token then makes the step compute them (sampling.prompt_logprobs).
        self.prompt_logprobs = np.zeros(max_seqs, np.bool_)
        self.prompt_len = np.zeros(max_seqs, np.int32)
        # Rows that need per-row work on the host every step (logit bias, min_tokens,
        # penalties): rare, so the common row costs nothing for them.
        self.special = np.zeros(max_seqs, np.bool_)
        # Rows whose tokens a grammar constrains (structured output): their mask rows are
        # filled per step by the engine.
        self.constrained = np.zeros(max_seqs, np.bool_)
        # The device slot of each row's adapter (0: none), set when the row is (re)admitted.
        self.lora_slot = np.zeros(max_seqs, np.int32)
        self._buffers: dict[int, _Buffer] = {}  # by token bucket: one packed step's memory

    def owner(self, slot: int) -> Request | None:
        """The request whose parameters slot `slot` holds (None before its first claim)."""
        return self._owner[slot]

    def _claim(self, slot: int, req: Request) -> None:
        """Slot `slot` now belongs to `req`: its sampling parameters in."""
        p = req.sampling_params
        if p.seed is None:
            raise ValueError(f"Request {req.request_id!r} reached the batch without a seed.")
        self._owner[slot] = req
        self.temperature[slot] = p.temperature
        self.top_k[slot] = p.top_k
        self.top_p[slot] = p.top_p
        self.min_p[slot] = p.min_p
        self.seeds[slot] = p.seed
        self.logprobs[slot] = -1 if p.logprobs is None else p.logprobs
        self.processed[slot] = p.logprobs_mode == "processed"
        self.special[slot] = bool(p.logit_bias or p.min_tokens or p.has_penalties)
        self.constrained[slot] = p.structured_output is not None
        self.prompt_logprobs[slot] = p.prompt_logprobs is not None
        self.prompt_len[slot] = req.num_prompt_tokens

    def _refresh_slot(self, seq: ScheduledSeq) -> None:
        """Brings `seq`'s slot up to date: its owner's parameters, and its page table."""
        slot, table = seq.slot, seq.page_table
        if self._owner[slot] is not seq.request:
            self._claim(slot, seq.request)
        # Admission gives the adapter its device slot; a request admitted again (a new table)
        # may find it in another one.
        self.lora_slot[slot] = seq.request.lora_slot
        if self._table_of[slot] is not table:  # a new table: nothing of the old one stays
            self._table_of[slot] = table
            self.tables[slot] = 0
            self._table_len[slot] = 0
        have = self._table_len[slot]
        if len(table) < have:
            raise ValueError(
                f"Request {seq.request_id!r}'s page table shrank from {have} to "
                f"{len(table)} pages while it held slot {slot}."
            )
        self.tables[slot, have : len(table)] = table[have:]
        self._table_len[slot] = len(table)
        if self.num_groups > 1:
            self._refresh_groups(seq)

    def _refresh_groups(self, seq: ScheduledSeq) -> None:
        """Copies the new entries of `seq`'s extra group tables (groups 1..G-1) into its slot."""
        slot, groups = seq.slot, seq.group_tables
        if len(groups) != self.num_groups - 1:
            raise ValueError(
                f"Request {seq.request_id!r} brings {len(groups)} extra group tables; the KV "
                f"pool has {self.num_groups} groups, so it needs {self.num_groups - 1}."
            )
        for g, table in enumerate(groups):
            if self._group_of[g][slot] is not table:  # a new table: nothing of the old one stays
                self._group_of[g][slot] = table
                self.group_tables[g + 1, slot] = 0
                self._group_len[g][slot] = 0
            have = self._group_len[g][slot]
            if len(table) < have:
                raise ValueError(
                    f"Request {seq.request_id!r}'s group {g + 1} page table shrank from {have} "
                    f"to {len(table)} pages while it held slot {slot}."
                )
            self.group_tables[g + 1, slot, have : len(table)] = table[have:]
            self._group_len[g][slot] = len(table)

    def pack(self, seqs: Sequence[ScheduledSeq]) -> PackedStep:
        """The step batch and sampling rows of a plan's `seqs`, padded to their bucket.

        Written in place into the bucket's one int32 buffer (`PackedStep`); the caller fills the
        rows whose requests need per-row host work (`special_rows`) before dispatching it.
        """
        n = len(seqs)
        # Field by field at C speed (ScheduledSeq is a named tuple): a Python loop that appends
        # four numbers per row cost ~1.3 us a row, a third of a 256-row step's packing.
        requests, _, slot_list, token_lists, start_list, tables, sample_list, proposals, groups = (
            zip(*seqs, strict=True) if n else ((),) * 9
        )
        owner, table_of, table_len = self._owner, self._table_of, self._table_len
        # The deltas: slots with a new owner, or whose page table is new or grew.
        stale = [
            row
            for row, slot, request, table in zip(range(n), slot_list, requests, tables, strict=True)
            if owner[slot] is not request
            or table_of[slot] is not table
            or len(table) != table_len[slot]
        ]
        if self.num_groups > 1:  # the extra groups' tables grow on their own (local windows)
            known = tuple(zip(self._group_of, self._group_len, strict=True))
            stale = sorted(
                set(stale).union(
                    row
                    for row, slot, seq_groups in zip(range(n), slot_list, groups, strict=True)
                    if len(seq_groups) != len(known)
                    or any(
                        t is not of[slot] or len(t) != lens[slot]
                        for t, (of, lens) in zip(seq_groups, known, strict=True)
                    )
                )
            )
        for row in stale:
            self._refresh_slot(seqs[row])
        tokens_list = list(itertools.chain.from_iterable(token_lists))
        len_list = list(map(len, token_lists))
        total = len(tokens_list)
        num_tokens = pick_bucket(self.token_buckets, max(total, 1))
        num_seqs = self.seq_bucket_for(num_tokens)
        if n > num_seqs:
            raise ValueError(f"{n} sequences do not fit the bucket ({num_tokens=}, {num_seqs=}).")
        buf = self._buffers.get(num_tokens)
        if buf is None:
            buf = self._buffers[num_tokens] = _Buffer(self, num_tokens, num_seqs)
        buf.reset()
        b, sb = buf.batch, buf.sampling
        slots = np.array(slot_list, np.int32)
        starts = np.array(start_list, np.int32)
        sample = np.array(sample_list, np.bool_)
        ps = self.page_size
        tokens = np.array(tokens_list, np.int32)
        if total == n:  # decodes only (the common step): a token per row, no repeat needed
            ends = np.arange(1, n + 1, dtype=np.int32)
            kv_lens = starts + 1
            positions, token_slots = starts, slots
        else:
            lens = np.array(len_list, np.int32)
            ends = np.cumsum(lens, dtype=np.int32)
            kv_lens = starts + lens
            row_of = np.repeat(np.arange(n, dtype=np.int32), lens)  # i32[total] token's row
            positions = starts[row_of] + (np.arange(total, dtype=np.int32) - (ends - lens)[row_of])
            token_slots = slots[row_of]
        pending = tokens == PENDING_TOKEN
        b.token_ids[:total] = np.where(pending, 0, tokens)
        b.feed_slots[:total] = np.where(pending, token_slots, -1)
        b.positions[:total] = positions
        b.lora_slots[:total] = self.lora_slot[token_slots]
        b.slot_mapping[:total] = self.tables[token_slots, positions // ps] * ps + positions % ps
        b.query_start[1 : n + 1] = ends
        b.query_start[n + 1 :] = total
        b.kv_lens[:n] = kv_lens
        b.page_tables[:n] = self.tables[slots]
        if self.num_groups > 1:  # i32[G-1, slots, P]: the extra groups' tables and write slots
            extra = self.group_tables[1:]
            b.group_tables[:, :n] = extra[:, slots]
            b.group_slots[:, :total] = extra[:, token_slots, positions // ps] * ps + positions % ps
        b.logits_indices[:n] = ends - 1
        b.num_seqs[...] = n
        b.num_rows[...] = n
        b.sample_slots[:n] = np.where(sample, slots, NO_SLOT)

        sb.temperature[:n] = self.temperature[slots]
        sb.top_k[:n] = self.top_k[slots]
        sb.top_p[:n] = self.top_p[slots]
        sb.min_p[:n] = self.min_p[slots]
        sb.seeds[:n] = self.seeds[slots]
        sb.processed_logprobs[:n] = self.processed[slots]
        sb.positions[:n] = kv_lens
        sb.slots[:n] = slots
        if any(proposals):  # speculative verification rows: rare, so a loop over them
            self._pack_proposals(b, sb, proposals, slots, starts, ends - (kv_lens - starts))
        asked = self.logprobs[slots]
        # Rows whose chunk holds a prompt token with a next prompt token: rare, so a loop.
        prompt_rows = (
            self.prompt_logprobs[slots] & (starts < self.prompt_len[slots] - 1)
        ).nonzero()[0]
        for row in prompt_rows.tolist():
            seq = seqs[row]
            prompt = seq.request.prompt_token_ids
            if seq.end_pos < len(prompt):  # the next chunk's first token follows this one's last
                sb.next_prompt_token[row] = prompt[seq.end_pos]
        # Array methods, not np.any / np.flatnonzero: their Python wrappers cost more than the
        # work on a few rows.
        sb.want_top_logprobs[...] = (sample & (asked > 0)).any()
        sb.want_logprobs[...] = (sample & (asked >= 0)).any()
        sb.want_prompt_logprobs[...] = prompt_rows.size > 0
        # Grammar rows that sample this step: the engine fills their masks (rare rows).
        constrained = (self.constrained[slots] & sample).nonzero()[0]
        sb.constrained[...] = constrained.size > 0
        return PackedStep(b, sb, self.special[slots].nonzero()[0], buf, constrained)

    def _pack_proposals(self, b, sb, proposals, slots, starts, firsts) -> None:
        """The extra sampling rows of the verification rows (StepBatch.num_proposals): past
        the sequences, one per proposal, each sampling the logits of the query before its
        proposal with its sequence's parameters and (seed, position) key.

        proposals: each sequence's count; slots, starts, firsts: i32[n] each sequence's batch
        slot, first position and first token in the step."""
        n = len(proposals)
        m = n
        for row, k in enumerate(proposals):
            if not k:
                continue
            if m + k > len(b.num_proposals):
                raise ValueError(
                    f"{n} sequences and {m + k - n} proposals do not fit the "
                    f"{len(b.num_proposals)} sampling rows of the bucket."
                )
            slot, rows, ks = slots[row], slice(m, m + k), np.arange(k, dtype=np.int32)
            b.num_proposals[row] = k
            b.extra_start[row] = m
            b.logits_indices[rows] = firsts[row] + ks
            sb.temperature[rows] = self.temperature[slot]
            sb.top_k[rows] = self.top_k[slot]
            sb.top_p[rows] = self.top_p[slot]
            sb.min_p[rows] = self.min_p[slot]
            sb.seeds[rows] = self.seeds[slot]
            sb.processed_logprobs[rows] = self.processed[slot]
            sb.positions[rows] = starts[row] + 1 + ks  # the position each one samples for
            sb.slots[rows] = slot
            m += k
        b.num_rows[...] = m


class _Buffer:
    """One token bucket's step inputs: a padding template and the words a pack writes into.

    Every field of the StepBatch and SamplingBatch is a numpy view into `words`, so packing
    writes the int32 array the runner ships (batch.StepWords) directly: no arrays allocated, no
    concatenation. The buffer is reused by the next pack of its bucket: the runner is handed a
    copy (`PackedStep.words`), since XLA:CPU may read a large host array in place while the step
    runs.
    """

    def __init__(self, inputs: InputBatch, num_tokens: int, num_seqs: int):
        padding = pack_chunks(
            [],
            page_size=inputs.page_size,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            pages_per_seq=inputs.tables.shape[1],
            num_pages=inputs.num_pages,
            num_groups=inputs.num_groups,
        )
        packed = to_words((padding, SamplingBatch.empty(num_seqs)))
        self.template, self.layout = packed.words, packed.layout  # i32[N] an all-padding step
        self.words = self.template.copy()  # i32[N] what the fields below view
        self.batch, self.sampling = words_views(self.words, self.layout)

    def reset(self) -> None:
        """Every field back to padding (one copy of the template)."""
        np.copyto(self.words, self.template)


@dataclasses.dataclass(frozen=True)
class PackedStep:
    """A packed plan: host views of its step inputs, and the words behind them."""

    batch: StepBatch  # numpy views into the bucket's words
    sampling: SamplingBatch  # likewise; its bool fields are i32 views holding 0 or 1
    special_rows: np.ndarray  # i64[k] rows whose requests need per-row host work (`special`)
    _buffer: _Buffer
    constrained_rows: np.ndarray = None  # i64[c] sampling rows a grammar constrains

    @property
    def words(self) -> StepWords:
        """What crosses to the device: a copy, taken once every row is filled, that the next
        pack cannot change."""
        return StepWords(self._buffer.words.copy(), self._buffer.layout)
