"""Speculative decoding in the scheduler: which decode rows verify proposals, and what a
verification's update does to the books (speculation.py proposes and prices; this applies).

The scheduler hands it its KV manager, prefix cache and running list, and calls it at four
points: `add` (a request gets its proposer), `propose` (after the running requests are planned:
decode rows become verification rows where that pays), `update` (a verification row's tokens),
and `hint` (after a plain decode: whether the request's known tokens make a proposal, so the
engine plans the next step once they are all known: `wants_known_tokens`). Plain Python.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxserve.scheduling.kv_cache_manager import KVCacheManager
from jaxserve.scheduling.prefix_sharing import PrefixSharing
from jaxserve.scheduling.request import PENDING_TOKEN, Request, RequestStatus
from jaxserve.scheduling.speculation import (
    PRIOR_RATE,
    RATE_RECOVERY,
    NgramProposer,
    SpecDecider,
    SpecState,
)
from jaxserve.scheduling.step_plan import StepPlan
from jaxserve.scheduling.types import RequestUpdate, ScheduledSeq, SchedulerConfig


class Verification:
    """The scheduler's speculative decoding: proposals planned, verifications taken in."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        prefix: PrefixSharing | None,
        running: list[Request],
        *,
        finish: Callable[[Request, RequestStatus, float], None],
    ):
        self.config = config
        self.kv = kv
        self.prefix = prefix
        self._running = running  # the scheduler's running requests
        self._finish = finish  # ends a request (Scheduler._finish)
        # Priced by the engine (Scheduler.set_step_cost); unpriced, nothing pays.
        self.decider = SpecDecider(config.speculative, None)
        self.verifying = 0  # plans outstanding that verify proposals

    def add(self, req: Request) -> None:
        """Gives a new request its proposer, unless its sampling rules speculation out."""
        if req.spec is None and _may_speculate(req):
            cfg = self.decider.config
            req.spec = SpecState(NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max))

    def wants_known_tokens(self) -> bool:
        """Whether the next plan should wait until every step in flight is taken in: one
        verifies proposals (its request's next tokens depend on how many it accepts), or a
        request whose known tokens make a proposal would verify it once its pending token is
        known. The engine then plans the next step synchronously."""
        if self.verifying:
            return True
        if not self.may_pay():
            return False
        hinted = [r.spec for r in self._running if r.spec is not None and r.spec.hint]
        if not hinted:
            return False
        longest = max(r.num_computed_tokens for r in self._running)
        return self.decider.choose(hinted, len(self._running), longest) > 0

    def may_pay(self) -> bool:
        """Whether proposals on one row at this load could pay at all: the per-row work of
        speculation is skipped (no lookups, no hints) at loads where they never would."""
        n = len(self._running)
        if not n:
            return False
        k = self.decider.config.num_speculative_tokens
        return self.decider.breakeven(n, 1, 1) < k

    def hint(self, req: Request) -> None:
        """After a plain decode: whether `req`'s known tokens make a proposal now, and its
        acceptance rate drifts back toward the prior (speculation.RATE_RECOVERY)."""
        spec = req.spec
        spec.rate += RATE_RECOVERY * (PRIOR_RATE - spec.rate)
        k = self.decider.config.num_speculative_tokens
        spec.hint = spec.expected(k) > self.decider.breakeven(len(self._running), 1, 1) and bool(
            spec.proposer.propose(req.all_token_ids, 1)
        )

    def propose(self, plan: StepPlan) -> None:
        """Turns this step's decode rows whose requests propose tokens into verifications,
        when that pays (speculation.SpecDecider); their pages are taken now, never by
        preempting anyone: a row whose pages do not fit verifies nothing."""
        decodes = [s for s in plan.seqs.values() if len(s.token_ids) == 1 and s.sample]
        if not decodes or not self.may_pay():
            return
        cfg = self.config
        k = self.decider.config.num_speculative_tokens
        candidates = []
        longest = 0
        for seq in decodes:
            req = seq.request
            longest = max(longest, seq.start_pos + 1)
            spec = req.spec
            if spec is None or seq.token_ids[0] == PENDING_TOKEN or spec.in_flight:
                continue
            # Never past max_tokens: the verification's last sampled token is output k + 1.
            room = min(k, req.sampling_params.max_tokens - len(req.output_token_ids) - 1)
            room = min(room, cfg.max_model_len - seq.start_pos - 2)
            if room < 1:
                continue
            proposal = spec.proposer.propose(req.all_token_ids, room)
            spec.hint = False
            if proposal:
                candidates.append((seq, proposal))
        states = [seq.request.spec for seq, _ in candidates]
        chosen = self.decider.choose(states, len(decodes), longest)
        # Every proposal is a sampled row of the step (the sampler's rows, max_num_seqs).
        rows = len(plan.seqs)
        for i in self.decider.rank(states)[:chosen]:
            seq, proposal = candidates[i]
            n = min(len(proposal), plan.budget, cfg.max_num_seqs - rows)
            if n < 1:
                break
            proposal = proposal[:n]
            if not self.kv.allocate(seq.request_id, seq.start_pos + 1 + n):
                continue
            plan.seqs[seq.request_id] = seq._replace(
                token_ids=seq.token_ids + proposal, num_proposals=n
            )
            plan.budget -= n
            rows += n

    def update(
        self, seq: ScheduledSeq, tokens: list[int], row_logprobs, now: float
    ) -> RequestUpdate:
        """A verification row's update: the accepted proposals and the token sampled after
        them, up to the first that ends the request; the KV of the rejected ones is left
        unread (the next step overwrites it) and their pages given back."""
        req = seq.request
        req.num_pending -= 1
        accepted = len(tokens) - 1
        req.spec.record(seq.num_proposals, accepted)
        out = req.output_token_ids
        status = None
        kept = []
        for token in tokens:
            token = int(token)
            kept.append(token)
            out.append(token)
            if token in req.stop_ids:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
                break
            if len(out) >= req.sampling_params.max_tokens:
                status = RequestStatus.FINISHED_LENGTH
                break
        if req.first_token_time is None:
            req.first_token_time = now
        if req.status == RequestStatus.RUNNING:
            # The last token and the accepted proposals are in the cache; the sampled token
            # after them is the next step's to run.
            req.num_computed_tokens = seq.start_pos + len(tokens)
            if self.prefix is not None:
                self.prefix.publish(req)
            if status is None:
                self.kv.trim(req.request_id, req.num_computed_tokens + 1)
        if status is not None:
            self._finish(req, status, now)
        logprobs = None if row_logprobs is None else list(row_logprobs[: len(kept)])
        return RequestUpdate(req, kept, status is not None, logprobs)


def _may_speculate(req: Request) -> bool:
    """Whether `req`'s sampling allows verifying proposals: not with logit bias, min_tokens
    or penalties, whose per-row host work (engine._fill_special_row) covers one sampled row, nor
    with a grammar, whose token mask covers one sampled row too (each proposal would need the
    mask of the grammar advanced over the proposals before it)."""
    p = req.sampling_params
    return not (p.logit_bias or p.min_tokens or p.has_penalties or req.constrained)
