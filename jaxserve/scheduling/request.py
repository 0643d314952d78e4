"""One request's state on the host, owned and changed only by the scheduler.

The scheduler needs two numbers per request, `num_computed_tokens` (already in the KV cache) and
`num_tokens` (prompt plus outputs so far), and decides every iteration how many of the difference
to run; there is no prefill or decode mode. Plain Python, no jax.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence

from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.speculation import SpecState

# Stands for an output token a step in flight samples: never a vocabulary id.
PENDING_TOKEN = -1


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request, ordered so that `status > PREEMPTED` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, to recompute its prompt and outputs
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    FINISHED_REFUSED = 7  # shed before its first token: it could not meet its TTFT target

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


class FinishReason(enum.StrEnum):
    """Why a request finished, as clients see it."""

    STOP = "stop"  # an EOS token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the model's max_model_len
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # the engine could not serve it
    REFUSED = "refused"  # shed under load (--shed-late): `Request.status_message` says why

    @property
    def status(self) -> RequestStatus:
        return _STATUS_OF[self]


_STATUS_OF = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
    FinishReason.REFUSED: RequestStatus.FINISHED_REFUSED,
}
_REASON_OF = {status: reason for reason, status in _STATUS_OF.items()}


@dataclasses.dataclass(kw_only=True, eq=False)
class Request:
    """A prompt, how to sample it, and everything the scheduler tracks while serving it."""

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    priority: int = 0  # lower is more important (vLLM's convention); only the priority policy
    eos_token_ids: tuple[int, ...] = ()  # the model's; ignored when sampling_params.ignore_eos
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    # Tokens whose keys and values are in the KV cache, or will be once the steps already
    # planned have run: the scheduler counts a step's work as done when it plans it.
    num_computed_tokens: int = 0
    # Output tokens that planned steps sample but whose values the host does not know yet
    # (asynchronous scheduling: the device feeds them to the next step itself). They count in
    # `num_tokens`, so the next step plans them; `token_ids` shows each as PENDING_TOKEN.
    num_pending: int = 0
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None  # row of the decode batch, held while RUNNING
    stop_reason: int | str | None = None  # the token id or stop string that stopped it
    # Timing, in the scheduler's clock (time.monotonic unless tests pass `now`), for metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Why it ended, for the client, where the finish reason alone does not say (a refusal's
    # predicted TTFT against the target).
    status_message: str | None = None
    # Prefix cache: anything besides the tokens that changes the KV (a LoRA id, a tenant's salt
    # keeping its cache apart); requests with different salts never share pages.
    cache_salt: str | None = None
    # Multi-LoRA: the adapter it runs with (None: the base model), and the device slot admission
    # gave that adapter (lora_slots.py; 0 while not running or without an adapter).
    lora_name: str | None = None
    lora_slot: int = 0
    # Prompt tokens served from cached pages at the first admission (None until admitted).
    num_cached_tokens: int | None = None
    # Hashes of the full pages of prompt + outputs so far (kv_cache_manager.PageHasher), grown by
    # the scheduler as pages fill; kept across preemptions, since the tokens do not change.
    page_hashes: list[bytes] = dataclasses.field(default_factory=list, repr=False)
    # Speculative decoding (speculation.py): its proposer and counts; None when the engine does
    # not speculate, or not for this request (its sampling needs per-row host work).
    spec: SpecState | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id={self.request_id!r} must be a non-empty string.")
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"Request {self.request_id!r} has an empty prompt.")
        if any(not isinstance(t, int) or t < 0 for t in self.prompt_token_ids):
            raise ValueError(
                f"Request {self.request_id!r} has prompt token ids that are not ints >= 0."
            )
        if self.lora_name is not None and not (isinstance(self.lora_name, str) and self.lora_name):
            raise ValueError(f"lora_name={self.lora_name!r} must be a non-empty string or None.")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt={self.cache_salt!r} must be a string or None.")
        if not isinstance(self.priority, int):
            raise ValueError(f"priority={self.priority!r} must be an integer.")
        self.eos_token_ids = tuple(self.eos_token_ids)
        params = self.sampling_params
        eos = () if params.ignore_eos else self.eos_token_ids
        # The ids that end it: EOS (unless ignore_eos) and its stop_token_ids. Read-only.
        self.stop_ids = frozenset(eos) | frozenset(params.stop_token_ids)
        # A grammar constrains its tokens: it is never planned while a token is pending, since
        # the step's mask depends on that token (an attribute: the planner reads it per row).
        self.constrained = params.structured_output is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt, outputs and pending outputs: the tokens the scheduler plans over."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Prompt and outputs whose values the host knows (what may be hashed or shown)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus the most outputs it may produce: what admission must be able to hold."""
        return len(self.prompt_token_ids) + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED  # status.is_finished, one call fewer

    @property
    def finish_reason(self) -> FinishReason | None:
        return _REASON_OF.get(self.status)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs, without building the whole list each step.

        Positions past the known tokens are pending outputs: PENDING_TOKEN, which the runner
        replaces on the device with the token the earlier step sampled.
        """
        known = len(self.prompt_token_ids) + len(self.output_token_ids)
        if end > known:
            return self.token_ids(start, known) + [PENDING_TOKEN] * (end - max(start, known))
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
