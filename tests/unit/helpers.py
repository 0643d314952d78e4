"""Builders and a fake model for scheduler tests: no jax, no weights.

`FakeRunner` stands in for the model runner. It writes each scheduled token into a dict keyed by
KV slot (page * page_size + offset, as the real pack() does) and samples a token that is
arithmetic on the whole history it reads back through the page table. A scheduler that hands a
page to two requests, or packs the wrong tokens or positions, therefore changes the outputs, and
`reference_output` (the same arithmetic on the prompt alone) tells.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.request import PENDING_TOKEN, Request
from jaxserve.scheduling.scheduler import (
    RequestUpdate,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepResult,
)

VOCAB = 1000
EOS = 0  # the fake model's end-of-sequence token


def make_scheduler(**overrides) -> Scheduler:
    """A small scheduler: 8 slots, 64-token budget, 64 pages of 4 tokens, 64-token max_model_len.

    The prefix cache is off unless asked for: these requests share their prompts by
    construction, and the tests that count pages and tokens mean the uncached schedule
    (tests/unit/test_prefix_cache.py covers the cache).
    """
    config = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_pages=64,
        page_size=4,
        max_model_len=64,
        enable_prefix_caching=False,
    )
    return Scheduler(SchedulerConfig(**{**config, **overrides}))


def make_request(
    request_id: str,
    prompt_len: int = 8,
    *,
    max_tokens: int = 4,
    arrival_time: float = 0.0,
    priority: int = 0,
    eos_token_ids: tuple[int, ...] = (EOS,),
    first_token: int = 1,
    **sampling,
) -> Request:
    """A request whose prompt is first_token, first_token + 1, ... (never EOS for small prompts)."""
    return Request(
        request_id=request_id,
        prompt_token_ids=[first_token + i for i in range(prompt_len)],
        sampling_params=SamplingParams(max_tokens=max_tokens, **sampling),
        arrival_time=arrival_time,
        priority=priority,
        eos_token_ids=eos_token_ids,
    )


def make_requests(n: int, prompt_len: int = 8, **kwargs) -> list[Request]:
    """Requests r0..r{n-1} arriving at times 0, 1, 2, ..."""
    return [make_request(f"r{i}", prompt_len, arrival_time=float(i), **kwargs) for i in range(n)]


def add_all(sched: Scheduler, requests: Iterable[Request]) -> None:
    for req in requests:
        sched.add_request(req)


def fake_next_token(history: list[int]) -> int:
    """The fake model: a token that depends on every earlier token and their order; never EOS."""
    h = 0
    for t in history:
        h = (h * 31 + t + 1) % 999_983
    return 1 + h % (VOCAB - 1)


def reference_output(req: Request) -> list[int]:
    """What the fake model must produce for `req` however it is batched, chunked or preempted."""
    history, out = list(req.prompt_token_ids), []
    while len(out) < req.sampling_params.max_tokens:
        token = fake_next_token(history)
        history.append(token)
        out.append(token)
        if token in req.stop_ids:
            break
    return out


class FakeRunner:
    """Executes plans against a fake paged KV cache of token ids (see the module docstring)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.cache: dict[int, int] = {}  # KV slot -> token id written there
        # Batch slot -> the token its row sampled last: what the real runner keeps on the device
        # to feed a pending token (PENDING_TOKEN) into the next step.
        self.last_sampled: dict[int, int] = {}

    def _slot(self, page_table: list[int], pos: int) -> int:
        return page_table[pos // self.page_size] * self.page_size + pos % self.page_size

    def execute(self, plan: SchedulerOutput) -> StepResult:
        """The plan's page copies, then its step, as the engine runs them."""
        self.fork_pages(plan)
        return self.run_step(plan)

    def fork_pages(self, plan: SchedulerOutput) -> None:
        """Copies the partial pages the plan forks (SchedulerOutput.page_copies), whole."""
        ps = self.page_size
        for src, dst in plan.page_copies:
            for i in range(ps):
                if src * ps + i in self.cache:
                    self.cache[dst * ps + i] = self.cache[src * ps + i]
                else:
                    self.cache.pop(dst * ps + i, None)

    def run_step(self, plan: SchedulerOutput) -> StepResult:
        """Writes the plan's tokens into their slots and samples each sampling row."""
        sampled: list[int | None] = []
        for seq in plan.seqs:
            assert len(seq.page_table) * self.page_size >= seq.end_pos, seq
            for i, token in enumerate(seq.token_ids):
                if token == PENDING_TOKEN:
                    token = self.last_sampled[seq.slot]
                self.cache[self._slot(seq.page_table, seq.start_pos + i)] = token
            if seq.sample:
                history = [self.cache[self._slot(seq.page_table, p)] for p in range(seq.end_pos)]
                sampled.append(fake_next_token(history))
                self.last_sampled[seq.slot] = sampled[-1]
            else:
                sampled.append(None)
        return StepResult(sampled_token_ids=sampled)


def step(
    sched: Scheduler,
    token: int = 7,
    *,
    tokens: dict[str, int] | None = None,
    now: float | None = None,
) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    """One schedule + update, sampling `token` (or tokens[id]) for every row that samples."""
    plan = sched.schedule(now)
    sampled = [(tokens or {}).get(s.request_id, token) if s.sample else None for s in plan.seqs]
    updates = sched.update(plan, StepResult(sampled_token_ids=sampled), now)
    sched.check_invariants()
    return plan, updates


def run_to_completion(
    sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000
) -> list[SchedulerOutput]:
    """Steps with the fake model until nothing is left; returns the plans."""
    plans = []
    while sched.has_unfinished():
        assert len(plans) < max_steps, "the scheduler made no progress"
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
        sched.check_invariants()
        plans.append(plan)
    return plans
