"""What the engine hands back: a `RequestOutput` delta per request per step that had news."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TokenLogprob:
    """Log-probability of a generated (or prompt) token, and the top-n alternatives when asked."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class RequestMetrics:
    """Per-request timings in seconds (time.monotonic clock) and derived latencies."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def queue_wait(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    def tpot(self, num_output_tokens: int) -> float | None:
        """Mean time per output token after the first."""
        if self.finished_time is None or self.first_token_time is None or num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1)


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """New tokens and text of one request since its previous output (a streaming delta).

    Slotted: one is built per running request per step, and a slotted init is the cheaper one.
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "error", "refused" once finished
    num_prompt_tokens: int
    num_output_tokens: int  # all generated so far
    # Shared by a request's outputs while its timings do not change: read it, never change it.
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None
    # With finish_reason "error": what went wrong; "refused": why (predicted TTFT vs target).
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, not computed
    # With SamplingParams.prompt_logprobs, in the request's first output only: one entry per
    # prompt token, None for the first (nothing comes before it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Speculative decoding, the request's so far: tokens proposed and verified, of those
    # accepted, and the steps that verified them.
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Proposed tokens accepted, a share; None when none were proposed."""
        p = self.num_proposed_tokens
        return self.num_accepted_tokens / p if p else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Proposals accepted per verification; None when none ran."""
        v = self.num_verifications
        return self.num_accepted_tokens / v if v else None
