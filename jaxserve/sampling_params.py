"""How one request wants its tokens chosen and when it wants to stop.

`SamplingParams` is frozen and validated here, at submission, so a bad value is refused with a
message naming the field before it can reach the device: the runner turns these values into
per-row arrays and never checks them again. Plain Python, no jax: the scheduler reads it too.
"""

from __future__ import annotations

import dataclasses

from jaxserve.structured_output import StructuredOutput

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 16
MAX_LOGIT_BIAS = 32  # biased tokens per request (a fixed number of slots per row on the device)
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it
MAX_ABS_PENALTY = 2.0  # OpenAI's range of presence_penalty and frequency_penalty
MAX_REPETITION_PENALTY = 10.0  # well past any useful value; bounds the division's blow-up
# ... and its reciprocal below: 1e-300 passed (0, 10] but is 0 in float32, and the device's
# division by it made every logit inf or NaN (the output was token 0 over and over).
MIN_REPETITION_PENALTY = 1 / MAX_REPETITION_PENALTY
# Temperature is 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]. The device multiplies the
# logits by 1 / temperature in float32: 1e-300 is 0 there, 1e300 is inf (the row's logits become
# inf - inf = NaN); at 1e-5 a logit of 1000 stays far inside float32, and past 100 every real
# model's distribution is flat to a few parts in a thousand, so nothing useful is refused.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
# Token ids and top_k go to the device as int32: 2**31 raised OverflowError on the engine thread.
MAX_INT32 = 2**31 - 1
MAX_TOP_K = MAX_INT32  # any value from the vocabulary's size up turns top-k off, as 0 does
# Beams are ranked by logprob / length ** length_penalty in Python floats: 1000 overflowed (and
# -1e300 divided by zero) once a beam had two tokens. At 10 a 131072-token beam is 1.5e51.
MAX_ABS_LENGTH_PENALTY = 10.0
SEED_LIMIT = 2**32  # seeds become uint32 PRNG key data on the device
# Each beam asks the engine for its 2 * beam_width most likely next tokens, as logprobs, and
# the engine returns at most MAX_LOGPROBS of them.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


# logprobs_mode's accepted spellings (jaxserve's and vLLM's) -> the one stored.
_LOGPROBS_MODES = {
    "raw": "raw",
    "processed": "processed",
    "raw_logprobs": "raw",
    "processed_logprobs": "processed",
}


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `top_k=True` is a mistake, not a number.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling and stopping options (the vLLM/OpenAI names and meanings)."""

    max_tokens: int = 16  # output tokens at most
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 turns top-k off
    top_p: float = 1.0  # 1 turns top-p off
    min_p: float = 0.0  # 0 turns min-p off
    seed: int | None = None  # None: the engine draws one, so outputs differ between runs
    stop: tuple[str, ...] = ()  # stop strings, matched by the engine on the detokenized text
    stop_token_ids: tuple[int, ...] = ()  # stop even when ignore_eos is set
    ignore_eos: bool = False  # keep going past the model's end-of-sequence tokens
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: also the top n
    # Which distribution those logprobs are of: "raw", the model's after logit_bias, penalties
    # and a grammar's mask, before the temperature and filters (OpenAI's meaning); "processed",
    # the one the token is drawn from: tempered, top-k/top-p/min-p applied, filtered tokens
    # excluded (vLLM's processed_logprobs). vLLM's names "raw_logprobs" and
    # "processed_logprobs" are accepted too.
    logprobs_mode: str = "raw"
    # The same for every prompt token after the first (the first has none): the model's
    # log-probability of it given the tokens before, and the top n. Such a request computes its
    # whole prompt (no prefix-cache hit), since a cached token's logits are never made.
    prompt_logprobs: int | None = None
    # Added to the token's logit before sampling (and before the logprobs), {token id: bias}.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    # Penalties over the tokens generated so far (sampling.py has the formula): subtract
    # presence_penalty once from every token already generated, frequency_penalty per time.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Over prompt and generated tokens: positive logits divided by it, negative ones multiplied.
    repetition_penalty: float = 1.0
    # Beam search (jaxserve/engine/beam_search.py) when > 1: the output is the best of beam_width
    # beams,
    # ranked by cumulative logprob / (generated tokens ** length_penalty).
    beam_width: int = 1
    length_penalty: float = 1.0
    # The output must match this (a JSON schema, a regex, a choice, a grammar): each step's
    # logits are masked to the tokens that keep it matchable, and EOS is allowed only where it
    # is complete (jaxserve/structured_output.py; a dict is vLLM's `structured_outputs`).
    structured_output: StructuredOutput | None = None

    def __post_init__(self):
        # Lists are accepted for convenience but stored as tuples, so params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        if isinstance(bias, dict):  # OpenAI's shape; stored sorted so that params stay hashable
            bias = sorted(bias.items())
        object.__setattr__(self, "logit_bias", tuple((t, v) for t, v in bias))
        mode = (
            _LOGPROBS_MODES.get(self.logprobs_mode) if isinstance(self.logprobs_mode, str) else None
        )
        if mode is None:
            raise ValueError(
                f"logprobs_mode={self.logprobs_mode!r} must be one of "
                f"{sorted(set(_LOGPROBS_MODES))}."
            )
        object.__setattr__(self, "logprobs_mode", mode)
        self._check_numbers()
        self._check_stops()
        self._check_beam()
        self._check_structured()
        penalized = self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
        object.__setattr__(self, "_has_penalties", bool(penalized))

    def _check_numbers(self) -> None:
        max_tokens, temperature, top_k = self.max_tokens, self.temperature, self.top_k
        top_p, min_p, seed, logprobs = self.top_p, self.min_p, self.seed, self.logprobs
        if not _is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"{max_tokens=} must be an integer >= 1.")
        if not _is_real(temperature) or not (
            temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE
        ):
            raise ValueError(
                f"{temperature=} must be 0 (greedy) or a number in [{MIN_TEMPERATURE}, "
                f"{MAX_TEMPERATURE}]."
            )
        if not _is_int(top_k) or not 0 <= top_k <= MAX_TOP_K:
            raise ValueError(
                f"{top_k=} must be an integer in [0, {MAX_TOP_K}] (0 turns top-k off, as does "
                "any value from the vocabulary's size up)."
            )
        if not _is_real(top_p) or not 0 < top_p <= 1:
            raise ValueError(f"{top_p=} must be in (0, 1] (1 turns top-p off).")
        if not _is_real(min_p) or not 0 <= min_p <= 1:
            raise ValueError(f"{min_p=} must be in [0, 1] (0 turns min-p off).")
        if seed is not None and (not _is_int(seed) or not 0 <= seed < SEED_LIMIT):
            raise ValueError(f"{seed=} must be None or an integer in [0, {SEED_LIMIT}).")
        if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
            raise ValueError(f"{logprobs=} must be None or an integer in [0, {MAX_LOGPROBS}].")
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None and (
            not _is_int(prompt_logprobs) or not 0 <= prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"{prompt_logprobs=} must be None or an integer in [0, {MAX_LOGPROBS}]."
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be True or False.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(
                    f"{name}={value!r} must be a number in [{-MAX_ABS_PENALTY}, "
                    f"{MAX_ABS_PENALTY}] (0 turns it off)."
                )
        repetition_penalty = self.repetition_penalty
        if not _is_real(repetition_penalty) or not (
            MIN_REPETITION_PENALTY <= repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise ValueError(
                f"{repetition_penalty=} must be a number in [{MIN_REPETITION_PENALTY}, "
                f"{MAX_REPETITION_PENALTY}] (1 turns it off)."
            )
        min_tokens = self.min_tokens
        if not _is_int(min_tokens) or not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"{min_tokens=} must be an integer in [0, max_tokens={max_tokens}].")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias has {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS} allowed."
            )
        for t, v in self.logit_bias:
            if not _is_int(t) or not 0 <= t <= MAX_INT32:
                raise ValueError(
                    f"logit_bias token {t!r} must be a token id (an integer in [0, {MAX_INT32}])."
                )
            if not _is_real(v) or not -MAX_ABS_LOGIT_BIAS <= v <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias[{t}]={v!r} must be a number in "
                    f"[{-MAX_ABS_LOGIT_BIAS}, {MAX_ABS_LOGIT_BIAS}]."
                )

    def _check_stops(self) -> None:
        stop, stop_token_ids = self.stop, self.stop_token_ids
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(stop)} stop strings given; at most {MAX_STOP_STRINGS} allowed.")
        for s in stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"Stop string {s!r} must be a non-empty str of at most "
                    f"{MAX_STOP_STRING_CHARS} characters."
                )
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"{len(stop_token_ids)} stop token ids given; at most {MAX_STOP_TOKEN_IDS} allowed."
            )
        for t in stop_token_ids:
            if not _is_int(t) or not 0 <= t <= MAX_INT32:
                raise ValueError(
                    f"{stop_token_ids=} must hold token ids (integers in [0, {MAX_INT32}]); "
                    f"{t!r} is not."
                )

    def _check_beam(self) -> None:
        beam_width, length_penalty = self.beam_width, self.length_penalty
        if not _is_int(beam_width) or not 1 <= beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(
                f"{beam_width=} must be an integer in [1, {MAX_BEAM_WIDTH}] (1 turns beam search "
                "off)."
            )
        if not _is_real(length_penalty) or not abs(length_penalty) <= MAX_ABS_LENGTH_PENALTY:
            raise ValueError(
                f"{length_penalty=} must be a number in [{-MAX_ABS_LENGTH_PENALTY}, "
                f"{MAX_ABS_LENGTH_PENALTY}]."
            )
        if beam_width == 1:
            return
        # The search ranks beams by the model's own logprobs (temperature 1) and is
        # deterministic: 1 (the default) and 0 both name that; anything else would be ignored.
        conflicts = {
            "temperature": self.temperature not in (0, 1),
            "top_k": self.top_k != 0,
            "top_p": self.top_p != 1,
            "min_p": self.min_p != 0,
            "stop": bool(self.stop),
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "logit_bias": bool(self.logit_bias),
            "min_tokens": self.min_tokens != 0,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "repetition_penalty": self.repetition_penalty != 1,
        }
        bad = [f"{name}={getattr(self, name)!r}" for name, on in conflicts.items() if on]
        if bad:
            raise ValueError(
                f"{beam_width=} (beam search) cannot be combined with {', '.join(bad)}: the "
                "search is deterministic over the model's logprobs (temperature 0 or 1, no "
                "filters, penalties, bias, min_tokens, stop strings or logprobs)."
            )

    def _check_structured(self) -> None:
        spec = self.structured_output
        if isinstance(spec, dict):
            spec = StructuredOutput.from_dict(spec)
            object.__setattr__(self, "structured_output", spec)
        if spec is None:
            return
        if not isinstance(spec, StructuredOutput):
            raise ValueError(
                f"structured_output={spec!r} must be a StructuredOutput, a dict of one, or None."
            )
        # The grammar decides when the output may end: EOS is allowed exactly when it is
        # complete. Options that move the end elsewhere would contradict it.
        conflicts = {
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens != 0,
            "beam_width": self.beam_width != 1,
        }
        bad = [f"{name}={getattr(self, name)!r}" for name, on in conflicts.items() if on]
        if bad:
            raise ValueError(
                f"A structured output ({spec.kind}) cannot be combined with {', '.join(bad)}: "
                "the grammar alone decides where the output may end."
            )

    @property
    def constrained(self) -> bool:
        """Whether each step's token is masked by a grammar (structured_output is set)."""
        return self.structured_output is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the request's token counts on the device (read per row per
        step, so worked out once in __post_init__)."""
        return self._has_penalties
