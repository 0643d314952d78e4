"""The scheduler's typed messages and config: what crosses between scheduler and engine.

Plain dataclasses of host ints and lists (never device arrays), kept apart from the scheduling
logic so readers of the engine, the runner and the tests find the contract in one short file.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

from jaxserve.scheduling.request import FinishReason, Request
from jaxserve.scheduling.speculation import SpeculativeConfig

POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap", "auto")
BATCHING_MODES = ("continuous", "static", "dynamic")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Limits of one engine: batch rows, tokens per step, KV pages, and the scheduling mode."""

    max_num_seqs: int = 64  # slots: rows of the decode batch
    max_num_batched_tokens: int = 2048  # token budget of one step
    num_pages: int  # KV pool size, in pages
    page_size: int = 16  # tokens per page
    max_model_len: int  # prompt + output tokens of one request, at most
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # 'fcfs' or 'priority' (lower Request.priority first)
    # Priority policy: waiting ages a request by one priority level per this many seconds, so
    # it is ordered as if it had arrived `priority * priority_aging_s` seconds later. A request
    # of priority p therefore waits at most (p - q) * priority_aging_s behind later arrivals of
    # priority q (see request_queue.py). None: strict priority, which can starve low priorities.
    priority_aging_s: float | None = 10.0
    batching: str = "continuous"  # 'continuous', or 'static' / 'dynamic' groups for comparison
    batch_size: int | None = None  # group size of static/dynamic batching; None: max_num_seqs
    dynamic_timeout_s: float = 0.05  # dynamic: start a short group once its oldest waited this
    # The runner's token buckets (model_runner.bucket_ladder). Given, the step's last prefill
    # chunk may be trimmed so that the step lands on a bucket instead of padding up to the next
    # (bucket_landing.py). None: steps take whatever the budget allows.
    token_buckets: tuple[int, ...] | None = None
    # None: unbounded; else QueueFull beyond this many waiting requests that no free slot will
    # take at the next step (Scheduler.num_queued_beyond_free_slots).
    max_waiting_requests: int | None = None
    # Reuse the KV of full pages whose tokens (and everything before them) a finished, preempted
    # or running request already computed (kv_cache_manager). `prefix_cache_key` names what else
    # shapes the KV, the model: caches of different keys never match.
    enable_prefix_caching: bool = True
    prefix_cache_key: str = ""
    # Copy a prompt's partial page for a later request whose tokens go on the same way (beams,
    # n > 1) rather than compute it again: only where the engine can copy pages on its device
    # (not on a multi-host mesh, whose followers run only the steps).
    fork_partial_pages: bool = True
    # Pages of the host KV pool (scheduling/host_pool.py): swapped requests and the host tier
    # of the prefix cache. 0: none, every preemption recomputes.
    num_host_pages: int = 0
    # What a preempted request's pages become (offload.py): 'recompute' (dropped), 'swap' (to
    # the host when they fit) or 'auto' (swap when the SwapPricer prices it cheaper).
    preemption: str = "recompute"
    # Speculative decoding (speculation.py); None: off.
    speculative: SpeculativeConfig | None = None
    # Multi-LoRA: adapter slots on the device (lora_slots.py); 0: no request may name an adapter.
    max_loras: int = 0
    # The hybrid KV pool's groups (models/kv_pool.KVLayout.windows): None for a group that
    # attends to every earlier token, else its sliding window, whose older pages are released
    # as it slides (kv_cache_manager). (None,): one group, every page kept.
    kv_windows: tuple[int | None, ...] = (None,)

    def __post_init__(self):
        if self.batch_size is None:
            object.__setattr__(self, "batch_size", self.max_num_seqs)
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_pages", "page_size"):
            _check_positive_int(name, getattr(self, name))
        _check_positive_int("max_model_len", self.max_model_len)
        _check_positive_int("batch_size", self.batch_size)
        max_num_seqs, max_num_batched_tokens = self.max_num_seqs, self.max_num_batched_tokens
        max_model_len, batch_size = self.max_model_len, self.batch_size
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"{max_num_batched_tokens=} must be >= {max_num_seqs=}.")
        if not self.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"Without chunked prefill a whole prompt must fit one step: "
                f"{max_num_batched_tokens=} must be >= {max_model_len=}."
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} must be one of {POLICIES}.")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching={self.batching!r} must be one of {BATCHING_MODES}.")
        if batch_size > max_num_seqs:
            raise ValueError(f"{batch_size=} must be <= {max_num_seqs=}.")
        timeout = self.dynamic_timeout_s
        if not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout < 0:
            raise ValueError(f"dynamic_timeout_s={timeout!r} must be a finite number >= 0.")
        if self.token_buckets is not None:
            buckets = tuple(self.token_buckets)
            object.__setattr__(self, "token_buckets", buckets)  # a list would break hashing
            if not buckets or any(
                not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets
            ):
                raise ValueError(f"token_buckets={buckets} must be non-empty integers >= 1.")
            if list(buckets) != sorted(set(buckets)):
                raise ValueError(f"token_buckets={buckets} must be strictly increasing.")
        aging = self.priority_aging_s
        if aging is not None and (
            not isinstance(aging, int | float)
            or isinstance(aging, bool)
            or not math.isfinite(aging)
            or aging <= 0
        ):
            raise ValueError(
                f"priority_aging_s={aging!r} must be a finite number of seconds > 0, or None "
                f"for strict priority."
            )
        if self.max_waiting_requests is not None:
            _check_positive_int("max_waiting_requests", self.max_waiting_requests)
        hosts = self.num_host_pages
        if not isinstance(hosts, int) or isinstance(hosts, bool) or hosts < 0:
            raise ValueError(f"SchedulerConfig.num_host_pages={hosts!r} must be an integer >= 0.")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption={self.preemption!r} must be one of {PREEMPTION_MODES}.")
        if self.preemption != "recompute" and not hosts:
            raise ValueError(
                f"preemption={self.preemption!r} saves pages to the host KV pool, which has "
                f"num_host_pages={hosts}: give it pages, or use preemption='recompute'."
            )
        if len(self.kv_windows) > 1 and hosts:
            raise ValueError(
                f"A KV pool of {len(self.kv_windows)} groups (windows {self.kv_windows}) has no "
                f"host tier or swap yet, but num_host_pages={hosts}: use one group (a uniform "
                "pool) or no host pages."
            )
        if not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"SchedulerConfig.max_loras={self.max_loras!r} must be an int >= 0.")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"SchedulerConfig.{name}={value!r} must be an integer >= 1.")


class ScheduledSeq(NamedTuple):
    """One request's share of a step; reads like `batch.SeqChunk`, so pack() takes it as is.

    A named tuple, built positionally in the scheduler's hot path: a row per running request,
    every step, and a tuple costs a third of a keyword-built dataclass.
    """

    request: Request  # the request itself: its id may be reused once it finishes
    request_id: str
    slot: int  # batch row the request holds while running
    token_ids: list[int]  # tokens to run now: a prefill chunk, or the one last token when decoding
    start_pos: int  # position of token_ids[0] = tokens already in the cache
    # The request's pages, covering start_pos + len(token_ids) slots: the KV manager's live list
    # (KVCacheManager.table_of), valid for this step; later steps may append to it.
    page_table: list[int]
    sample: bool  # this chunk reaches the last known token, so the step samples a new one
    # Speculative verification: token_ids are the last token and this many proposals after it;
    # the step keeps the longest prefix of them its own samples agree with (0: no proposals).
    num_proposals: int = 0
    # Hybrid KV pools (kv_pool.KVLayout): the live page lists of groups 1..G-1, each covering
    # end_pos like page_table and, like it, only growing; (): a uniform pool (one group).
    group_tables: tuple = ()

    @property
    def end_pos(self) -> int:
        """Cache length after the step; also the position of the token sampled from it."""
        return self.start_pos + len(self.token_ids)


@dataclasses.dataclass(kw_only=True)
class SchedulerOutput:
    """The plan of one step: host ints and lists, and the requests they belong to."""

    seqs: list[ScheduledSeq]
    num_batched_tokens: int  # sum of len(seq.token_ids): picks the token bucket
    preempted_ids: list[str]  # preempted in this iteration, back in the waiting queue
    aborted_ids: list[str]  # aborts that took effect at this boundary (reported by update())
    step: int  # 1 for the first plan, counting up
    num_sampled: int = 0  # rows whose `sample` is set: the tokens this step generates
    # KV page copies (offload.py). `swap_out`, device page -> host page (swapped requests'
    # pages, evicted pages for the host tier): made before this step. `swap_in`, host page ->
    # device page (swapped requests, host-tier prefix hits): read from the host now, written
    # before the NEXT plan's step, the first one the restored requests run in, so that only
    # they wait for the copy.
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    num_proposed: int = 0  # proposals its verification rows carry (seq.num_proposals, summed)
    # (device slot, adapter name) to write before this step runs: adapters that took a slot
    # in this plan (lora_slots.py), in order.
    lora_loads: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    # (source, destination) device pages to copy before this step, after the swaps' reads (a
    # destination may be a page this plan evicted, its old content being saved): partial pages
    # forked for the requests admitted in it (copy on write, prefix_sharing.py).
    page_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing to copy."""
        return not (self.seqs or self.swap_out or self.swap_in or self.page_copies)


@dataclasses.dataclass(kw_only=True)
class StepResult:
    """What the runner returns for a plan, row for row with `plan.seqs`."""

    # Ignored (None, or any value) where the row's `sample` is False. A verification row
    # (seq.num_proposals > 0) has the list of its tokens: the accepted proposals, then the one
    # the step sampled after them.
    sampled_token_ids: list[int | list[int] | None]
    logprobs: list[Any] | None = None  # opaque per-row objects, passed through to the updates


class RequestUpdate(NamedTuple):
    """What one step did to one request: the engine builds its RequestOutput from this.

    A named tuple for the same reason as ScheduledSeq: one per running request, every step.
    """

    request: Request
    new_token_ids: list[int]
    finished: bool
    logprobs: list[Any] | None = None  # row objects from StepResult, one per new token

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.request.finish_reason


class RequestRejected(ValueError):
    """Refused at submission: the request could never be served (the client's error)."""


class QueueFull(RequestRejected):
    """Refused at submission because max_waiting_requests are already waiting (retry later)."""
