"""`InputBatch`: the host side of the device batch, kept per batch slot and packed with numpy.

A running request keeps its batch slot (`Request.slot`) from admission to finish, and with it
everything a step needs of it that does not change from step to step: its page table and its
sampling parameters. They live here in arrays indexed by slot and change only by deltas: a slot
that gets a new owner is filled once; a page table grows by the pages the scheduler added since
the last step (a page per `page_size` tokens). Packing a plan is then a handful of vectorised
numpy operations over its rows, with no per-row Python beyond reading the plan itself, so the
host cost of a 256-row decode step stays far below the step.

Pending tokens (asynchronous scheduling, see scheduler.py) are PENDING_TOKEN in the plan: the
step takes each from `feed_slots` (the slot whose last sampled token it is) on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxserve.batch import NO_SLOT, StepBatch
from jaxserve.buckets import pick_bucket
from jaxserve.request import PENDING_TOKEN, Request
from jaxserve.sampling import SamplingBatch
from jaxserve.scheduler_types import ScheduledSeq


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
    ):
        self.max_seqs = max_seqs
        self.page_size = page_size
        self.num_pages = num_pages
        self.token_buckets = tuple(token_buckets)
        self.seq_bucket_for = seq_bucket_for
        self.tables = np.zeros((max_seqs, pages_per_seq), np.int32)  # i32[slots, P]
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
        # Prompt logprobs asked, and the prompt's length: a chunk before the prompt's last
        # token then makes the step compute them (sampling.prompt_logprobs).
        self.prompt_logprobs = np.zeros(max_seqs, np.bool_)
        self.prompt_len = np.zeros(max_seqs, np.int32)
        # Rows that need per-row work on the host every step (logit bias, min_tokens,
        # penalties): rare, so the common row costs nothing for them.
        self.special = np.zeros(max_seqs, np.bool_)

    def owner(self, slot: int) -> Request | None:
        """The request whose parameters slot `slot` holds (None before its first claim)."""
        return self._owner[slot]

    def invalidate(self, slot: int) -> None:
        """Forgets slot `slot`'s page table, which the next pack copies whole: for a table
        changed in place rather than grown (KVCacheManager.copy_on_write)."""
        self._table_of[slot] = None

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
        self.special[slot] = bool(p.logit_bias or p.min_tokens or p.has_penalties)
        self.prompt_logprobs[slot] = p.prompt_logprobs is not None
        self.prompt_len[slot] = req.num_prompt_tokens

    def pack(self, seqs: Sequence[ScheduledSeq]) -> tuple[StepBatch, SamplingBatch, np.ndarray]:
        """The step batch and sampling rows of a plan's `seqs`, padded to their bucket.

        Returns also the rows (i64[k], into `seqs`) whose requests need per-row host work
        (`special`); the caller fills those rows of the SamplingBatch.
        """
        n = len(seqs)
        owner, table_of, table_len = self._owner, self._table_of, self._table_len
        slot_list, start_list, len_list, sample_list = [], [], [], []
        tokens_list: list[int] = []
        for seq in seqs:  # the deltas (new owners, grown page tables), and the rows' numbers
            slot = seq.slot
            if owner[slot] is not seq.request:
                self._claim(slot, seq.request)
            table = seq.page_table
            if table_of[slot] is not table:  # a new table: nothing of the old one stays
                table_of[slot] = table
                self.tables[slot] = 0
                table_len[slot] = 0
            have = table_len[slot]
            if len(table) != have:
                if len(table) < have:
                    raise ValueError(
                        f"Request {seq.request_id!r}'s page table shrank from {have} to "
                        f"{len(table)} pages while it held slot {slot}."
                    )
                self.tables[slot, have : len(table)] = table[have:]
                table_len[slot] = len(table)
            ids = seq.token_ids
            slot_list.append(slot)
            start_list.append(seq.start_pos)
            len_list.append(len(ids))
            sample_list.append(seq.sample)
            tokens_list += ids
        lens = np.array(len_list, np.int32)
        total = len(tokens_list)
        num_tokens = pick_bucket(self.token_buckets, max(total, 1))
        num_seqs = self.seq_bucket_for(num_tokens)
        if n > num_seqs:
            raise ValueError(f"{n} sequences do not fit the bucket ({num_tokens=}, {num_seqs=}).")
        slots = np.array(slot_list, np.int32)
        starts = np.array(start_list, np.int32)
        sample = np.array(sample_list, np.bool_)
        tokens = np.array(tokens_list, np.int32)
        ends = np.cumsum(lens, dtype=np.int32)
        row_of = np.repeat(np.arange(n, dtype=np.int32), lens)  # i32[total] row of each token
        positions = starts[row_of] + (np.arange(total, dtype=np.int32) - (ends - lens)[row_of])
        token_slots = slots[row_of]
        ps = self.page_size

        token_ids = np.zeros(num_tokens, np.int32)
        pending = tokens == PENDING_TOKEN
        token_ids[:total] = np.where(pending, 0, tokens)
        feed_slots = np.full(num_tokens, -1, np.int32)
        feed_slots[:total] = np.where(pending, token_slots, -1)
        pos = np.zeros(num_tokens, np.int32)
        pos[:total] = positions
        # Padding tokens write to slot num_pages * page_size: out of range, dropped.
        slot_mapping = np.full(num_tokens, self.num_pages * ps, np.int32)
        slot_mapping[:total] = self.tables[token_slots, positions // ps] * ps + positions % ps
        query_start = np.full(num_seqs + 1, total, np.int32)
        query_start[0] = 0
        query_start[1 : n + 1] = ends
        kv_lens = np.zeros(num_seqs, np.int32)
        kv_lens[:n] = starts + lens
        page_tables = np.zeros((num_seqs, self.tables.shape[1]), np.int32)
        page_tables[:n] = self.tables[slots]
        logits_indices = np.zeros(num_seqs, np.int32)
        logits_indices[:n] = ends - 1
        sample_slots = np.full(num_seqs, NO_SLOT, np.int32)
        sample_slots[:n] = np.where(sample, slots, NO_SLOT)
        batch = StepBatch(
            token_ids=token_ids,
            positions=pos,
            slot_mapping=slot_mapping,
            query_start=query_start,
            kv_lens=kv_lens,
            page_tables=page_tables,
            logits_indices=logits_indices,
            num_seqs=np.int32(n),
            feed_slots=feed_slots,
            sample_slots=sample_slots,
        )

        sb = SamplingBatch.empty(num_seqs)
        sb.temperature[:n] = self.temperature[slots]
        sb.top_k[:n] = self.top_k[slots]
        sb.top_p[:n] = self.top_p[slots]
        sb.min_p[:n] = self.min_p[slots]
        sb.seeds[:n] = self.seeds[slots]
        sb.positions[:n] = starts + lens
        sb.slots[:n] = slots
        asked = self.logprobs[slots]
        # Rows whose chunk holds a prompt token with a next prompt token: rare, so a loop.
        prompt_rows = np.flatnonzero(
            self.prompt_logprobs[slots] & (starts < self.prompt_len[slots] - 1)
        )
        for row in prompt_rows.tolist():
            seq = seqs[row]
            prompt = seq.request.prompt_token_ids
            if seq.end_pos < len(prompt):  # the next chunk's first token follows this one's last
                sb.next_prompt_token[row] = prompt[seq.end_pos]
        sb = dataclasses.replace(
            sb,
            want_top_logprobs=np.bool_(np.any(sample & (asked > 0))),
            want_logprobs=np.bool_(np.any(sample & (asked >= 0))),
            want_prompt_logprobs=np.bool_(prompt_rows.size > 0),
        )
        special_rows = np.flatnonzero(self.special[slots])
        return batch, sb, special_rows
