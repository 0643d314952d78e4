"""Landing a step on a token bucket: trimming its last prefill chunk instead of padding.

The runner pads a step up to the next bucket of its ladder (runtime/buckets.py), so a step of
136 tokens runs as 256 on a power-of-two ladder. Once every decode and prefill is planned nothing
can fill that padding, but moving 8 tokens to the next step removes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.scheduling.step_plan import StepPlan


def land_on_bucket(plan: StepPlan, token_buckets: Sequence[int]) -> None:
    """Trims the step's last prefill chunk so the step fills a token bucket exactly.

    The trim moves at most half the padding it saves (so the step lies in the lower half of its
    bucket, and the next step cannot spend more than it saved) and at most half the chunk (a
    chunk is never starved). It falls on the least important prefill, the one planned last. A
    chunk that would have finished its prompt then samples one step later: the price, paid only
    for halving the padding. A chunk cut by the budget needs none of this: it fills the budget,
    the largest bucket.
    """
    total = plan.num_tokens
    lower = upper = None
    for bucket in token_buckets:
        if bucket <= total:
            lower = bucket
        else:
            upper = bucket
            break
    if lower is None or upper is None or lower == total:
        return
    excess = total - lower
    seq = next(reversed(plan.seqs.values()))
    if seq.num_proposals:  # a verification, not a prefill chunk: its tokens are not the prompt's
        return
    if 2 * excess > upper - lower or 2 * excess > len(seq.token_ids):
        return  # also leaves decodes (one token) alone
    plan.drop(seq.request_id)
    plan.add_chunk(seq.request, len(seq.token_ids) - excess)
