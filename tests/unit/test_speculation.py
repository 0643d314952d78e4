"""Speculative decoding on the host: the n-gram proposer, the pay decision, and the scheduler's
verification rows against a fake model that verifies them (no JAX)."""

from __future__ import annotations

import random

import pytest

from jaxserve.scheduling.request import PENDING_TOKEN, RequestStatus
from jaxserve.scheduling.scheduler import StepResult
from jaxserve.scheduling.speculation import (
    NgramProposer,
    SpecDecider,
    SpecState,
    SpeculativeConfig,
)
from tests.unit.helpers import FakeRunner, add_all, fake_next_token, make_request, make_scheduler

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


def brute_force(tokens: list[int], k: int, sizes) -> list[int]:
    """Prompt lookup by scanning: the latest earlier occurrence of the longest matching tail,
    its continuation copied on (the proposal included) past the end."""
    for n in sizes:
        if len(tokens) <= n:
            continue
        tail = tokens[-n:]
        for c in range(len(tokens) - 1, n - 1, -1):  # continuation start, latest first
            if tokens[c - n : c] == tail:
                extended = list(tokens)
                for j in range(k):
                    extended.append(extended[c + j])
                return extended[len(tokens) :]
    return []


def test_ngram_proposer_agrees_with_a_scan_as_the_tokens_grow():
    rng = random.Random(0)
    for trial in range(20):
        proposer = NgramProposer(1, 3)
        tokens = [rng.randrange(4) for _ in range(5)]
        for _ in range(40):
            k = rng.randrange(1, 5)
            assert proposer.propose(tokens, k) == brute_force(tokens, k, (3, 2, 1)), (trial, tokens)
            tokens.append(rng.randrange(4))


def test_ngram_proposer_prefers_the_longest_match_then_the_latest():
    proposer = NgramProposer(1, 2)
    # "5" alone last continued with 9; "4 5" continued with 6: the 2-gram wins.
    assert proposer.propose([4, 5, 6, 7, 5, 9, 4, 5], 2) == [6, 7]
    proposer = NgramProposer(1, 2)
    assert proposer.propose([4, 5, 6, 1, 4, 5, 8, 2, 4, 5], 1) == [8]  # the latest "4 5"
    # A loop of period 2 matched just before the end: the proposal goes on around it.
    assert NgramProposer(1, 2).propose([3, 7, 8, 7, 8], 5) == [7, 8, 7, 8, 7]
    assert NgramProposer(2, 3).propose([1, 2, 3, 4], 3) == []  # nothing repeats


def test_decider_speculates_only_when_the_step_cost_allows():
    states = [SpecState(NgramProposer(1, 1)) for _ in range(4)]
    assert SpecDecider(SPEC, None).choose(states, 4, 10) == 0  # unpriced: never
    flat = SpecDecider(SPEC, lambda spans: 1.0)  # extra tokens cost nothing
    assert flat.choose(states, 4, 10) == 4
    # Each token costs the same: 3 proposals on a row cost 3 tokens' time, and a row expects
    # fewer than 3 accepted, so no subset pays.
    linear = SpecDecider(SPEC, lambda spans: float(sum(n for _, n in spans)))
    assert linear.choose(states, 4, 10) == 0
    # Cheap extra tokens: a request that accepts often pays, one that never does not.
    cheap = SpecDecider(SPEC, lambda spans: 10.0 + sum(n for _, n in spans))
    good, bad = SpecState(NgramProposer(1, 1), rate=0.95), SpecState(NgramProposer(1, 1), rate=0.0)
    assert cheap.choose([bad, good], 2, 10) == 1
    assert cheap.rank([bad, good]) == [1, 0]
    # Under asynchronous scheduling a verification also costs a plain step of lost overlap: one
    # row alone pays only when it expects more accepted tokens than c(1) / c(0) = 15 / 11.
    overlap = SpecDecider(SPEC, lambda spans: 10.0 + sum(n for _, n in spans), sync_penalty=True)
    assert overlap.choose([good], 1, 10) == 1  # expects ~2.7
    assert overlap.choose([SpecState(NgramProposer(1, 1), rate=0.5)], 1, 10) == 0  # ~0.9
    # One good row among 8: its tokens do not make up for the 8 rows' lost overlap; 8 good do.
    assert overlap.choose([good, *[bad] * 7], 8, 10) == 0
    assert overlap.choose([good] * 8, 8, 10) == 8


def test_acceptance_rate_follows_the_outcomes():
    state = SpecState(NgramProposer(1, 1))
    for _ in range(30):
        state.record(proposed=3, accepted=3)
    assert state.rate > 0.95 and state.expected(3) > 2.8
    for _ in range(30):
        state.record(proposed=3, accepted=0)
    assert state.rate < 0.05 and state.expected(3) < 0.1
    assert (state.num_proposed, state.num_accepted, state.num_verifications) == (180, 90, 60)


def test_a_partial_acceptance_moves_the_rate_by_the_positions_it_tried():
    """k proposals of which a are accepted tried a + 1 positions (the first rejection ends the
    verification), or k when all were accepted: the rate moves toward a / tried, not a / k."""
    state = SpecState(NgramProposer(1, 1))
    assert state.rate == 0.7  # the prior
    state.record(proposed=3, accepted=1)  # tried 2 positions, 1 accepted: 1/2
    assert state.rate == pytest.approx(0.7 + 0.3 * (0.5 - 0.7))  # 0.64, not 0.59 (1/3)
    state.record(proposed=4, accepted=2)  # tried 3: 2/3
    assert state.rate == pytest.approx(0.64 + 0.3 * (2 / 3 - 0.64))
    state.record(proposed=2, accepted=2)  # all accepted: tried both, 2/2
    assert state.rate == pytest.approx(0.648 + 0.3 * (1 - 0.648))
    assert (state.num_proposed, state.num_accepted, state.num_verifications) == (9, 5, 3)
    # A request that accepts one of three every time accepts each position it tries half the
    # time: the rate settles at 1/2, and 3 proposals are expected to add 1/2 + 1/4 + 1/8.
    steady = SpecState(NgramProposer(1, 1))
    for _ in range(60):
        steady.record(proposed=3, accepted=1)
    assert steady.rate == pytest.approx(0.5, abs=1e-6)
    assert steady.expected(3) == pytest.approx(0.875, abs=1e-5)


@pytest.mark.parametrize(
    "sampling",
    [
        {"structured_output": {"regex": "[0-9]+"}},  # a grammar: its mask covers one row
        {"logit_bias": {5: 2.0}},
        {"min_tokens": 2},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 1.2},
    ],
    ids=lambda s: next(iter(s)),
)
def test_constrained_biased_and_penalised_requests_are_never_given_proposals(sampling):
    """Beside a plain request whose proposals are verified, one whose sampling makes proposals
    unsafe (its per-row host work covers one sampled row) gets none, step after step, though
    its prompt repeats as much."""
    sched = make_scheduler(speculative=SPEC)
    sched.set_step_cost(lambda spans: 1.0)  # flat: every proposal would pay
    plain = make_request("plain", max_tokens=20)
    ruled = make_request("ruled", max_tokens=20, **sampling)
    for req in (plain, ruled):
        req.prompt_token_ids = [5, 6, 7, 5, 6]  # ends in "5 6": proposes "7 5 6"
    add_all(sched, [plain, ruled])
    assert plain.spec is not None and ruled.spec is None
    sched.update(sched.schedule(), StepResult(sampled_token_ids=[7, 7]))  # the prefills
    for _ in range(4):
        plan = sched.schedule()
        by_id = {s.request_id: s for s in plan.seqs}
        assert by_id["plain"].num_proposals > 0
        assert by_id["ruled"].num_proposals == 0 and len(by_id["ruled"].token_ids) == 1
        # Every proposal accepted, the next token repeating the loop "7 5 6".
        sampled = []
        for seq in plan.seqs:
            if seq.num_proposals:
                sampled.append([*seq.token_ids[1:], seq.token_ids[-2]])
            else:
                sampled.append(7)
        sched.update(plan, StepResult(sampled_token_ids=sampled))
        sched.check_invariants()
    assert ruled.spec is None and plain.spec.num_accepted > 0


class VerifyingRunner(FakeRunner):
    """FakeRunner that also verifies proposals: it samples the model's token after each query
    of a verification row (each reading only the cache up to that query) and keeps them up to
    the first that differs from the proposal after it, as the device's `verify` does."""

    def __init__(self, page_size: int, next_token=fake_next_token):
        super().__init__(page_size)
        self.next_token = next_token

    def _history(self, seq, end: int) -> list[int]:
        return [self.cache[self._slot(seq.page_table, p)] for p in range(end)]

    def run_step(self, plan):
        sampled = []
        for seq in plan.seqs:
            assert len(seq.page_table) * self.page_size >= seq.end_pos, seq
            last = self.last_sampled.get(seq.slot)
            tokens = [last if t == PENDING_TOKEN else t for t in seq.token_ids]
            for i, token in enumerate(tokens):
                self.cache[self._slot(seq.page_table, seq.start_pos + i)] = token
            if not seq.sample:
                sampled.append(None)
                continue
            out = []
            if not seq.num_proposals:  # a decode or a prompt's last chunk: after its last token
                out.append(self.next_token(self._history(seq, seq.end_pos)))
            for j in range(seq.num_proposals and seq.num_proposals + 1):
                out.append(self.next_token(self._history(seq, seq.start_pos + j + 1)))
                if j == seq.num_proposals or out[-1] != tokens[j + 1]:
                    break
            self.last_sampled[seq.slot] = out[-1]
            sampled.append(out if seq.num_proposals else out[0])
        return StepResult(sampled_token_ids=sampled)


def repeating(period: int):
    """A model that repeats its context with this period: proposals from it are right."""
    return lambda history: history[len(history) - period]


def expected_output(req, next_token) -> list[int]:
    history, out = list(req.prompt_token_ids), []
    while len(out) < req.sampling_params.max_tokens:
        out.append(next_token(history))
        history.append(out[-1])
        if out[-1] in req.stop_ids:
            break
    return out


def serve(sched, runner, asynchronous: bool):
    """Runs to completion; asynchronous: each plan is made before the last one's update, as
    the engine does unless the scheduler wants known tokens (Scheduler.wants_known_tokens)."""
    pending = None
    steps = 0
    while sched.has_unfinished() or pending is not None:
        steps += 1
        assert steps < 5000, "no progress"
        if asynchronous and pending is not None and not sched.wants_known_tokens():
            plan = sched.schedule()
            sched.update(pending, runner.execute(pending))
            pending = plan
            if plan.is_empty:  # nothing runs: taken in at once, as the engine does
                sched.update(plan, StepResult(sampled_token_ids=[]))
                pending = None
        else:
            if pending is not None:
                sched.update(pending, runner.execute(pending))
                pending = None
            if sched.has_unfinished():
                pending = sched.schedule()
        sched.check_invariants()
    return steps


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("model", ["repeating", "hash"])
def test_verified_outputs_equal_the_model_s_with_chunks_preemption_and_prefix_cache(
    model, asynchronous
):
    """Tokens proposed and verified, chunked prompts, preemptions (few pages) and shared
    prefixes: every request's output is what the model makes one token at a time."""
    # The hash model over 7 tokens: its n-grams recur, so it is proposed to, but mostly wrongly.
    next_token = repeating(5) if model == "repeating" else lambda h: 1 + fake_next_token(h) % 7
    sched = make_scheduler(
        num_pages=14,
        max_num_batched_tokens=12,
        max_num_seqs=4,
        enable_prefix_caching=True,
        speculative=SPEC,
    )
    sched.set_step_cost(lambda spans: 1.0)  # flat: proposals always pay
    runner = VerifyingRunner(4, next_token)
    requests = [
        make_request(f"r{i}", prompt_len=6 + 3 * i, max_tokens=9 + 4 * i, first_token=1 + i % 2)
        for i in range(5)
    ]
    add_all(sched, requests)
    serve(sched, runner, asynchronous)
    for req in requests:
        assert req.output_token_ids == expected_output(req, next_token), req.request_id
    assert sched.num_pages_used == 0
    spec = [r.spec for r in requests]
    assert sum(s.num_verifications for s in spec) > 0
    accepted, proposed = sum(s.num_accepted for s in spec), sum(s.num_proposed for s in spec)
    if model == "repeating":  # right proposals are accepted
        assert accepted > proposed / 2
        assert sched.num_preemptions > 0
    else:  # the hash model's continuations are not its past ones: most proposals are rejected
        assert accepted < proposed / 2


def test_rejected_proposals_give_their_pages_back_and_the_next_step_resumes_after_them():
    sched = make_scheduler(speculative=SPEC)
    sched.set_step_cost(lambda spans: 1.0)
    req = make_request("r", prompt_len=3, max_tokens=20)
    req.prompt_token_ids = [5, 6, 7, 5, 6]  # ends in "5 6": propose what followed, "7 5 6"
    sched.add_request(req)
    sched.update(sched.schedule(), StepResult(sampled_token_ids=[7]))  # prefill samples 7
    plan = sched.schedule()
    (seq,) = plan.seqs
    # The tail "6 7" matched at positions 1-2, followed by "5 6" and then the sampled 7.
    assert (seq.token_ids, seq.start_pos, seq.num_proposals) == ([7, 5, 6, 7], 5, 3)
    assert sched.kv.num_pages_of("r") == 3  # 9 slots of 4
    sched.update(plan, StepResult(sampled_token_ids=[[5, 9]]))  # "5" accepted, "6" rejected
    sched.check_invariants()
    assert req.output_token_ids == [7, 5, 9]
    assert req.num_computed_tokens == 7  # the prompt, 7 and 5: the 9 runs next
    assert sched.kv.num_pages_of("r") == 2  # 8 slots hold the 7 tokens and the next one
    plan = sched.schedule()
    (seq,) = plan.seqs
    assert (seq.token_ids[0], seq.start_pos) == (9, 7)


def test_a_verification_stops_at_max_tokens_and_at_a_stop_id():
    sched = make_scheduler(speculative=SPEC)
    sched.set_step_cost(lambda spans: 1.0)
    short = make_request("short", max_tokens=3)
    short.prompt_token_ids = [5, 6, 7, 5, 6]
    stop = make_request("stop", max_tokens=20, eos_token_ids=(8,))
    stop.prompt_token_ids = [5, 6, 7, 8, 5, 6]
    add_all(sched, [short, stop])
    sched.update(sched.schedule(), StepResult(sampled_token_ids=[7, 7]))
    plan = sched.schedule()
    by_id = {s.request_id: s for s in plan.seqs}
    assert by_id["short"].num_proposals == 1  # 3 - 1 output so far - the token sampled last
    assert by_id["stop"].num_proposals == 3 and by_id["stop"].token_ids == [7, 8, 5, 6]
    updates = sched.update(plan, StepResult(sampled_token_ids=[[5, 6], [8, 5, 6, 1]]))
    got = {u.request.request_id: (u.new_token_ids, u.finished) for u in updates}
    assert got == {"short": ([5, 6], True), "stop": ([8], True)}
    assert short.status == RequestStatus.FINISHED_LENGTH
    assert stop.status == RequestStatus.FINISHED_STOPPED and stop.output_token_ids == [7, 8]
    assert sched.num_pages_used == 0


@pytest.mark.parametrize(("max_num_seqs", "proposals"), [(4, 3), (3, 2)])
def test_proposals_fill_the_sampling_rows_and_all_accepted_add_the_bonus_token(
    max_num_seqs, proposals
):
    """Each proposal takes a sampling row of the step (max_num_seqs of them): one decoding
    request gets as many as the rows left, all of them. All accepted, the update adds them and
    the token sampled after them, and books every one as accepted."""
    sched = make_scheduler(speculative=SPEC, max_num_seqs=max_num_seqs)
    sched.set_step_cost(lambda spans: 1.0)
    req = make_request("r", max_tokens=20)
    req.prompt_token_ids = [5, 6, 7, 5, 6, 7, 5, 6]  # proposes "7 5 6"
    sched.add_request(req)
    sched.update(sched.schedule(), StepResult(sampled_token_ids=[7]))
    plan = sched.schedule()
    (seq,) = plan.seqs
    assert seq.num_proposals == proposals == max_num_seqs - 1
    assert plan.num_proposed == proposals
    verified = [*seq.token_ids[1:], 9]  # every proposal, then the bonus 9
    (update,) = sched.update(plan, StepResult(sampled_token_ids=[verified]))
    assert update.new_token_ids == verified and len(verified) == proposals + 1
    assert (req.spec.num_proposed, req.spec.num_accepted) == (proposals, proposals)
    assert req.num_computed_tokens == 8 + 1 + proposals  # the bonus runs next
    sched.check_invariants()


def test_a_request_is_not_planned_while_its_verification_is_in_flight():
    sched = make_scheduler(speculative=SPEC)
    sched.set_step_cost(lambda spans: 1.0)
    req = make_request("r", max_tokens=20)
    req.prompt_token_ids = [5, 6, 7, 5, 6]
    sched.add_request(req)
    sched.update(sched.schedule(), StepResult(sampled_token_ids=[7]))
    verifying = sched.schedule()
    assert verifying.seqs[0].num_proposals == 3
    assert sched.wants_known_tokens()
    assert sched.schedule().seqs == []  # planned before the verification's update: nothing
    with pytest.raises(ValueError, match="list of 1 to 4 tokens"):
        sched.update(verifying, StepResult(sampled_token_ids=[7]))
