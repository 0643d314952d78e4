"""The step being built: its rows by request, the token budget left, and whom it preempted.

The running requests (running.py), admission (admission.py) and the bucket trim
(bucket_landing.py) add to one StepPlan in turn; the Scheduler then turns it into the
SchedulerOutput the engine sees (types.py). Kept apart so each of them reads the budget and adds
rows the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxserve.scheduling.request import Request
from jaxserve.scheduling.types import ScheduledSeq


@dataclasses.dataclass
class StepPlan:
    """The step's seqs by request id, the budget left and who was preempted while planning."""

    budget: int
    # The KV manager's live page tables by request id (KVCacheManager.tables): each row hands
    # its table to the step instead of copying it.
    tables: Mapping[str, list[int]]
    chunked: bool  # SchedulerConfig.enable_chunked_prefill: a prompt may run in pieces
    # A hybrid pool's tables of groups 1.. by request id (KVCacheManager.group_tables); empty
    # for a uniform pool.
    group_tables: Mapping[str, tuple[list[int], ...]] = dataclasses.field(default_factory=dict)
    seqs: dict[str, ScheduledSeq] = dataclasses.field(default_factory=dict)
    preempted: list[str] = dataclasses.field(default_factory=list)
    # (device slot, adapter) newly loaded for requests admitted in this step (lora_slots.py).
    lora_loads: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    # (source, destination) device pages: partial pages forked for requests admitted in this
    # step (prefix_sharing.py), copied before it runs.
    page_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    limit: int = dataclasses.field(init=False)  # the step's whole budget: `budget` at creation

    def __post_init__(self):
        self.limit = self.budget

    @property
    def num_tokens(self) -> int:
        """Tokens planned so far: what the budget has paid for."""
        return self.limit - self.budget

    def add(self, seq: ScheduledSeq) -> None:
        """Plans `seq`, paying its tokens from the budget."""
        self.seqs[seq.request_id] = seq
        self.budget -= len(seq.token_ids)

    def drop(self, request_id: str) -> None:
        """Unplans a request's row (it was preempted), giving its tokens back to the budget."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.budget += len(seq.token_ids)

    def chunk_len(self, req: Request, computed: int) -> int:
        """Tokens `req` may run within the budget, `computed` being in the cache already: all it
        has left, a chunk, or 0 to wait a step."""
        remaining = req.num_tokens - computed
        if remaining <= self.budget:
            return remaining
        return self.budget if self.chunked else 0

    def add_chunk(self, req: Request, n: int) -> None:
        """Plans `req`'s next `n` tokens from its `num_computed_tokens` on."""
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        self.add(
            ScheduledSeq(
                request=req,
                request_id=req.request_id,
                slot=req.slot,
                token_ids=req.token_ids(start, end),
                start_pos=start,
                page_table=self.tables[req.request_id],
                sample=end == req.num_tokens,
                group_tables=self.group_tables.get(req.request_id, ()),
            )
        )
