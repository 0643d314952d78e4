"""Planning the running requests: one token for each decode, then the rest of each prompt.

Decodes go first: one token each always fits (max_num_batched_tokens >= max_num_seqs), so a long
prompt being prefilled never stalls the streams of the others. Then the running requests still
prefilling, in order of importance, take what the budget leaves, chunked when it is short. A
request that needs a page when none is left preempts the least important (preemption.py).
This is the scheduler's hot path: every running request, every step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from jaxserve.scheduling.request import PENDING_TOKEN, Request, RequestStatus
from jaxserve.scheduling.step_plan import StepPlan
from jaxserve.scheduling.types import ScheduledSeq, SchedulerConfig


def plan_running(
    plan: StepPlan,
    running: list[Request],
    keys: Mapping[str, tuple],
    config: SchedulerConfig,
    allocate: Callable[[Request, int, StepPlan], bool],
) -> None:
    """Adds the running requests' next chunks to `plan`, decodes first, in admission order.

    `allocate(req, num_tokens, plan)` grows `req`'s pages, preempting when they run out
    (Preemption.allocate_or_preempt); it returns False when `req` itself was preempted.
    """
    # Request's properties are spelled out (num_tokens = prompt + outputs + pending): a
    # property call per row is a measurable share of a 256-row step's host time.
    # One pass: each decode is planned as it is met, in admission order; prefills after.
    prefilling = []
    max_len = config.max_model_len
    ps = config.page_size
    tables = plan.tables
    group_tables = plan.group_tables
    running_status = RequestStatus.RUNNING
    # Decodes go into the plan's dict directly and pay their budget (a token each) after
    # the loop: `StepPlan.add` per row was a fifth of this loop. Nothing here reads the
    # budget, and a decode dropped by a preemption gives its token back as usual.
    seqs = plan.seqs
    num_decodes = 0
    for req in tuple(running):  # a copy: an allocation below may preempt
        if req.status != running_status:  # preempted for an earlier one
            continue
        outputs = len(req.output_token_ids)
        pending = req.num_pending
        # A verification in flight: where its next token goes depends on how many proposals
        # it accepts, which only its update says (scheduler._update_verified).
        if pending and req.spec is not None and req.spec.in_flight:
            continue
        total = len(req.prompt_token_ids) + outputs + pending
        start = req.num_computed_tokens
        if total - start != 1:
            if total != start:
                prefilling.append(req)
            continue
        # A pending token that will end the request by length: nothing more to run. A grammar
        # row waits for its pending token: its next mask depends on it (docs/architecture.md,
        # "Structured output").
        if pending and (
            req.constrained
            or outputs + pending >= req.sampling_params.max_tokens
            or total >= max_len
        ):
            continue
        rid = req.request_id
        table = tables[rid]
        # Most decodes fit the pages they hold: allocate only when a page fills up.
        if start >= len(table) * ps and not allocate(req, start + 1, plan):
            continue
        if pending:
            token = PENDING_TOKEN
        elif outputs:
            token = req.output_token_ids[-1]
        else:
            token = req.prompt_token_ids[-1]
        # Positional: the fields in order (request, request_id, slot, token_ids, start_pos,
        # page_table, sample).
        seqs[rid] = (
            ScheduledSeq(req, rid, req.slot, [token], start, table, True, 0, group_tables[rid])
            if group_tables
            else ScheduledSeq(req, rid, req.slot, [token], start, table, True)
        )
        num_decodes += 1
    plan.budget -= num_decodes
    prefilling.sort(key=lambda r: keys[r.request_id])
    for req in prefilling:
        if req.status != running_status:  # preempted for an earlier one
            continue
        n = plan.chunk_len(req, req.num_computed_tokens)
        if n and allocate(req, req.num_computed_tokens + n, plan):
            plan.add_chunk(req, n)
