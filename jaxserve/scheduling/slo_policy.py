"""SLO-aware scheduling: size each step's prefill so running decodes keep their TPOT target.

Continuous batching puts prefill chunks in the same steps as decodes, so every token a prompt
gets in a step slows the output of every running request. Under load the default (fill the
token budget) makes each decode step as slow as a full prefill step, and every request misses
its TPOT target. `SloPolicy` is consulted by the scheduler once per step
(`Scheduler.budget_policy`) and returns the step's token budget:

- no decodes running, or no TPOT target: the whole budget (no one's TPOT to protect);
- otherwise the largest token bucket whose predicted step time (jaxserve/scheduling/cost_model.py),
with
  one token per decode and the rest prefill, stays within the step's allowance: `headroom *
  tpot_s` plus the slack of the decoding rows, the least time any of them has saved on its
  earlier steps (its TPOT target is a mean over its tokens, as goodput scores it: a row whose
  steps ran at 60 ms against a 90 ms allowance can spare 30 ms a token for a prefill); at least
  the decodes themselves, plus the padding of their bucket, which runs anyway. When the decodes
  alone already take longer than that, no prefill at all: a prompt let in now would be one more
  decode row in every later step (the padding is free for this step only);
- when a partial prefill would miss its TTFT target at that rate but can still meet it at a
  larger budget, the smallest budget that meets it: a short, bounded slowdown of the decodes
  buys a request's whole goodput. A request that cannot meet its target at any budget gets no
  boost: it is served at the capped rate rather than making everyone late;
- admission: a waiting request starts only when (a) the predicted decode step of every row
  running plus it, each at its final context (prompt + max_tokens; on the CPU, whose decode loop
  runs every slot to the longest context, priced by the longest), stays within `headroom *
  tpot_s` (the row cap), and (b) its whole prompt, run in this step beside the running
  requests' tokens, keeps the step within the allowance above. Capping each step's prefill is
  not enough: each admitted request is one more row in every later step, so once the rows
  themselves make a decode step slower than the target every running request misses TPOT (on
  `small`, 40 rows of decode on the 2-core CPU take longer than 100 ms); and a prompt admitted
  in chunks of what fits beside the decodes (a few tokens when a step is 60 ms of a 90 ms
  allowance) gets its first token late. Admitted whole, it has it a step later; the prompt
  finishes in the next step even when the scheduler trimmed this one to land on a bucket.
  With no row running the first waiting request always starts (nothing starves; when one row
  alone misses the target, one at a time is the best TPOT there is). A held request waits for
  a row to free and the rows' slack to grow, or is refused by `shed_late` below once it can
  no longer meet its TTFT target. Admission works through the budget (the running requests'
  tokens plus the admitted prompts exactly), so the scheduler needs no hook: it hands the
  waiting requests over in the order it will start them (arrival, or the priority policy's), and
  the policy counts prompts without prefix-cache hits;
- with `EngineConfig.shed_late`, a waiting request that would miss its TTFT target even with
  the whole budget, behind only the prompts ahead of it in the queue, is refused (finish reason
  "refused", its `status_message` giving the predicted TTFT against the target) before it takes
  any of the capacity the requests that can still be good need. Clients see a refusal, not a
  failure: gRPC RESOURCE_EXHAUSTED, HTTP 429, as for a full queue.

Predicted times to first token are a bound the policy decides against (refuse, boost), so they
leave out nothing that always happens: with asynchronous scheduling a step planned now starts
only when the step in flight ends (`_inflight_s`), and a waiting request's prefill starts only
after the prompts ahead of it in the queue (partial prefills, then the waiting ones it is not
refused behind). Without those two terms every admitted request was predicted one step and a
queue early, so the shed policy admitted requests that then missed the target by a little.

The pace. The cost model was measured once; the machine's pace changes (a neighbour takes a
core). The policy therefore scales every prediction by the running average of the measured over
the predicted time of the steps it sees (`SloPolicy.scale`). An average, not a deliberately
cautious estimate (a high quantile of recent ratios): under a busy machine per-step ratios
spread 2-3x, their 90th percentile ran 1.5-2.5x the average, and the policy then refused nearly
every request (A/B at 0.25 s / 20 ms on tiny, 2026-12-01: 0-5 good requests of 200 for the
quantiles against 1-8 for the average with the terms above). The caution the old pairing of
steps gave (b050def) was making up for the two missing terms, not for the pace: replayed in the
simulator, where the pace is exact, the shed policy served 6 good requests of 200 without them
and 37 with them (docs/history/bench-slo/cost_model_night.json); measured, alternated in one
process, 26 in three runs against 2 (docs/history/bench-slo/pace_and_bias.md).

Nothing starves: the cap never stops decodes, decodes always finish (max_tokens), and when no
row runs the first waiting request starts, so the queue drains in its order. With no SLO, or with
`EngineConfig.slo_scheduling` off, nothing is attached and the scheduler plans as before.
Plain Python (no JAX), called with the scheduler's running list and waiting queue.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence

from jaxserve.scheduling.cost_model import (
    CostModel,
    StepWork,
    decode_keys,
    decode_work,
    prefill_blocks,
    work_of,
)
from jaxserve.scheduling.request import FinishReason, Request


class SloPolicy:
    """The step budget for a TPOT target and a TTFT target (module docstring)."""

    def __init__(
        self,
        cost: CostModel,
        *,
        tpot_s: float,
        ttft_s: float | None,
        token_buckets: Sequence[int],
        max_num_batched_tokens: int,
        headroom: float = 0.9,
        shed: Callable[[Request, str], object] | None = None,
        lag: int = 0,
        max_model_len: int | None = None,
    ):
        if not tpot_s > 0 or not math.isfinite(tpot_s):
            raise ValueError(f"The TPOT target tpot_s={tpot_s!r} must be > 0 seconds.")
        if ttft_s is not None and (not ttft_s > 0 or not math.isfinite(ttft_s)):
            raise ValueError(f"The TTFT target ttft_s={ttft_s!r} must be > 0 seconds, or None.")
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom={headroom} must be in (0, 1].")
        self.cost = cost
        self.tpot_s, self.ttft_s = tpot_s, ttft_s
        self.target_s = headroom * tpot_s
        self.max_budget = max_num_batched_tokens
        self.buckets = sorted(b for b in token_buckets if b < max_num_batched_tokens)
        self.buckets.append(max_num_batched_tokens)
        # Refuses a request, saying why (`refuser`): given, waiting requests that can no
        # longer meet the TTFT target are refused instead of served late (--shed-late).
        self.shed = shed
        self.num_capped = self.num_boosted = 0  # steps, for stats and tests
        self.num_shed = 0  # requests
        # How much slower than the cost model the machine runs now (a busier neighbour, another
        # clock speed): an average of measured over predicted step time, see _learn_scale.
        self.scale = 1.0
        # Plans between a step's planning and the interval between calls that it fills: 0 when
        # every plan waits for the last step's tokens, 1 with asynchronous scheduling (the
        # interval after plan k+1 is step k's: plan k+1 was made while step k ran).
        if lag not in (0, 1):
            raise ValueError(f"lag={lag} must be 0 (synchronous) or 1 (asynchronous scheduling).")
        self.lag = lag
        self._predicted: list[float | None] = [None] * (lag + 1)  # the last plans', oldest first
        self._computed: dict[str, int] = {}  # num_computed_tokens of each running request
        self._last_call: float | None = None  # `now` of the last call that had work
        # Every step's measured and predicted seconds, summed: the served steps' pace over the
        # whole run, saved with the cost model for the next start (`served_scale`).
        self.measured_s = self.predicted_s = 0.0
        self.num_measured = 0
        # Admission (module docstring): max_model_len bounds a row's final context.
        self.max_model_len = max_model_len
        self.num_held = 0  # steps in which waiting requests were held back

    def __call__(self, running: Sequence[Request], waiting: Iterable[Request], now: float) -> int:
        """This step's token budget. `waiting`: in the order the scheduler would start them."""
        decodes = decode_pairs = decode_max = 0  # decoding rows, their contexts (sum, longest)
        spans: list[tuple[int, int]] = []  # (cached, left) of partial prefills, in plan order
        first = None  # the next request to get its first token
        # Rows decoding after this step, their final contexts (sum, longest), tokens this step.
        rows = row_pairs = row_max = used = 0
        slack = math.inf  # seconds the decoding rows' TPOT can still spare (_slack)
        self._learn_scale(running, waiting, now)
        inflight = self._inflight_s()  # a step planned now starts when this one ends
        for req in running:
            left = req.num_tokens - req.num_computed_tokens
            if left == 1:
                decodes += 1
                decode_pairs += req.num_tokens
                decode_max = max(decode_max, req.num_tokens)
                if not _finishing(req):  # its last token is in flight: the scheduler skips it
                    rows += 1
                    final = self._final_context(req)
                    row_pairs += final
                    row_max = max(row_max, final)
                    used += 1
                    slack = min(slack, self._slack(req, now + inflight))
            elif left > 1:
                spans.append((req.num_computed_tokens, left))
                rows += 1
                final = self._final_context(req)
                row_pairs += final
                row_max = max(row_max, final)
                used += left
                if first is None and not req.output_token_ids:
                    first = req

        def step_s(budget: int) -> float:
            pairs, blocks = _prefill_work(spans, budget - decodes)
            work = StepWork(budget, decode_pairs + pairs, decode_keys(decode_max, budget), blocks)
            return self.scale * self.cost.predict(work)

        if self.shed is not None and self.ttft_s is not None:
            waiting = self._shed_late(waiting, decodes, sum(n for _, n in spans), step_s, now)
        else:
            waiting = list(waiting)
        # A step may take the target plus what the decoding rows saved on their earlier steps
        # (_slack); with no row decoding, anything.
        if math.isinf(slack):
            allowed = math.inf if decodes == 0 else self.target_s
        else:
            allowed = self.target_s + slack
        if decodes == 0:
            budget = self.max_budget
        else:
            # The decodes' own bucket: its padding runs anyway, so prefill may fill it.
            top = len(self.buckets) - 1
            floor = self.buckets[min(bisect.bisect_left(self.buckets, decodes), top)]
            # Decodes alone over the target: no prefill (module docstring), not even padding.
            budget = floor if step_s(decodes) <= allowed else decodes
            for b in self.buckets:
                if b > floor and step_s(b) <= allowed:
                    budget = b
            if budget < self.max_budget:
                self.num_capped += 1
                boosted = self._boost(budget, first, decodes, step_s, now)
                if boosted > budget:
                    self.num_boosted += 1
                    budget = boosted
        if not waiting:  # partial prefills only: capped like any step (the boost may lift it)
            return budget
        # The newcomers that may start, and a budget that starts exactly them.
        admitted, tokens = self._admissible(
            rows, row_pairs, row_max, used, waiting, step_s, allowed
        )
        if len(admitted) < len(waiting):
            self.num_held += 1
        # The running requests' whole `used` and the newcomers' prompts fit `allowed` together.
        # With no newcomer, an admitted prompt still finishes in this step: it was admitted to
        # run whole in one step (the scheduler may have trimmed that step to land on a token
        # bucket), and a first token late by a chunk costs more goodput than a step over the
        # target (the decodes' TPOT is a mean over all their tokens).
        if len(admitted) == len(waiting):
            return max(budget, used + tokens)
        return used + tokens

    def _slack(self, req: Request, start: float) -> float:
        """Seconds `req`'s TPOT can still spare when a step starting at `start` runs: the target
        times the intervals between its tokens so far (the one in flight included) less the
        time they will have taken by then. 0 while its first token is in flight: its TPOT
        clock starts when that token comes."""
        if req.first_token_time is None:
            return 0.0
        intervals = len(req.output_token_ids) + req.num_pending - 1
        return self.target_s * intervals - (start - req.first_token_time)

    def _final_context(self, req: Request) -> int:
        """Tokens `req` attends to in its last decode step: its prompt and all its outputs
        (max_tokens; an upper bound when a stop ends it sooner), within max_model_len."""
        final = req.num_prompt_tokens + req.sampling_params.max_tokens
        return final if self.max_model_len is None else min(final, self.max_model_len)

    def decode_s(self, rows: int, pairs: int, longest: int) -> float:
        """Predicted seconds of a decode step of `rows` rows attending to `pairs` tokens in
        all, the longest row `longest`, at the current pace."""
        return self.scale * self.cost.predict(decode_work(rows, pairs, longest))

    def _admissible(
        self,
        rows: int,
        pairs: int,
        longest: int,
        used: int,
        waiting: Sequence[Request],
        step_s,
        allowed: float,
    ) -> tuple[list[Request], int]:
        """The waiting requests that may start now, in the queue's order (the scheduler's), and
        the prompt tokens they run in this step. Each is one more decode row: it may start while
        the decode step of all the rows, each at its final context, stays within the target (so
        every running request keeps its TPOT for the rest of its life), and while its prefill,
        run whole in this step beside the running requests' `used` tokens, takes no longer than
        `allowed` (the target plus the slack the decoding rows saved). A prompt longer than the
        budget starts with the budget's worth. With no row running, the first always may
        (nothing starves; if one row alone misses the target, one at a time is the best TPOT
        there is). The queue's head blocks the rest, as in the scheduler."""
        admitted, tokens = [], 0
        for req in waiting:
            final = self._final_context(req)
            pairs += final
            longest = max(longest, final)
            rows += 1
            n = min(req.num_tokens - req.num_computed_tokens, self.max_budget - used - tokens)
            if n <= 0:
                break
            if rows > 1 and (
                self.decode_s(rows, pairs, longest) > self.target_s
                or step_s(used + tokens + n) > allowed
            ):
                break
            admitted.append(req)
            tokens += n
        return admitted, tokens

    def _learn_scale(self, running: Sequence[Request], waiting, now: float) -> None:
        """Moves `scale` towards the measured over the predicted time of the last step.

        The scheduler plans once per step, so the interval since the last call is one step's
        time, and what a plan ran is how far each running request advanced between the calls
        around it, so no hook in the engine is needed. Which plan the interval timed: the last
        one, or with asynchronous scheduling (`lag` 1) the one before it, whose step ran while
        the last was planned (pairing the interval with the last plan instead set a small step's
        time against a large step's prediction after every prefill). A ratio beyond [0.1, 10] is
        an idle gap or a stall, not the machine's pace, and is ignored; the average moves by a
        tenth per step, so one slow step does not swing the budget.
        """
        spans = []  # (cached, run) of every request that advanced
        computed = {}
        for req in running:
            c = req.num_computed_tokens
            prev = self._computed.get(req.request_id, 0)
            if c > prev:
                spans.append((prev, c - prev))
            computed[req.request_id] = c
        self._computed = computed
        last, self._last_call = self._last_call, now if (running or waiting) else None
        if last is None:
            self._predicted = [None] * (self.lag + 1)  # idle: what ran before says nothing
        # The first call after idling has no plan before it to measure from: no prediction.
        known = spans and last is not None
        self._predicted = [
            *self._predicted[1:],
            self.cost.predict(work_of(spans)) if known else None,
        ]
        predicted = self._predicted[0]
        if last is None or predicted is None or now <= last:
            return
        ratio = (now - last) / predicted
        if 0.1 <= ratio <= 10:
            self.scale = min(8.0, max(0.25, 0.9 * self.scale + 0.1 * ratio))
            self.measured_s += now - last
            self.predicted_s += predicted
            self.num_measured += 1

    def served_scale(self) -> tuple[float, int] | None:
        """(served over calibrated step time, steps) over every step measured so far, or None
        before any: the cost model's serving scale as this run measured it."""
        if not self.num_measured:
            return None
        ratio = self.measured_s / self.predicted_s
        return self.cost.serving_scale * ratio, self.num_measured

    def _inflight_s(self) -> float:
        """Seconds before a step planned now starts: with asynchronous scheduling the last
        plan's step runs first (its prediction at the current pace); synchronously none."""
        last = self._predicted[-1] if self.lag else None
        return 0.0 if last is None else self.scale * last

    def _shed_late(self, waiting, decodes: int, ahead: int, step_s, now: float) -> list[Request]:
        """Refuses the waiting requests that would miss the TTFT target even with the whole
        budget, after the step in flight and the `ahead` prompt tokens (partial prefills) and
        the kept requests before them in the queue; returns the others. A preempted request
        (it had its first token) is never refused."""
        fastest = step_s(self.max_budget)
        inflight = self._inflight_s()
        room = max(1, self.max_budget - decodes)
        kept = []
        for req in waiting:
            steps = math.ceil((ahead + req.num_tokens) / room)
            # Whole-budget steps, then the last one with what is left (a short prompt's one step
            # is far shorter than a full one where prefill dominates the step).
            last = ahead + req.num_tokens - (steps - 1) * room
            prefill_s = (steps - 1) * fastest + step_s(min(self.max_budget, decodes + last))
            ttft = now + inflight + prefill_s - req.arrival_time
            if not req.output_token_ids and ttft > self.ttft_s:
                self.shed(
                    req,
                    f"Refused under load: its predicted time to first token is {ttft:.3f} s "
                    f"(waited {now - req.arrival_time:.3f} s, then {inflight * 1e3:.1f} ms for "
                    f"the step running and {steps} step(s), {prefill_s * 1e3:.1f} ms, for its "
                    f"{req.num_tokens} tokens and the {ahead} queued before them), more than the "
                    f"TTFT target of {self.ttft_s:.3f} s. Retry later or on another replica.",
                )
                self.num_shed += 1
            else:
                kept.append(req)
                ahead += req.num_tokens
        return kept

    def _boost(self, budget: int, first: Request | None, decodes: int, step_s, now: float) -> int:
        """The smallest budget >= `budget` that gets `first` its first token within its TTFT
        target, or `budget` when none does or none is needed."""
        if self.ttft_s is None or first is None or first.output_token_ids:
            return budget  # a preempted request already had its first token
        left = first.num_tokens - first.num_computed_tokens
        deadline = first.arrival_time + self.ttft_s
        for b in [budget, *(x for x in self.buckets if x > budget)]:
            room = max(1, b - decodes)
            if now + self._inflight_s() + math.ceil(left / room) * step_s(b) <= deadline:
                return b
        return budget  # late at any budget: served without slowing everyone


def _finishing(req: Request) -> bool:
    """True when the token in flight is `req`'s last by max_tokens: it runs no further step."""
    pending = req.num_pending
    return bool(pending) and len(req.output_token_ids) + pending >= req.sampling_params.max_tokens


def _prefill_work(spans: Sequence[tuple[int, int]], tokens: int) -> tuple[int, int]:
    """(attended pairs, prefill blocks) of `tokens` prefill tokens handed to the partial
    prefills in order, the rest to a fresh prompt (an upper bound: splitting a fresh chunk over
    prompts attends less)."""
    pairs = blocks = 0
    for cached, left in [*spans, (0, max(tokens, 0))]:
        if tokens <= 0:
            break
        n = min(left, tokens)
        pairs += n * cached + n * (n + 1) // 2
        blocks += prefill_blocks(cached, n) if n > 1 else 0
        tokens -= n
    return pairs, blocks


def refuser(scheduler) -> Callable[[Request, str], None]:
    """Refuses a waiting request of `scheduler` with a message: it ends at the next schedule()
    with finish reason "refused", its `status_message` the message."""

    def refuse(req: Request, message: str) -> None:
        req.status_message = message
        scheduler.abort_request(req.request_id, FinishReason.REFUSED)

    return refuse


def attach(scheduler, config, cost: CostModel | None) -> SloPolicy | None:
    """Gives `scheduler` an SloPolicy when `config` (an EngineConfig) asks for SLO-aware
    scheduling; returns it, or None (and the scheduler plans exactly as without this module)."""
    if not getattr(config, "slo_scheduling", False):
        return None
    if config.tpot_slo_s is None:
        raise ValueError("slo_scheduling needs a TPOT target (tpot_slo_s / --tpot-slo).")
    if cost is None:
        raise ValueError(
            "slo_scheduling needs a step-cost model (--cost-model FILE, or measured at warm-up)."
        )
    if scheduler.config.batching != "continuous":
        return None  # static and dynamic groups run whole: nothing to size
    policy = SloPolicy(
        cost,
        tpot_s=config.tpot_slo_s,
        ttft_s=config.ttft_slo_s,
        token_buckets=scheduler.config.token_buckets or (scheduler.config.max_num_batched_tokens,),
        max_num_batched_tokens=scheduler.config.max_num_batched_tokens,
        shed=refuser(scheduler) if config.shed_late else None,
        lag=1 if getattr(config, "async_scheduling", False) else 0,
        max_model_len=scheduler.config.max_model_len,
    )
    scheduler.budget_policy = policy
    return policy
