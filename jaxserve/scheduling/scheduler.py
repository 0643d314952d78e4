"""Iteration-level scheduling: which requests run how many tokens in the next model step.

Every iteration hands out a token budget (`max_num_batched_tokens`): first one token to each
running request that is decoding, then the rest of each running request's prompt (chunked when
the budget is short), then prefill chunks of waiting requests, in order of importance, while a
slot, the pages and the budget allow. There are no prefill and decode modes
(docs/architecture.md, Decisions 1 and 2). `Scheduler` is the coordinator of one step, and each
part is a module of its own:

- running.py: the running requests' decodes and prefill chunks;
- admission.py: which waiting requests start, and what may be queued at all;
- preemption.py: the least important running requests give back their pages when they run out;
- request_queue.py: the waiting queue and the order of importance, one for admission and victims;
- prefix_sharing.py: cached prefixes matched at admission, pages computed once, then published;
- offload.py, host_pool.py: a victim's pages swapped to host memory, and the host tier of the
  prefix cache; a plan carries the page copies the engine makes before its step;
- batching.py: continuous batching, and the static and dynamic groups kept for comparison;
- bucket_landing.py: the last prefill chunk trimmed so the step fills its token bucket;
- step_plan.py: the step being built; invariants.py: the books checked against each other.

The scheduler is plain Python without jax, so it runs in microseconds and is tested without a
model. It is driven from one thread: every `schedule()` is followed, in order, by one `update()`
with that plan's sampled tokens; only `abort_request` merely records an id, for the next
`schedule()` to act on.

Asynchronous scheduling: a plan counts as done the moment it is made. `num_computed_tokens`
moves to the end of each scheduled chunk, and every row that samples adds a *pending* output
token to its request (`Request.num_pending`), whose value only its `update()` brings. So the next
`schedule()` may run before the last plan's `update()`: a decoding request's next chunk is its
pending token, which the runner takes from the previous step on the device (PENDING_TOKEN on the
host). What the host cannot know yet costs at most one wasted row: a request that will reach
max_tokens is not planned past it, but one that samples EOS (or whose stop string the engine finds
late) has already run one more step, whose token `update()` then drops. Called strictly in turns
(`schedule`, `update`, `schedule`, ...) nothing is pending at any `schedule()`, which then plans
exactly as a synchronous scheduler would.
"""

from __future__ import annotations

import collections
import heapq
import numbers
import time
from collections.abc import Callable

from jaxserve.scheduling import invariants
from jaxserve.scheduling.admission import Admission, check_fits
from jaxserve.scheduling.batching import batching_of
from jaxserve.scheduling.bucket_landing import land_on_bucket
from jaxserve.scheduling.host_pool import HostPagePool
from jaxserve.scheduling.kv_cache_manager import KVCacheManager, PageHasher
from jaxserve.scheduling.kv_events import KVEventLog
from jaxserve.scheduling.lora_slots import LoraSlots
from jaxserve.scheduling.offload import Offload
from jaxserve.scheduling.preemption import Preemption
from jaxserve.scheduling.prefix_sharing import PrefixSharing
from jaxserve.scheduling.request import FinishReason, Request, RequestStatus
from jaxserve.scheduling.request_queue import ImportanceOrder
from jaxserve.scheduling.running import plan_running
from jaxserve.scheduling.speculation import SpecDecider, StepCost
from jaxserve.scheduling.step_plan import StepPlan
from jaxserve.scheduling.types import (  # noqa: F401 - re-exported: the scheduler's API
    BATCHING_MODES,
    POLICIES,
    QueueFull,
    RequestRejected,
    RequestUpdate,
    ScheduledSeq,
    SchedulerConfig,
    SchedulerOutput,
    StepResult,
)
from jaxserve.scheduling.verification import Verification

# (running requests, waiting requests in admission order, now) -> this step's token budget.
BudgetPolicy = Callable[[list[Request], list[Request], float], int]


class Scheduler:
    """Owns the request state, slots and KV pages; turns them into one plan per step."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.kv = KVCacheManager(
            config.num_pages, config.page_size, config.max_pages_per_seq, config.kv_windows
        )
        # None: the prefix cache is off.
        self.prefix = (
            PrefixSharing(
                self.kv, config.page_size, config.prefix_cache_key, config.fork_partial_pages
            )
            if config.enable_prefix_caching
            else None
        )
        # Pages beyond the device pool: swapped requests and the host tier (offload.py).
        self.offload = Offload(
            self.kv, HostPagePool(config.num_host_pages), config.preemption, config.page_size
        )
        self._order = ImportanceOrder(config.policy, config.priority_aging_s)
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self._keys: dict[str, tuple] = {}  # admission order; the largest key is preempted first
        self._running: list[Request] = []  # in admission order
        self._free_slots = list(range(config.max_num_seqs))  # a heap: lowest slot first
        self.batching = batching_of(config)  # owns the waiting queues
        # Adapters' device slots (lora_slots.py); None: the engine serves no adapters.
        self.lora_slots = LoraSlots(config.max_loras) if config.max_loras else None
        self._preemption = Preemption(
            self.kv,
            self._running,
            self._keys,
            release=self._release,
            requeue=self._requeue,
            offload=self.offload,
        )
        self._admission = Admission(
            config,
            self.kv,
            prefix=self.prefix,
            batching=self.batching,
            preemption=self._preemption,
            offload=self.offload,
            running=self._running,
            free_slots=self._free_slots,
            lora_slots=self.lora_slots,
        )
        # ids to abort at the next schedule(), in order, with the reason each finishes with
        self._aborts: dict[str, FinishReason] = {}
        self._reports: list[RequestUpdate] = []  # finishes the next update() must return
        # Planned, not yet updated, oldest first: update() must come in this order.
        self._outstanding: collections.deque[SchedulerOutput] = collections.deque()
        self._step = 0
        # SLO-aware scheduling (slo_policy.attach): a callable that sizes each step's token
        # budget (it may also abort waiting requests). None: every step gets the whole budget.
        self.budget_policy: BudgetPolicy | None = None
        # Speculative decoding (verification.py); None: off. It verifies nothing until the
        # engine prices steps (`set_step_cost`).
        self._verify = (
            Verification(config, self.kv, self.prefix, self._running, finish=self._finish)
            if config.speculative
            else None
        )

    @property
    def spec(self) -> SpecDecider | None:
        """Speculative decoding's per-step decision (speculation.SpecDecider); None when off."""
        return None if self._verify is None else self._verify.decider

    def set_step_cost(self, step_cost: StepCost | None, sync_penalty: bool = False) -> None:
        """Prices steps for the speculation decision (speculation.SpecDecider; `sync_penalty`:
        a verification costs the overlap of asynchronous scheduling); no-op when off."""
        if self._verify is not None:
            self._verify.decider = SpecDecider(self.spec.config, step_cost, sync_penalty)

    # Gauges, for metrics and tests.
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self.batching)

    @property
    def num_queued_beyond_free_slots(self) -> int:
        """Waiting requests that no free slot will take at the next schedule(): the queue that
        max_waiting_requests bounds.

        Requests added between two steps all wait until the next schedule(), so counting every
        one of them would refuse a burst on an idle engine. Each free slot is credited to one
        waiting request, those the next admission takes first. Pages are not considered: a request
        that has a slot but waits for pages is admitted as running ones finish, and ignoring
        pages lets at most max_num_seqs more requests in than the limit, a bound that holds.
        """
        return max(0, self.num_waiting - self.batching.slots_open(len(self._free_slots)))

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """(adapters of running requests, adapters of waiting requests), each sorted by name;
        one adapter may be in both. Two empty lists when the engine serves no adapters."""
        if self.lora_slots is None:
            return [], []
        return self.lora_slots.pinned(), sorted(self.batching.lora_counts())

    @property
    def num_slots_used(self) -> int:
        return self.config.max_num_seqs - len(self._free_slots)

    @property
    def num_pages_used(self) -> int:
        return self.kv.num_used_pages

    @property
    def num_preemptions(self) -> int:
        """Preemptions since start (or since it was last set to 0), for metrics."""
        return self._preemption.num_preemptions

    @num_preemptions.setter
    def num_preemptions(self, value: int) -> None:
        self._preemption.num_preemptions = value

    def has_unfinished(self) -> bool:
        """True while a request is unfinished or a finish is still to be reported by update()."""
        return bool(self._requests or self._reports)

    def reset_prefix_cache(self, model_key: str) -> int:
        """Drops every cached page, device and host tier, and hashes pages under `model_key`
        from now on, so no page computed with the old weights ever matches (Decision 9;
        Engine.update_weights). Only when no request is unfinished; returns the pages dropped."""
        if self.has_unfinished():
            raise RuntimeError(
                f"Cannot reset the prefix cache with {len(self._requests)} unfinished requests."
            )
        dropped = self.kv.drop_published() + self.offload.host.drop_cached()
        if self.prefix is not None:
            self.prefix.hasher = PageHasher(self.config.page_size, model_key)
            self.prefix.computing.clear()
            self.prefix.claims.clear()
        return dropped

    def record_kv_events(self) -> KVEventLog:
        """Records every change of the prefix cache, device pages and host tier, as KV events
        (kv_events.py) into the log returned, for the engine to publish; call before the first
        request, while the cache is empty."""
        if self.kv.num_cached_pages or self.offload.host.num_cached_pages:
            raise RuntimeError("KV events must be recorded from the start, with the cache empty.")
        log = KVEventLog(self.config.page_size)
        self.kv.events = self.offload.host.events = log
        return log

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request of that id, or None."""
        return self._requests.get(request_id)

    def add_request(self, req: Request) -> None:
        """Queues `req`; raises RequestRejected (QueueFull) now rather than fail it later."""
        if req.request_id in self._requests:
            raise RequestRejected(f"Request id {req.request_id!r} is already in use.")
        if req.status != RequestStatus.WAITING or req.output_token_ids:
            raise RequestRejected(f"Request {req.request_id!r} was already served ({req.status}).")
        check_fits(req, self.config, self.kv)
        limit = self.config.max_waiting_requests
        if limit is not None and self.num_queued_beyond_free_slots >= limit:
            raise QueueFull(
                f"{self.num_queued_beyond_free_slots} requests are waiting beyond the "
                f"{self.batching.slots_open(len(self._free_slots))} free slots "
                f"(max_waiting_requests={limit})."
            )
        if self._verify is not None:
            self._verify.add(req)
        self._requests[req.request_id] = req
        self._keys[req.request_id] = self._order.key_of(req)
        self.batching.waiting.push(self._keys[req.request_id], req)

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Marks a request to abort at the next schedule(); False if unknown or finished.
        `reason` is what it finishes with (FinishReason.REFUSED: the SLO policy shed it).

        Only records the id (one dict store), so a step in flight is never disturbed; the
        next schedule() frees its slot and pages and the next update() reports it finished.
        """
        if request_id not in self._requests:
            return False
        self._aborts[request_id] = reason
        return True

    def finish_request(
        self, request_id: str, reason: FinishReason, now: float | None = None
    ) -> bool:
        """Finishes a request at once (e.g. the engine matched a stop string); not reported."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._finish(req, reason.status, _now(now))
        return True

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Plans the next step: what every scheduled request runs, within all the limits.

        Earlier plans may still await their update() (asynchronous scheduling, module docstring).
        """
        now = _now(now)
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        if self.budget_policy is not None:  # before the aborts: the requests it sheds go now
            waiting = self.batching.waiting.in_order()  # the order admission starts them in
            budget = min(budget, self.budget_policy(self._running, waiting, now))
        aborted = self._apply_aborts(now)
        if self.kv.num_groups > 1:  # windowed groups let go of what no later query reads
            for req in self._running:
                self.kv.slide(req.request_id, req.num_computed_tokens)
        self.batching.form_group(now, self._keys)
        plan = StepPlan(
            budget=budget,
            tables=self.kv.tables,
            chunked=cfg.enable_chunked_prefill,
            group_tables=self.kv.group_tables,
        )
        plan_running(plan, self._running, self._keys, cfg, self._preemption.allocate_or_preempt)
        if self._verify is not None and plan.seqs:
            self._verify.propose(plan)
        if not plan.preempted:  # pages are short: admitting now would only preempt again
            self._admission.admit(plan, now)
        if cfg.token_buckets is not None and cfg.enable_chunked_prefill:
            land_on_bucket(plan, cfg.token_buckets)
        self._step += 1
        out = SchedulerOutput(
            seqs=list(plan.seqs.values()),
            num_batched_tokens=plan.num_tokens,
            preempted_ids=plan.preempted,
            aborted_ids=aborted,
            step=self._step,
            **self.offload.take_copies(),
            lora_loads=plan.lora_loads,
            page_copies=plan.page_copies,
        )
        num_sampled = num_proposed = 0
        for seq in out.seqs:  # counted as done now: the next plan starts where this one ends
            req = seq.request
            req.num_computed_tokens = seq.start_pos + len(seq.token_ids)
            if seq.sample:
                req.num_pending += 1
                num_sampled += 1
            if seq.num_proposals:
                # Only the last known token is surely computed: how many proposals join it is
                # the update's to say, and nothing is planned for the request until then.
                req.num_computed_tokens = seq.start_pos + 1
                req.spec.in_flight = True
                num_proposed += seq.num_proposals
        out.num_sampled = num_sampled
        out.num_proposed = num_proposed
        if num_proposed:
            self._verify.verifying += 1
        self._outstanding.append(out)
        return out

    def update(
        self, plan: SchedulerOutput, result: StepResult, now: float | None = None
    ) -> list[RequestUpdate]:
        """Applies a step's sampled tokens; returns what changed, finished requests included.

        Must follow every schedule(), even of an empty plan (it also delivers aborts), in the
        order of the plans. A row whose request finished since the plan (EOS in an earlier step,
        finish_request, an abort) is dropped. A request preempted since the plan still takes the
        token it sampled: it was computed from the request's own keys and values.
        """
        if not self._outstanding or plan is not self._outstanding[0]:
            oldest = self._outstanding[0].step if self._outstanding else None
            raise RuntimeError(
                f"update() got plan {plan.step}; the oldest plan awaiting its update is {oldest}."
            )
        _check_result(plan, result)
        self._outstanding.popleft()
        now = _now(now)
        updates, self._reports = self._reports, []
        logprobs = result.logprobs or [None] * len(plan.seqs)
        ps = self.config.page_size
        prefix = self.prefix
        preempted, running = RequestStatus.PREEMPTED, RequestStatus.RUNNING
        append = updates.append
        verify = self._verify
        if plan.num_proposed:
            verify.verifying -= 1
        spec_on = verify is not None and verify.may_pay()
        # The hot path: a row per running request, every step.
        for seq, token, row_logprobs in zip(
            plan.seqs, result.sampled_token_ids, logprobs, strict=True
        ):
            req = seq.request
            if seq.num_proposals:
                req.spec.in_flight = False
                if req.status <= preempted:
                    updates.append(verify.update(seq, token, row_logprobs, now))
                continue
            if req.status > preempted:  # finished: same as req.is_finished
                continue
            # Only a step that fills a page has anything to publish: most decodes skip this.
            # Before the token is taken: a token that ends the request frees its pages.
            start = seq.start_pos
            if (
                prefix is not None
                and (start + len(seq.token_ids)) // ps != start // ps
                and req.status == running
            ):
                prefix.publish(req)
            if not seq.sample:
                continue
            if prefix is not None and not req.output_token_ids and req.status == running:
                prefix.publish_tail(req, start + len(seq.token_ids))  # its prompt is computed
            req.num_pending -= 1
            token = int(token)  # numpy ints from a runner's array become plain ints
            out = req.output_token_ids
            out.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            status = None
            if token in req.stop_ids:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
            # max_model_len needs no check of its own: add_request refused any request whose
            # prompt + max_tokens exceeds it.
            elif len(out) >= req.sampling_params.max_tokens:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self._finish(req, status, now)
            elif spec_on and req.spec is not None:
                verify.hint(req)
            append(  # positional: (request, new_token_ids, finished, logprobs)
                RequestUpdate(
                    req,
                    [token],
                    status is not None,
                    None if row_logprobs is None else [row_logprobs],
                )
            )
        return updates

    def wants_known_tokens(self) -> bool:
        """Whether the next plan should wait until every step in flight is taken in
        (speculative decoding: verification.Verification.wants_known_tokens); the engine then
        plans the next step synchronously."""
        return self._verify is not None and self._verify.wants_known_tokens()

    def check_invariants(self) -> None:
        """Raises AssertionError if the books disagree; tests call it after every step."""
        invariants.check_invariants(
            kv=self.kv,
            host=self.offload.host,
            prefix=self.prefix,
            running=self._running,
            free_slots=self._free_slots,
            queued=self.batching,
            unfinished=self._requests.keys(),
            max_num_seqs=self.config.max_num_seqs,
        )
        if self.lora_slots is not None:
            self.lora_slots.check_invariants([r.lora_name for r in self._running if r.lora_name])
        named = collections.Counter(r.lora_name for r in self.batching if r.lora_name is not None)
        if self.batching.lora_counts() != named:
            raise AssertionError(
                f"The queues count adapters {dict(self.batching.lora_counts())}, their requests "
                f"name {dict(named)}."
            )

    def _apply_aborts(self, now: float) -> list[str]:
        """Finishes the requests aborted since the last schedule(); returns their ids."""
        aborts, self._aborts = self._aborts, {}
        done = []
        for request_id, reason in aborts.items():
            req = self._requests.get(request_id)
            if req is None:  # finished while the abort was pending
                continue
            self._finish(req, reason.status, now)
            self._reports.append(RequestUpdate(request=req, new_token_ids=[], finished=True))
            done.append(request_id)
        return done

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        """Ends `req`, running or queued: it leaves every book."""
        if req.status == RequestStatus.RUNNING:
            self._release(req)
        else:
            self.batching.remove(req)
            self.offload.forget(req)  # a swapped request's host pages
        req.status = status
        req.finished_time = now
        del self._requests[req.request_id]
        del self._keys[req.request_id]
        self._aborts.pop(req.request_id, None)
        self.batching.finished(req.request_id)

    def _release(self, req: Request) -> None:
        """Gives back a running request's pages and slot."""
        self.kv.free(req.request_id)
        if self.prefix is not None:
            self.prefix.release(req)
        heapq.heappush(self._free_slots, req.slot)
        req.slot = None
        if req.lora_name is not None:  # its adapter's slot may go to another adapter now
            self.lora_slots.release(req.lora_name)
            req.lora_slot = 0
        self._running.remove(req)

    def _requeue(self, req: Request) -> None:
        """Queues a preempted request again, under the key it always had."""
        self.batching.requeue().push(self._keys[req.request_id], req)


def _check_result(plan: SchedulerOutput, result: StepResult) -> None:
    """Raises ValueError unless `result` has a row per planned seq and a token for each row
    that samples. Checked before anything changes, so a runner bug cannot leave half an update
    behind."""
    rows = len(plan.seqs)
    tokens = result.sampled_token_ids
    if len(tokens) != rows or (result.logprobs is not None and len(result.logprobs) != rows):
        raise ValueError(
            f"StepResult rows do not match the plan's {rows} sequences: {len(tokens)} sampled "
            f"tokens, {None if result.logprobs is None else len(result.logprobs)} logprobs."
        )
    # Every row a plain int (the engine's .tolist()), and no verification row to check.
    if not plan.num_proposed and set(map(type, tokens)) <= {int}:
        return
    for seq, token in zip(plan.seqs, tokens, strict=True):
        if seq.num_proposals:
            if not (
                isinstance(token, list)
                and 1 <= len(token) <= seq.num_proposals + 1
                and all(isinstance(t, numbers.Integral) for t in token)
            ):
                raise ValueError(
                    f"Request {seq.request_id!r} verified {seq.num_proposals} proposals, so "
                    f"its row needs a list of 1 to {seq.num_proposals + 1} tokens, got {token!r}."
                )
            continue
        # `type(...) is int` first: the ABC check alone costs a fraction of a microsecond a row.
        if seq.sample and type(token) is not int and not isinstance(token, numbers.Integral):
            raise ValueError(f"Request {seq.request_id!r} needed a sampled token, got {token!r}.")


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now
