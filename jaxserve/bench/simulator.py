"""Replays a workload through the real scheduler on a virtual clock: hours of traffic in seconds.

`simulate` drives `jaxserve.scheduling.scheduler.Scheduler`, configured from an `EngineConfig` as
the engine
configures it, the way `bench.runner.run_offline` drives an engine: requests join at their
arrival times, each step is planned by the scheduler, and instead of running on a device the
clock advances by the step's time predicted by a measured cost model
(jaxserve/scheduling/cost_model.py).
The loop is `Engine.step`'s: with asynchronous scheduling (the default) step t+1 is planned
while step t runs, before step t's tokens are applied and before the requests that arrive
during step t are admitted, so a request arriving mid-step starts one step later than a
synchronous loop would start it, and a finished request's slot is taken one step later.
Sampled tokens are fakes; every request ignores EOS and runs to its workload's `max_tokens`, as
in the bench. The result is a `bench.runner.RunResult`, so `bench.metrics.summarize` reports the
same TTFT, TPOT, queue wait, goodput, KV use and preemptions as `jaxserve bench`.

What the simulator leaves out: host work between steps beyond what the cost model measured
with the steps (admission, detokenization), and the KV pool sized from free memory (it uses
`num_pages`, or one full context per row, the engine's bound). No JAX is imported on this path.
The same seed gives the same result, bit for bit.
"""

from __future__ import annotations

import collections
import math

from jaxserve.bench.runner import RequestRecord, RunResult, Timeline, prompt_for, sampling_for
from jaxserve.bench.workload import Workload
from jaxserve.engine_config import EngineConfig
from jaxserve.scheduling import slo_policy
from jaxserve.scheduling.cost_model import CostModel
from jaxserve.scheduling.request import Request
from jaxserve.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, StepResult

FAKE_TOKEN = 3  # any id: outputs ignore EOS, so their values never matter
DEFAULT_VOCAB = 32000  # prompt ids only matter to the prefix cache, which sees equal ones equal
_IDLE_POLL_S = 1e-3  # a dynamic batch waiting to fill: the bench's runner polls at this period


def scheduler_config(config: EngineConfig, max_model_len: int) -> SchedulerConfig:
    """The SchedulerConfig an engine of `config` builds, without a device: the pool is
    `num_pages`, or one full context per row."""
    pages_per_seq = math.ceil(max_model_len / config.page_size)
    return config.scheduler_config(
        max_model_len=max_model_len,
        num_pages=config.num_pages or config.max_num_seqs * pages_per_seq,
    )


def build_scheduler(config: EngineConfig, cost: CostModel, max_model_len: int) -> Scheduler:
    """The scheduler an engine of `config` would run, its SLO policy attached when asked for."""
    sched = Scheduler(scheduler_config(config, max_model_len))
    slo_policy.attach(sched, config, cost)
    return sched


def simulate(
    workload: Workload,
    config: EngineConfig,
    cost: CostModel,
    *,
    label: str = "simulated",
    max_model_len: int | None = None,
    vocab_size: int = DEFAULT_VOCAB,
    seed: int = 0,
    step_cost: CostModel | None = None,
) -> RunResult:
    """Serves `workload` on a virtual clock (module docstring); times are seconds from 0.

    Steps take `step_cost`'s time when given, else `cost`'s; the SLO policy plans with `cost`
    either way, as an engine plans with the model it loaded whatever pace the machine runs at
    (e.g. `step_cost` fitted to a real run's own steps replays that run's pace).
    """
    max_model_len = max_model_len or config.max_model_len
    if max_model_len is None:
        raise ValueError("simulate needs max_model_len (or EngineConfig.max_model_len).")
    sched = build_scheduler(config, cost, max_model_len)
    buckets = sched.config.token_buckets
    pending = collections.deque(workload.requests)
    closed = workload.concurrency
    outstanding = 0
    records: list[RequestRecord] = []
    timeline = Timeline()
    clock = 0.0
    steps = real = padded = 0

    def admit() -> None:
        nonlocal outstanding
        while pending and (outstanding < closed if closed else pending[0].arrival_s <= clock):
            spec = pending.popleft()
            prompt = prompt_for(spec, vocab_size, seed)
            if isinstance(prompt, str):  # a text prompt: its estimated length, in fake ids
                prompt = [FAKE_TOKEN] * spec.prompt_len
            sched.add_request(
                Request(
                    request_id=spec.request_id,
                    prompt_token_ids=prompt,
                    sampling_params=sampling_for(spec),
                    arrival_time=clock if closed else spec.arrival_s,
                    priority=spec.priority,
                )
            )
            outstanding += 1

    # The engine's loop, as Engine.step runs it: plan and dispatch the next step, then take in
    # the steps before it (with asynchronous scheduling, all but the newest, unless that one is
    # empty: step t+1 is planned while step t runs, so its tokens are applied one step late).
    lag = 1 if config.async_scheduling else 0
    inflight: collections.deque[tuple[SchedulerOutput, float]] = collections.deque()
    device_free = 0.0  # when the device finishes the last step dispatched
    while pending or sched.has_unfinished() or inflight:
        admit()
        if not sched.has_unfinished() and not inflight:
            clock = max(clock, pending[0].arrival_s)
            continue
        plan = sched.schedule(now=clock)
        if plan.seqs:
            # Queued behind the step in flight: the device runs steps back to back, and the
            # cost model timed each as the loop waits for it, host work included.
            device_free = max(clock, device_free) + (step_cost or cost).predict_plan(plan)
            steps += 1
            real += plan.num_batched_tokens
            padded += next((b for b in buckets if b >= plan.num_batched_tokens), buckets[-1])
        inflight.append((plan, device_free if plan.seqs else clock))
        updates = []
        while inflight and (len(inflight) > lag or not inflight[-1][0].seqs):
            done, end = inflight.popleft()
            clock = max(clock, end)
            sampled = [FAKE_TOKEN if s.sample else None for s in done.seqs]
            updates += sched.update(done, StepResult(sampled_token_ids=sampled), now=clock)
        timeline.add(clock, sched.num_slots_used, sched.num_waiting, sched.num_pages_used)
        for u in updates:
            if u.finished:
                outstanding -= 1
                records.append(_record(u.request))
        if sched.num_running == 0 and not updates:
            # Nothing runs (a dynamic batch waits to fill): time passes as the runner polls.
            next_at = pending[0].arrival_s if pending and not closed else math.inf
            clock = max(clock, min(next_at, clock + _IDLE_POLL_S))
    return RunResult(
        label=label,
        workload=workload,
        records=records,
        duration_s=max((r.finished or 0.0) for r in records) if records else 0.0,
        max_num_seqs=config.max_num_seqs,
        kv_pages_total=sched.config.num_pages,
        timeline=timeline,
        engine={
            "preemptions": sched.num_preemptions,
            "steps": steps,
            "compiles_after_warmup": 0,
            "padding_efficiency": real / padded if padded else 1.0,
        },
    )


def _record(req: Request) -> RequestRecord:
    return RequestRecord(
        request_id=req.request_id,
        prompt_len=req.num_prompt_tokens,
        output_len=len(req.output_token_ids),
        arrival=req.arrival_time,
        first_scheduled=req.first_scheduled_time,
        first_token=req.first_token_time,
        finished=req.finished_time,
        finish_reason=req.finish_reason.value if req.finish_reason else None,
        preemptions=req.num_preemptions,
        cached_tokens=req.num_cached_tokens,
    )
