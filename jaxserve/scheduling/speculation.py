"""Speculative decoding, host side: n-gram proposals, per-request acceptance, and when it pays.

A decode step reads every weight to make one token per row; at low load the device could check
several for about the same cost. A request that repeats text it has seen (a summary quoting its
source, an edit of given code) is predictable from its own history: the n-gram proposer (prompt
lookup) finds the latest earlier occurrence of the request's last n tokens in its prompt and
output and proposes the k tokens that followed. The step then runs the last token and the k
proposals as one small chunk, and the device keeps the longest prefix its own samples agree with
(runtime/sampling.py, `verify`): no second model, and the output is exactly the one without
speculation (docs/architecture.md, "Speculative decoding").

Whether to speculate is decided per step (`SpecDecider`): the verification's extra tokens make
the step dearer (another token bucket, more attention), and pay only when the tokens they are
expected to add per row cost less than the step without them. The price comes from the step-cost
model (cost_model.py) when the engine has one, else from each bucket's time measured at warm-up;
the expected tokens from each request's own acceptance so far (`SpecState.rate`).

Plain Python, no JAX: the scheduler calls it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

# Per-token acceptance a request starts with, before any of its proposals were checked.
PRIOR_RATE = 0.7
# Weight of each verification's outcome in a request's acceptance rate (an exponential average).
RATE_WEIGHT = 0.3
# A plain decode moves the rate this share back toward the prior, so a request whose early
# proposals failed may try again later (its text may start repeating).
RATE_RECOVERY = 1 / 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding's knobs (EngineConfig's speculative fields)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: tokens proposed per verification, at most
    prompt_lookup_min: int = 2  # shortest n-gram matched
    prompt_lookup_max: int = 3  # longest n-gram matched (tried first)

    def __post_init__(self):
        if self.method != "ngram":
            raise ValueError(f"speculative method={self.method!r} must be 'ngram'.")
        k, lo, hi = self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens={k!r} must be an integer in [1, 16].")
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 16):
            raise ValueError(
                f"prompt_lookup_min={lo!r} and prompt_lookup_max={hi!r} must be integers with "
                f"1 <= prompt_lookup_min <= prompt_lookup_max <= 16."
            )


class NgramProposer:
    """One request's n-gram index over its prompt and output: proposals in O(k) a step.

    For each n in [n_min, n_max] it maps every n-gram to where the tokens after its latest
    occurrence start. Tokens are indexed as they become known (`propose` catches up), so a
    request's history is read once in all, not once per step.
    """

    def __init__(self, n_min: int, n_max: int):
        self.sizes = tuple(range(n_max, n_min - 1, -1))  # longest first: the most specific match
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 1  # continuations starting before this position are in the maps

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """The `k` tokens that followed the latest earlier occurrence of the last n of
        `tokens` (the request's known prompt + output), longest n first, copied on past the end
        as the repetition would go; [] when none matches.

        The tail itself is never its own match: only n-grams ending before the last token are
        indexed when it is looked up.
        """
        end = len(tokens)
        for c in range(self._indexed, end):  # n-grams ending at c - 1, continued at c
            for n, after in self._after.items():
                if c >= n:
                    after[tuple(tokens[c - n : c])] = c
        self._indexed = max(self._indexed, end)
        for n in self.sizes:
            if end > n:
                c = self._after[n].get(tuple(tokens[end - n :]))
                if c is not None:
                    proposal = list(tokens[c : c + k])
                    # A match close to the end runs out of tokens: go on copying from c, the
                    # proposal included, as the repetition would ("a b a b" -> "a b a b").
                    while len(proposal) < k:
                        j = c + len(proposal)
                        proposal.append(tokens[j] if j < end else proposal[j - end])
                    return proposal
        return []


@dataclasses.dataclass(eq=False)
class SpecState:
    """A request's speculation: its proposer, what it proposed and what was accepted."""

    proposer: NgramProposer
    rate: float = PRIOR_RATE  # per-token acceptance, averaged over its verifications
    num_proposed: int = 0  # tokens proposed and verified
    num_accepted: int = 0  # of those, accepted (the output tokens they saved a step each)
    num_verifications: int = 0  # steps that verified proposals of this request
    in_flight: bool = False  # a planned verification awaits its update: plan nothing until then
    # The proposal its known tokens make now (set at each update while speculation may pay): the
    # engine then plans the next step once the steps in flight are in, so the proposal is real.
    hint: bool = False

    def expected(self, k: int) -> float:
        """Expected accepted tokens of k proposals: each accepted only if all before it were."""
        r = self.rate
        return r * (1 - r**k) / (1 - r) if r < 1 else float(k)

    def record(self, proposed: int, accepted: int) -> None:
        """One verification's outcome."""
        self.num_proposed += proposed
        self.num_accepted += accepted
        self.num_verifications += 1
        # Tokens accepted per proposal tried at each position, as a per-token rate.
        tried = min(proposed, accepted + 1)
        self.rate += RATE_WEIGHT * (accepted / tried - self.rate)


# spans [(start_pos, num_tokens)] of a step -> its predicted seconds.
StepCost = Callable[[Sequence[tuple[int, int]]], float]


class SpecDecider:
    """Per step, which requests' proposals make the step's tokens cheaper.

    A step of n decodes costs c(0) for its n tokens; with k proposals on m of its rows it costs
    c(m) (plus c(0) under asynchronous scheduling, `sync_penalty`) and yields n plus those rows'
    expected accepted tokens E(m). The decider verifies the m rows (those expecting the most
    first) that make the tokens cheapest, c(m) / (n + E(m)), and none unless that beats
    c(0) / n. Costs depend only on (n, m, the longest context by key
    block) and are cached, so a decision costs dict lookups and a sum per candidate.
    """

    def __init__(
        self, config: SpeculativeConfig, step_cost: StepCost | None, sync_penalty: bool = False
    ):
        self.config = config
        self.step_cost = step_cost
        # Under asynchronous scheduling a verification makes the next plan wait for it, so the
        # device idles while the host plans: priced as one plain step more (measured on the
        # embedded model, one request: 3.3 ms a verifying step against 2.4 ms a plain one, of
        # which 0.7 ms the step itself). Off: the engine plans synchronously anyway.
        self.sync_penalty = sync_penalty
        self._costs: dict[tuple[int, int, int], float] = {}

    def _penalty(self, rows: int, context: int) -> float:
        return self.cost(rows, 0, context) if self.sync_penalty else 0.0

    def cost(self, rows: int, speculating: int, context: int) -> float:
        """Predicted seconds of a step of `rows` decodes (contexts up to `context`) of which
        `speculating` carry k proposals each; needs a step cost."""
        ctx = -(-max(context, 1) // 128) * 128  # priced by key block: one entry per block
        key = (rows, speculating, ctx)
        c = self._costs.get(key)
        if c is None:
            k = self.config.num_speculative_tokens
            spans = [(ctx - 1, k + 1)] * speculating + [(ctx - 1, 1)] * (rows - speculating)
            c = self._costs[key] = self.step_cost(spans)
        return c

    def breakeven(self, rows: int, speculating: int, context: int) -> float:
        """Expected accepted tokens, summed over the `speculating` rows of a step of `rows`
        decodes, above which their proposals make the step's tokens cheaper; inf when no cost
        is known (never speculate)."""
        if self.step_cost is None:
            return float("inf")
        c0 = self.cost(rows, 0, context)
        c1 = self.cost(rows, speculating, context) + self._penalty(rows, context)
        return rows * max(0.0, c1 / c0 - 1)

    def choose(self, states: Sequence[SpecState], rows: int, context: int) -> int:
        """How many of these requests (among `rows` decoding rows, the longest context
        `context`), taken in `rank`'s order, should verify proposals this step: the count whose
        tokens come cheapest, 0 when none beat plain decoding."""
        if self.step_cost is None or not states:
            return 0
        k = self.config.num_speculative_tokens
        expected = sorted((s.expected(k) for s in states), reverse=True)
        best, best_price = 0, self.cost(rows, 0, context) / rows
        penalty = self._penalty(rows, context)
        total = 0.0
        for m, e in enumerate(expected, 1):
            total += e
            price = (self.cost(rows, m, context) + penalty) / (rows + total)
            if price < best_price:
                best, best_price = m, price
        return best

    def rank(self, states: Sequence[SpecState]) -> list[int]:
        """Indices of `states`, the most expected accepted tokens first (`choose`'s order)."""
        k = self.config.num_speculative_tokens
        return sorted(range(len(states)), key=lambda i: -states[i].expected(k))
