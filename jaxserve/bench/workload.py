"""Benchmark traffic: built-in profiles and JSONL traces, turned into `Workload`s.

A `Workload` is one load level of one traffic shape: the requests with their arrival offsets
(open loop), or a concurrency to keep (closed loop). Everything random is drawn from a seeded
generator here, before any engine runs, so every configuration of a bench run receives exactly
the same requests at exactly the same offsets: only the scheduling changes between them.

Profiles:
- `baseline`: one request at a time (concurrency 1), fixed lengths: the single-stream reference.
- `concurrency`: fixed lengths, closed loop at each of rising concurrencies.
- `mixed`: short and long prompts, brief and extended outputs, Poisson arrivals at each rate,
  with an optional burst of extra requests arriving together.
- `shared-prefix`: every request starts with the same `prefix_len` tokens (a system prompt)
  followed by a short question of its own, Poisson arrivals at each rate: what the prefix cache
  is for.
- `repetitive`: one request at a time, each prompt a random passage said three times, so that
  a model that continues what it was given repeats it (an edit or a summary of given text is
  the everyday case): where speculative decoding's n-gram proposals pay.
- `trace`: a JSONL file, one request a line: `arrival_time` (s), one of `prompt` (text),
  `prompt_token_ids` or `prompt_len`, and `max_tokens`; `id` and `priority` are optional.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

PROFILES = ("baseline", "concurrency", "mixed", "shared-prefix", "repetitive", "trace")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestSpec:
    """One benchmark request: when it arrives and how long it is."""

    request_id: str
    arrival_s: float  # offset from the start of the run; unused by closed-loop workloads
    prompt_len: int  # tokens; for a text prompt, an estimate until it is tokenized
    max_tokens: int  # outputs run to exactly this length (EOS is ignored to hold lengths fixed)
    prompt: str | None = None  # text, tokenized by the engine
    prompt_token_ids: tuple[int, ...] | None = None  # None (and no text): random ids at run time
    priority: int = 0  # lower first, under the priority policy only
    # The first this many random prompt tokens are the run's shared prefix, the same in every
    # request that has one (random_prompt_ids); the rest are the request's own.
    shared_prefix_len: int = 0
    # Random prompts only: the prompt is its first ceil(prompt_len / repeats) tokens said again
    # and again (profile repetitive).
    repeats: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """One load level: the requests, and how they are offered."""

    name: str  # e.g. "mixed@4/s", used in tables and plot legends
    load: float  # offered requests/s (open loop; inf: all at once) or the concurrency
    load_kind: str  # "rate" or "concurrency"
    requests: tuple[RequestSpec, ...]

    @property
    def concurrency(self) -> int | None:
        """Outstanding requests a closed-loop workload keeps; None for open-loop arrivals."""
        return int(self.load) if self.load_kind == "concurrency" else None

    def describe(self) -> dict:
        lens = [r.prompt_len for r in self.requests]
        outs = [r.max_tokens for r in self.requests]
        return {
            "name": self.name,
            "load": _json_number(self.load),
            "load_kind": self.load_kind,
            "num_requests": len(self.requests),
            "prompt_len": [min(lens), max(lens)] if lens else None,
            "max_tokens": [min(outs), max(outs)] if outs else None,
            "output_tokens": sum(outs),
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Burst:
    """`count` extra requests arriving together `at_s` seconds into each open-loop run."""

    count: int
    at_s: float

    @classmethod
    def parse(cls, text: str) -> Burst:
        """'N@T': N requests at T seconds."""
        try:
            count, at = text.split("@")
            burst = cls(count=int(count), at_s=float(at))
        except ValueError:
            raise ValueError(f"--burst {text!r} must look like N@T, e.g. 16@2.5.") from None
        if burst.count < 1 or not math.isfinite(burst.at_s) or burst.at_s < 0:
            raise ValueError(f"--burst {text!r} needs N >= 1 and a finite T >= 0.")
        return burst


@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthMix:
    """A mixture of short and long prompts with brief and extended outputs.

    Prompt lengths split at the middle of `prompt_range`: a `long_share` of requests draws from
    the upper half, the rest from the lower; outputs likewise with `extended_share`. The two
    draws are independent, so all four kinds (short/brief, long/extended, ...) occur.
    """

    prompt_range: tuple[int, int] = (32, 128)
    output_range: tuple[int, int] = (16, 64)
    long_share: float = 0.3
    extended_share: float = 0.3

    def __post_init__(self):
        for name in ("prompt_range", "output_range"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}={(lo, hi)} must satisfy 1 <= low <= high.")
        for name in ("long_share", "extended_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1].")

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return (
            _split_draw(rng, self.prompt_range, self.long_share),
            _split_draw(rng, self.output_range, self.extended_share),
        )


def _split_draw(rng: random.Random, bounds: tuple[int, int], upper_share: float) -> int:
    lo, hi = bounds
    mid = (lo + hi) // 2
    if rng.random() < upper_share:
        return rng.randint(min(mid + 1, hi), hi)
    return rng.randint(lo, mid)


def fixed_length_workloads(
    concurrencies: Sequence[int], *, num_requests: int, prompt_len: int, max_tokens: int
) -> list[Workload]:
    """Closed loop at each concurrency, every request the same length (profiles baseline and
    concurrency): isolates what batching more streams costs and gains."""
    workloads = []
    for c in concurrencies:
        if c < 1:
            raise ValueError(f"Concurrency {c} must be >= 1.")
        specs = tuple(
            RequestSpec(
                request_id=f"c{c}-{i}", arrival_s=0.0, prompt_len=prompt_len, max_tokens=max_tokens
            )
            for i in range(num_requests)
        )
        workloads.append(
            Workload(name=f"concurrency {c}", load=c, load_kind="concurrency", requests=specs)
        )
    return workloads


def mixed_workloads(
    rates: Sequence[float],
    *,
    num_requests: int,
    mix: LengthMix,
    burst: Burst | None = None,
    seed: int = 0,
) -> list[Workload]:
    """Poisson arrivals at each rate (requests/s; inf sends all at t=0), lengths from `mix`.

    Each rate gets its own arrivals but the same sequence of lengths, so loads differ only in
    timing. A burst adds `burst.count` more requests, all arriving at `burst.at_s`.
    """
    lengths_rng = random.Random(seed)
    lengths = [mix.draw(lengths_rng) for _ in range(num_requests + (burst.count if burst else 0))]
    workloads = []
    for rate in rates:
        if not rate > 0:
            raise ValueError(f"Request rate {rate} must be > 0 (inf: all at once).")
        arrivals = poisson_arrivals(num_requests, rate, seed=seed + 1)
        if burst:
            arrivals += [burst.at_s] * burst.count
        specs = sorted(
            (
                # Priority = output length: the priority policy then runs brief requests first.
                RequestSpec(
                    request_id=f"r{_rate_tag(rate)}-{i}",
                    arrival_s=t,
                    prompt_len=p,
                    max_tokens=o,
                    priority=o,
                )
                for i, (t, (p, o)) in enumerate(zip(arrivals, lengths, strict=True))
            ),
            key=lambda s: s.arrival_s,
        )
        name = f"mixed@{_rate_tag(rate)}/s" + (f"+burst{burst.count}" if burst else "")
        workloads.append(Workload(name=name, load=rate, load_kind="rate", requests=tuple(specs)))
    return workloads


def shared_prefix_workloads(
    rates: Sequence[float],
    *,
    num_requests: int,
    prefix_len: int,
    question_range: tuple[int, int],
    max_tokens: int,
    seed: int = 0,
) -> list[Workload]:
    """Poisson arrivals at each rate of requests that share a `prefix_len`-token prefix and end
    in a question of their own, its length drawn from `question_range` (profile shared-prefix).

    Each rate gets the same question lengths, so loads differ only in timing.
    """
    lo, hi = question_range
    if prefix_len < 1 or not 1 <= lo <= hi or max_tokens < 1:
        raise ValueError(
            f"shared-prefix needs {prefix_len=} >= 1, question lengths 1 <= {lo} <= {hi} and "
            f"{max_tokens=} >= 1."
        )
    rng = random.Random(seed)
    questions = [rng.randint(lo, hi) for _ in range(num_requests)]
    workloads = []
    for rate in rates:
        if not rate > 0:
            raise ValueError(f"Request rate {rate} must be > 0 (inf: all at once).")
        arrivals = poisson_arrivals(num_requests, rate, seed=seed + 1)
        specs = tuple(
            RequestSpec(
                request_id=f"p{_rate_tag(rate)}-{i}",
                arrival_s=t,
                prompt_len=prefix_len + q,
                max_tokens=max_tokens,
                shared_prefix_len=prefix_len,
            )
            for i, (t, q) in enumerate(zip(arrivals, questions, strict=True))
        )
        name = f"shared-prefix{prefix_len}@{_rate_tag(rate)}/s"
        workloads.append(Workload(name=name, load=rate, load_kind="rate", requests=specs))
    return workloads


def repetitive_workloads(
    *, num_requests: int, prompt_len: int, max_tokens: int, repeats: int = 3
) -> list[Workload]:
    """One request at a time (concurrency 1), each prompt a random passage of its own said
    `repeats` times, `prompt_len` tokens in all (profile repetitive)."""
    if num_requests < 1 or max_tokens < 1 or not 1 <= repeats <= prompt_len:
        raise ValueError(
            f"repetitive needs {num_requests=} and {max_tokens=} >= 1 and 1 <= {repeats=} <= "
            f"{prompt_len=}."
        )
    specs = tuple(
        RequestSpec(
            request_id=f"rep-{i}",
            arrival_s=0.0,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            repeats=repeats,
        )
        for i in range(num_requests)
    )
    return [Workload(name="repetitive", load=1, load_kind="concurrency", requests=specs)]


def poisson_arrivals(n: int, rate: float, *, seed: int = 0) -> list[float]:
    """Arrival offsets (s) of a Poisson process: exponential gaps with mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)  # the first request arrives at once: runs start with traffic
        t += rng.expovariate(rate)
    return out


def _rate_tag(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _json_number(x: float) -> float | str:
    return "inf" if math.isinf(x) else x


class TraceError(ValueError):
    """A trace line that cannot be read; the message names the file and line."""


def load_trace(path: str | Path, *, name: str | None = None) -> Workload:
    """Reads a JSONL trace (see the module docstring) into one open-loop workload."""
    path = Path(path)
    specs: list[RequestSpec] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise TraceError(f"Cannot read trace {str(path)!r}: {e.strerror or e}.") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            specs.append(_trace_spec(json.loads(line), default_id=f"t{lineno}"))
        except (ValueError, TypeError) as e:
            raise TraceError(f"{path}:{lineno}: {e}") from None
    if not specs:
        raise TraceError(f"Trace {str(path)!r} has no requests.")
    ids = [s.request_id for s in specs]
    if len(set(ids)) != len(ids):
        raise TraceError(f"Trace {str(path)!r} repeats request ids.")
    specs.sort(key=lambda s: s.arrival_s)
    span = specs[-1].arrival_s
    rate = len(specs) / span if span > 0 else math.inf
    return Workload(
        name=name or f"trace:{path.name}", load=rate, load_kind="rate", requests=tuple(specs)
    )


def _trace_spec(obj: object, *, default_id: str) -> RequestSpec:
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    arrival = obj.get("arrival_time", 0.0)
    max_tokens = obj.get("max_tokens")
    priority = obj.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority={priority!r} must be an integer")
    if not isinstance(arrival, int | float) or not math.isfinite(arrival) or arrival < 0:
        raise ValueError(f"arrival_time={arrival!r} must be a finite number >= 0")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} must be an integer >= 1")
    given = [k for k in ("prompt", "prompt_token_ids", "prompt_len") if k in obj]
    if len(given) != 1:
        raise ValueError("give exactly one of prompt, prompt_token_ids, prompt_len")
    prompt, ids, length = obj.get("prompt"), obj.get("prompt_token_ids"), obj.get("prompt_len")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError("prompt must be a non-empty string")
    if ids is not None:
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        ):
            raise ValueError("prompt_token_ids must be a non-empty list of integers >= 0")
        length = len(ids)
    if prompt is not None:
        length = max(1, len(prompt) // 4)  # a rough estimate; the engine counts real tokens
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"prompt_len={length!r} must be an integer >= 1")
    return RequestSpec(
        request_id=str(obj.get("id", default_id)),
        arrival_s=float(arrival),
        prompt_len=length,
        max_tokens=max_tokens,
        prompt=prompt,
        prompt_token_ids=tuple(ids) if ids is not None else None,
        priority=priority,
    )


def random_prompt_ids(spec: RequestSpec, vocab_size: int, seed: int = 0) -> list[int]:
    """The prompt ids of a length-only spec: random but fixed by (seed, request id), so every
    configuration runs the very same tokens; its first `shared_prefix_len` are fixed by the seed
    alone, the same in every request. Ids below 3 are avoided (BOS/EOS/pad on most
    vocabularies)."""
    low = 3 if vocab_size > 3 else 0
    shared = random.Random(f"{seed}:shared-prefix")
    own = random.Random(f"{seed}:{spec.request_id}")
    n = min(spec.shared_prefix_len, spec.prompt_len)
    prefix = [shared.randrange(low, vocab_size) for _ in range(n)]
    if spec.repeats > 1:  # a passage said again and again
        passage = [
            own.randrange(low, vocab_size) for _ in range(-(-spec.prompt_len // spec.repeats))
        ]
        return (prefix + passage * spec.repeats)[: spec.prompt_len]
    return prefix + [own.randrange(low, vocab_size) for _ in range(spec.prompt_len - n)]
