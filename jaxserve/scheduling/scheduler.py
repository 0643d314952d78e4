"""Iteration-level scheduling: which requests run how many tokens in the next model step.

Every iteration hands out a token budget (`max_num_batched_tokens`): first one token to each
running request that is decoding, then the rest of each running request's prompt (chunked when
the budget is short), then prefill chunks of waiting requests, in policy order, while a slot, the
pages and the budget allow. There are no prefill and decode modes (DESIGN.md, decisions 1 and 2).
When pages run out the least important running request is preempted: its pages and slot are
freed and it waits to recompute its prompt and outputs later. Under the priority policy a waiting
request that finds no free slot or pages also preempts running requests less important than
itself, as many as it needs.

With the prefix cache on (the default), admission first looks up the longest run of whole pages
whose tokens, and everything before them, a request already computed (kv_cache_manager): those
pages join the new request's table shared, its prefill starts after them, and the token budget
counts only what is left (always at least the last prompt token, whose logits are needed). As
steps complete, each request publishes its newly full pages; freed and preempted requests leave
theirs cached until a fresh page is needed, so a preempted request often resumes from its own.

Importance is one total order of keys, the same for admission and for choosing victims: fcfs
orders by arrival; priority by `arrival_time + priority * priority_aging_s` (lower first), that
is, every second of waiting improves a request by 1 / priority_aging_s levels. Keys never change,
so the order holds for requests that wait and run alike, and it bounds waiting: a request of
priority p that arrived at t comes before every request of priority >= q arriving after
t + (p - q) * priority_aging_s, which can then neither be admitted before it nor preempt it. Under
any steady load of priority q it therefore waits at most (p - q) * priority_aging_s plus the time
to serve the requests that arrived before that moment and come first. A preempted request keeps
its key, so it returns ahead of everything that came after it. Static and dynamic batching, for
comparison, admit fixed groups that run until all members finish; they emit the same plans, so
one runner serves all three modes.

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
import dataclasses
import heapq
import itertools
import numbers
import time

from jaxserve.scheduling.kv_cache_manager import KVCacheManager, PageHasher
from jaxserve.scheduling.request import PENDING_TOKEN, FinishReason, Request, RequestStatus
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


class _WaitQueue:
    """Waiting requests, popped in key order (Scheduler._key_of).

    A preempted request re-enters with its old key, so it goes back to the front: ahead of
    every request that arrived after it.
    """

    def __init__(self):
        self._heap: list[tuple[tuple, Request]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (req for _, req in self._heap)

    def in_order(self) -> list[Request]:
        """The requests in the order pop() would give them (keys are unique)."""
        return [req for _, req in sorted(self._heap)]

    def push(self, key: tuple, req: Request) -> None:
        heapq.heappush(self._heap, (key, req))

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> bool:
        """O(n), but only aborts and stop strings of queued requests take this path."""
        for i, (_, queued) in enumerate(self._heap):
            if queued is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False


@dataclasses.dataclass
class _Plan:
    """The step being built: its seqs by request id, the budget left and who was preempted."""

    budget: int
    seqs: dict[str, ScheduledSeq] = dataclasses.field(default_factory=dict)
    preempted: list[str] = dataclasses.field(default_factory=list)
    limit: int = dataclasses.field(init=False)  # the step's whole budget: `budget` at creation

    def __post_init__(self):
        self.limit = self.budget

    @property
    def num_tokens(self) -> int:
        return self.limit - self.budget

    def add(self, seq: ScheduledSeq) -> None:
        self.seqs[seq.request_id] = seq
        self.budget -= len(seq.token_ids)

    def drop(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.budget += len(seq.token_ids)


class Scheduler:
    """Owns the request state, slots and KV pages; turns them into one plan per step."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.kv = KVCacheManager(config.num_pages, config.page_size, config.max_pages_per_seq)
        self._hasher = (
            PageHasher(config.page_size, config.prefix_cache_key)
            if config.enable_prefix_caching
            else None
        )
        # Prefix cache: full pages that a running request will compute and publish, by hash, and
        # the hashes each request registered. A waiting request whose next uncached page is one
        # of them waits for it instead of computing it a second time (the n samples of one
        # prompt, a burst of requests with one system prompt).
        self._computing: dict[bytes, Request] = {}
        # (page index, hash) in page order; an entry goes once all its pages are published.
        self._registered: dict[str, list[tuple[int, bytes]]] = {}
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self._keys: dict[str, tuple] = {}  # admission order; the largest key is preempted first
        self._counter = itertools.count()
        self._waiting = _WaitQueue()
        self._running: list[Request] = []  # in admission order
        self._free_slots = list(range(config.max_num_seqs))  # a heap: lowest slot first
        # Static/dynamic batching: ids of the current group's unfinished members, and those of
        # them that wait for (re)admission. None: no group (always None when continuous).
        self._group: set[str] | None = None
        self._group_waiting = _WaitQueue()
        # ids to abort at the next schedule(), in order, with the reason each finishes with
        self._aborts: dict[str, FinishReason] = {}
        self._reports: list[RequestUpdate] = []  # finishes the next update() must return
        # Planned, not yet updated, oldest first: update() must come in this order.
        self._outstanding: collections.deque[SchedulerOutput] = collections.deque()
        self._step = 0
        self.num_preemptions = 0  # total, for metrics
        # SLO-aware scheduling (slo_policy.attach): (running, waiting in admission order, now) ->
        # this step's token budget (it may also abort waiting requests). None: every step gets
        # the whole budget.
        self.step_budget = None

    # Gauges, for metrics and tests.
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._group_waiting)

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
        return max(0, self.num_waiting - self._num_slots_open_to_queue())

    def _num_slots_open_to_queue(self) -> int:
        free = len(self._free_slots)
        if self.config.batching == "continuous":
            return free
        # Static/dynamic: free slots are filled only when the next group forms.
        return 0 if self._group else min(free, self.config.batch_size)

    @property
    def num_slots_used(self) -> int:
        return self.config.max_num_seqs - len(self._free_slots)

    @property
    def num_pages_used(self) -> int:
        return self.kv.num_used_pages

    def has_unfinished(self) -> bool:
        """True while a request is unfinished or a finish is still to be reported by update()."""
        return bool(self._requests or self._reports)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def add_request(self, req: Request) -> None:
        """Queues `req`; raises RequestRejected (QueueFull) now rather than fail it later."""
        if req.request_id in self._requests:
            raise RequestRejected(f"Request id {req.request_id!r} is already in use.")
        if req.status != RequestStatus.WAITING or req.output_token_ids:
            raise RequestRejected(f"Request {req.request_id!r} was already served ({req.status}).")
        self._check_fits(req)
        limit = self.config.max_waiting_requests
        if limit is not None and self.num_queued_beyond_free_slots >= limit:
            raise QueueFull(
                f"{self.num_queued_beyond_free_slots} requests are waiting beyond the "
                f"{self._num_slots_open_to_queue()} free slots (max_waiting_requests={limit})."
            )
        self._requests[req.request_id] = req
        self._keys[req.request_id] = self._key_of(req)
        self._waiting.push(self._keys[req.request_id], req)

    def _key_of(self, req: Request) -> tuple:
        """Importance, lowest first (module docstring); n breaks ties in order of submission."""
        n = next(self._counter)
        if self.config.policy != "priority":
            return (req.arrival_time, n)
        aging = self.config.priority_aging_s
        if aging is None:
            return (req.priority, req.arrival_time, n)
        # arrival + priority * aging orders requests as `priority - wait / aging` does at any
        # one instant, without ever having to re-sort the queue as time passes.
        return (req.arrival_time + req.priority * aging, req.priority, n)

    def _check_fits(self, req: Request) -> None:
        cfg, rid = self.config, req.request_id
        if req.max_num_tokens > cfg.max_model_len:
            raise RequestRejected(
                f"Request {rid!r} asks for {req.num_prompt_tokens} prompt + "
                f"{req.sampling_params.max_tokens} output tokens = {req.max_num_tokens}, more "
                f"than max_model_len={cfg.max_model_len}."
            )
        # The last sampled token is never run through the model, so it needs no cache slot.
        pages = self.kv.pages_for(req.max_num_tokens - 1)
        if pages > cfg.num_pages:
            raise RequestRejected(
                f"Request {rid!r} may need {pages} KV pages of {cfg.page_size} tokens, more than "
                f"the whole pool of num_pages={cfg.num_pages}."
            )

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
        budget = self.config.max_num_batched_tokens
        if self.step_budget is not None:  # before the aborts: the requests it sheds go now
            waiting = self._waiting.in_order()  # the order _admit will start them in
            budget = min(budget, self.step_budget(self._running, waiting, now))
        aborted = self._apply_aborts(now)
        if self.config.batching != "continuous":
            self._form_group(now)
        plan = _Plan(budget=budget)
        self._schedule_running(plan)
        if not plan.preempted:  # pages are short: admitting now would only preempt again
            self._admit(plan, now)
        if self.config.token_buckets is not None and self.config.enable_chunked_prefill:
            self._land_on_bucket(plan)
        self._step += 1
        out = SchedulerOutput(
            seqs=list(plan.seqs.values()),
            num_batched_tokens=plan.num_tokens,
            preempted_ids=plan.preempted,
            aborted_ids=aborted,
            step=self._step,
        )
        num_sampled = 0
        for seq in out.seqs:  # counted as done now: the next plan starts where this one ends
            req = seq.request
            req.num_computed_tokens = seq.start_pos + len(seq.token_ids)
            if seq.sample:
                req.num_pending += 1
                num_sampled += 1
        out.num_sampled = num_sampled
        self._outstanding.append(out)
        return out

    def _apply_aborts(self, now: float) -> list[str]:
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

    def _form_group(self, now: float) -> None:
        """Static/dynamic batching: the next group forms only when the last one is done."""
        if self._group or not self._waiting:
            return
        cfg = self.config
        if cfg.batching == "dynamic" and len(self._waiting) < cfg.batch_size:
            oldest = min(req.arrival_time for req in self._waiting)
            if now - oldest < cfg.dynamic_timeout_s:
                return
        self._group = set()
        while self._waiting and len(self._group) < cfg.batch_size:
            req = self._waiting.pop()
            self._group.add(req.request_id)
            self._group_waiting.push(self._keys[req.request_id], req)

    def _schedule_running(self, plan: _Plan) -> None:
        # Decodes first: one token each always fits (max_num_batched_tokens >= max_num_seqs),
        # so a long prompt being prefilled never stalls the streams of the others.
        # The hot path: every running request, every step. Request's properties are spelled out
        # (num_tokens = prompt + outputs + pending): a property call per row is a measurable
        # share of a 256-row step's host time.
        # One pass: each decode is planned as it is met, in admission order; prefills after.
        prefilling = []
        max_len = self.config.max_model_len
        ps = self.config.page_size
        tables = self.kv.tables
        running = RequestStatus.RUNNING
        # Decodes go into the plan's dict directly and pay their budget (a token each) after
        # the loop: `_Plan.add` per row was a fifth of this loop. Nothing here reads the
        # budget, and a decode dropped by a preemption gives its token back as usual.
        seqs = plan.seqs
        num_decodes = 0
        for req in tuple(self._running):  # a copy: an allocation below may preempt
            if req.status != running:  # preempted for an earlier one
                continue
            outputs = len(req.output_token_ids)
            pending = req.num_pending
            total = len(req.prompt_token_ids) + outputs + pending
            start = req.num_computed_tokens
            if total - start != 1:
                if total != start:
                    prefilling.append(req)
                continue
            # A pending token that will end the request by length: nothing more to run.
            if pending and (
                outputs + pending >= req.sampling_params.max_tokens or total >= max_len
            ):
                continue
            rid = req.request_id
            table = tables[rid]
            # Most decodes fit the pages they hold: allocate only when a page fills up.
            if start >= len(table) * ps and not self._allocate_or_preempt(req, start + 1, plan):
                continue
            if pending:
                token = PENDING_TOKEN
            elif outputs:
                token = req.output_token_ids[-1]
            else:
                token = req.prompt_token_ids[-1]
            # Positional: the fields in order (request, request_id, slot, token_ids, start_pos,
            # page_table, sample).
            seqs[rid] = ScheduledSeq(req, rid, req.slot, [token], start, table, True)
            num_decodes += 1
        plan.budget -= num_decodes
        prefilling.sort(key=lambda r: self._keys[r.request_id])
        for req in prefilling:
            if req.status != RequestStatus.RUNNING:  # preempted for an earlier one
                continue
            n = self._chunk_len(req, plan.budget, req.num_computed_tokens)
            if n and self._allocate_or_preempt(req, req.num_computed_tokens + n, plan):
                plan.add(self._scheduled(req, n))

    def _chunk_len(self, req: Request, budget: int, computed: int) -> int:
        """Tokens `req` may run within `budget`, `computed` being in the cache already: all it
        has left, a chunk, or 0 to wait a step."""
        remaining = req.num_tokens - computed
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _allocate_or_preempt(self, req: Request, num_tokens: int, plan: _Plan) -> bool:
        """Pages for `req`, preempting the least important running requests until they fit.

        Returns False when `req` itself was the least important and got preempted. It always
        fits alone: add_request refused anything larger than the pool.
        """
        while not self.kv.allocate(req.request_id, num_tokens):
            victim = max(self._running, key=lambda r: self._keys[r.request_id])
            self._preempt(victim, plan)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, plan: _Plan) -> None:
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0  # recompute prompt + outputs; the outputs are kept
        req.num_preemptions += 1
        self.num_preemptions += 1
        plan.drop(req.request_id)
        plan.preempted.append(req.request_id)
        queue = self._group_waiting if self._group is not None else self._waiting
        queue.push(self._keys[req.request_id], req)

    def _admit(self, plan: _Plan, now: float) -> None:
        """Starts waiting requests in order while a slot, the budget and pages allow."""
        if self.config.batching != "continuous" and not self._group:
            return
        queue = self._group_waiting if self._group is not None else self._waiting
        while queue and plan.budget > 0:
            req = queue.peek()
            # Made room in this step, or preempted while a step in flight samples for it (it
            # recomputes its outputs, so it waits until they are known): not back yet.
            if req.request_id in plan.preempted or req.num_pending:
                return
            hit = self._match_prefix(req)
            if self._waits_for_prefix(req, hit):
                return
            computed = len(hit) * self.config.page_size
            # The budget counts only the tokens still to compute, not those the cache serves.
            n = self._chunk_len(req, plan.budget, computed)
            # Head of line blocks the rest: skipping it for smaller ones could starve it.
            if not n or not self._make_room(req, computed + n, hit, plan):
                return
            queue.pop()
            if self._hasher is not None:
                self.kv.record_query(req.num_tokens, computed)
                self._register_computing(req, len(hit))
            req.num_computed_tokens = computed
            if req.num_cached_tokens is None:
                req.num_cached_tokens = min(computed, req.num_prompt_tokens)
            req.status = RequestStatus.RUNNING
            req.slot = heapq.heappop(self._free_slots)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self._running.append(req)
            plan.add(self._scheduled(req, n))

    def _match_prefix(self, req: Request) -> list[int]:
        """Cached pages holding the longest prefix of `req`'s tokens (none without the cache).

        None either for a request asking for prompt logprobs: a cached token's logits are never
        computed, and it needs every prompt token's.
        """
        if self._hasher is None or req.sampling_params.prompt_logprobs is not None:
            return []
        hashes = req.page_hashes
        start = len(hashes) * self.config.page_size
        if req.num_tokens - start >= self.config.page_size:
            self._hasher.extend(hashes, req.token_ids(start, req.num_tokens), req.cache_salt)
        return self.kv.match(hashes, req.num_tokens)

    def _waits_for_prefix(self, req: Request, hit: list[int]) -> bool:
        """Whether another running request is computing `req`'s next uncached full page now.

        Then `req` waits (and, at the head of the queue, so does everything behind it: no one
        is passed) until that request publishes the page, and takes it from the cache: its
        prompt is computed once, not once per request, at the price of starting a few steps
        later. Computing it twice at once would cost the same steps on a busy device anyway.
        """
        hashes = req.page_hashes
        if len(hit) >= len(hashes):
            return False
        owner = self._computing.get(hashes[len(hit)])
        return owner is not None and owner is not req and owner.status == RequestStatus.RUNNING

    def _register_computing(self, req: Request, num_hit: int) -> None:
        """Marks the full pages `req` computes from page `num_hit` on as being computed by it."""
        mine = [
            (i, h)
            for i, h in enumerate(req.page_hashes[num_hit:], num_hit)
            if self._computing.setdefault(h, req) is req
        ]
        if mine:
            self._registered[req.request_id] = mine

    def _unregister_computing(self, req: Request, registered) -> None:
        """Ends `req`'s claim on the (page index, hash) pairs `registered`."""
        for _, h in registered:
            if self._computing.get(h) is req:
                del self._computing[h]

    def _make_room(self, req: Request, num_tokens: int, hit: list[int], plan: _Plan) -> bool:
        """A slot and the pages of `num_tokens` for waiting `req`, allocated, starting with the
        cached pages `hit`; False changes nothing.

        Under the priority policy (continuous batching) it may preempt running requests less
        important than `req`, least important first, but only when enough of them exist:
        preempting without then admitting would only waste their work. A victim's pages count
        only if no one else holds them and `req` is not about to reuse them.
        """
        need_slot = not self._free_slots
        reclaimed = sum(self.kv.ref_count(p) == 0 for p in hit)  # cached: not free for others
        need_pages = self.kv.pages_for(num_tokens) - len(hit) - (self.kv.num_free_pages - reclaimed)
        if need_slot or need_pages > 0:
            if self.config.policy != "priority" or self.config.batching != "continuous":
                return False
            key = self._keys[req.request_id]
            victims = []
            for victim in sorted(self._running, key=lambda r: self._keys[r.request_id])[::-1]:
                if self._keys[victim.request_id] <= key or not (need_slot or need_pages > 0):
                    break
                victims.append(victim)
                need_slot = False
                need_pages -= self.kv.num_private_pages(victim.request_id, exclude=hit)
            if need_slot or need_pages > 0:
                return False
            for victim in victims:
                self._preempt(victim, plan)
        allocated = self.kv.allocate(req.request_id, num_tokens, prefix=hit)
        assert allocated, "the free pages were counted above"
        return True

    def _land_on_bucket(self, plan: _Plan) -> None:
        """Trims the step's last prefill chunk so the step fills a token bucket exactly.

        The runner pads a step up to the next bucket: 136 tokens run as 256 on a power-of-two
        ladder. Once every decode and prefill is planned nothing can fill that padding, but
        moving 8 tokens to the next step removes it. The trim moves at most half the padding it
        saves (so the step lies in the lower half of its bucket, and the next step cannot spend
        more than it saved) and at most half the chunk (a chunk is never starved). It falls on
        the least important prefill, the one planned last. A chunk that would have finished its
        prompt then samples one step later: the price, paid only for halving the padding.
        A chunk cut by the budget needs none of this: it fills the budget, the largest bucket.
        """
        total = plan.num_tokens
        lower = upper = None
        for bucket in self.config.token_buckets:
            if bucket <= total:
                lower = bucket
            else:
                upper = bucket
                break
        if lower is None or upper is None or lower == total:
            return
        excess = total - lower
        seq = next(reversed(plan.seqs.values()))
        if 2 * excess > upper - lower or 2 * excess > len(seq.token_ids):
            return  # also leaves decodes (one token) alone
        req = self._requests[seq.request_id]
        plan.drop(seq.request_id)
        plan.add(self._scheduled(req, len(seq.token_ids) - excess))

    def _scheduled(self, req: Request, n: int) -> ScheduledSeq:
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        return ScheduledSeq(
            request=req,
            request_id=req.request_id,
            slot=req.slot,
            token_ids=req.token_ids(start, end),
            start_pos=start,
            page_table=self.kv.table_of(req.request_id),
            sample=end == req.num_tokens,
        )

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
        self._check_result(plan, result)
        self._outstanding.popleft()
        now = _now(now)
        updates, self._reports = self._reports, []
        logprobs = result.logprobs or [None] * len(plan.seqs)
        ps = self.config.page_size
        hashing = self._hasher is not None
        preempted, running = RequestStatus.PREEMPTED, RequestStatus.RUNNING
        append = updates.append
        # The hot path: a row per running request, every step.
        for seq, token, row_logprobs in zip(
            plan.seqs, result.sampled_token_ids, logprobs, strict=True
        ):
            req = seq.request
            if req.status > preempted:  # finished: same as req.is_finished
                continue
            # Only a step that fills a page has anything to publish: most decodes skip this.
            # Before the token is taken: a token that ends the request frees its pages.
            start = seq.start_pos
            if (
                hashing
                and (start + len(seq.token_ids)) // ps != start // ps
                and req.status == running
            ):
                self._publish(req)
            if not seq.sample:
                continue
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
            append(  # positional: (request, new_token_ids, finished, logprobs)
                RequestUpdate(
                    req,
                    [token],
                    status is not None,
                    None if row_logprobs is None else [row_logprobs],
                )
            )
        return updates

    def _publish(self, req: Request) -> None:
        """Offers `req`'s newly computed full pages to the prefix cache (cheap when none filled)."""
        ps = self.config.page_size
        # Pending tokens have no value to hash yet; their pages are published by a later update.
        full = min(req.num_computed_tokens, req.num_known_tokens) // ps
        hashes = req.page_hashes
        if full > len(hashes):
            start = len(hashes) * ps
            self._hasher.extend(hashes, req.token_ids(start, full * ps), req.cache_salt)
        self.kv.publish(req.request_id, hashes, full * ps)
        # Published now: others take them from the cache. Pages publish in order, so the claims
        # to end are the first ones; the rest of a long request's life costs nothing here.
        mine = self._registered.get(req.request_id)
        if mine:
            n = 0
            while n < len(mine) and mine[n][0] < full:
                n += 1
            self._unregister_computing(req, mine[:n])
            del mine[:n]
            if not mine:
                del self._registered[req.request_id]

    def _check_result(self, plan: SchedulerOutput, result: StepResult) -> None:
        # Checked before anything changes, so a runner bug cannot leave half an update behind.
        rows = len(plan.seqs)
        tokens = result.sampled_token_ids
        if len(tokens) != rows or (result.logprobs is not None and len(result.logprobs) != rows):
            raise ValueError(f"StepResult rows do not match the plan's {rows} sequences.")
        if set(map(type, tokens)) <= {int}:  # every row a plain int (the engine's .tolist())
            return
        for seq, token in zip(plan.seqs, result.sampled_token_ids, strict=True):
            # `type(...) is int` first: the ABC check alone costs a fraction of a microsecond a row.
            if seq.sample and type(token) is not int and not isinstance(token, numbers.Integral):
                raise ValueError(
                    f"Request {seq.request_id!r} needed a sampled token, got {token!r}."
                )

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        if req.status == RequestStatus.RUNNING:
            self._release(req)
        elif not self._waiting.remove(req):
            self._group_waiting.remove(req)
        req.status = status
        req.finished_time = now
        del self._requests[req.request_id]
        del self._keys[req.request_id]
        self._aborts.pop(req.request_id, None)
        if self._group is not None:
            self._group.discard(req.request_id)

    def _release(self, req: Request) -> None:
        """Gives back a running request's pages and slot."""
        self.kv.free(req.request_id)
        self._unregister_computing(req, self._registered.pop(req.request_id, ()))
        heapq.heappush(self._free_slots, req.slot)
        req.slot = None
        self._running.remove(req)

    def check_invariants(self) -> None:
        """Raises AssertionError if the books disagree; tests call it after every step."""
        self.kv.check_invariants()
        slots = [r.slot for r in self._running]
        if sorted(slots + self._free_slots) != list(range(self.config.max_num_seqs)):
            raise AssertionError(f"Slots {slots} in use and {self._free_slots} free disagree.")
        for req in self._running:
            pages = self.kv.num_pages_of(req.request_id)
            if req.status != RequestStatus.RUNNING or pages < self.kv.pages_for(
                req.num_computed_tokens
            ):
                raise AssertionError(f"Running request {req.request_id!r} is inconsistent.")
        queued = [*self._waiting, *self._group_waiting]
        for req in queued:
            if req.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise AssertionError(f"Queued request {req.request_id!r} is {req.status!r}.")
            if (
                req.slot is not None
                or req.num_computed_tokens
                or self.kv.num_pages_of(req.request_id)
            ):
                raise AssertionError(f"Queued request {req.request_id!r} holds a slot or pages.")
        for h, owner in self._computing.items():
            if owner.status != RequestStatus.RUNNING or h not in {
                claim for _, claim in self._registered.get(owner.request_id, ())
            }:
                raise AssertionError(
                    f"Request {owner.request_id!r} computes a page but is not running."
                )
        ids = [r.request_id for r in [*self._running, *queued]]
        if len(ids) != len(set(ids)) or set(ids) != set(self._requests):
            raise AssertionError("Every unfinished request must be running or queued, once.")


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now
