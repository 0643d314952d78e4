"""Interleaved one-at-a-time TPOT behind docs/benchmarks.md, "Speculative decoding" (issue 31).

Three engines on the embedded model: plain, speculation with its decider, and speculation
forced (every step priced flat, so every proposal is verified). Each request runs on each
engine in turn, so a busy moment of the machine falls on all three alike. Run from the
repository root: `PYTHONPATH=. python docs/history/speculative_interleaved.py`; for another
model, `MODEL=path-or-name` (without a tokenizer the text workload is left out), with
`REQUESTS`, `TOKENS` and `ROUNDS` (6, 128, 2) to fit a slower model in the time there is.
"""

from __future__ import annotations

import os
import statistics

from jaxserve.bench.workload import fixed_length_workloads, random_prompt_ids, repetitive_workloads
from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams

TEXTS = [  # the embedded model falls into loops after these
    "Lily and Tom went to the park to play on the swings. " * 3,
    "Tom had a red ball",
    "He liked to play with his toys. He liked to play with his toys.",
    "Tim saw a big tree. " * 3,
    "Anna had a doll named Anna. " * 3,
    "Mom made a cake. " * 3,
]
MODEL = os.environ.get("MODEL")
REQUESTS = int(os.environ.get("REQUESTS", "6"))
TOKENS = int(os.environ.get("TOKENS", "128"))
ROUNDS = int(os.environ.get("ROUNDS", "2"))
PARAMS = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)


def tpot_of(engine: Engine, prompt):
    """One request alone on `engine`: its TPOT and its last output."""
    engine.add_request(prompt, PARAMS)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    last = next(o for o in outs if o.finished)
    return last.metrics.tpot(last.num_output_tokens), last


def main() -> None:
    model = {"model": MODEL} if MODEL else {}
    base = Engine(EngineConfig(show_progress=False, **model))
    spec = Engine(EngineConfig(speculative="ngram", show_progress=False, **model), model=base.model)
    forced = Engine(
        EngineConfig(speculative="ngram", show_progress=False, **model), model=base.model
    )
    forced.scheduler.set_step_cost(lambda spans: 1.0)
    d = spec.scheduler.spec
    print(
        f"priced: 1-row decode {1e3 * d.cost(1, 0, 1):.2f} ms, with a 5-token verification "
        f"{1e3 * d.cost(1, 1, 1):.2f} ms, breakeven {d.breakeven(1, 1, 1):.2f} tokens"
    )
    vocab = base.model.config.vocab_size
    rep = repetitive_workloads(num_requests=REQUESTS, prompt_len=48, max_tokens=TOKENS)[0]
    plain = fixed_length_workloads([1], num_requests=REQUESTS, prompt_len=64, max_tokens=TOKENS)[0]
    workloads = {
        "repetitive (bench profile)": [random_prompt_ids(s, vocab, 0) for s in rep.requests],
        "looping stories (text)": TEXTS if base.tokenizer is not None else None,
        "plain (random prompts)": [random_prompt_ids(s, vocab, 0) for s in plain.requests],
    }
    workloads = {name: prompts for name, prompts in workloads.items() if prompts is not None}
    engines = {"base": base, "spec": spec, "forced": forced}
    for name, prompts in workloads.items():
        tpots = {label: [] for label in engines}
        counts = {label: [0, 0, 0] for label in engines}  # proposed, accepted, verifications
        for _ in range(ROUNDS):
            for prompt in prompts:
                for label, engine in engines.items():
                    tpot, last = tpot_of(engine, prompt)
                    tpots[label].append(tpot)
                    c = counts[label]
                    c[0] += last.num_proposed_tokens
                    c[1] += last.num_accepted_tokens
                    c[2] += last.num_verifications
        b = statistics.median(tpots["base"])
        line = [f"{name}: TPOT p50 base {1e3 * b:.2f} ms"]
        for label in ("spec", "forced"):
            t = statistics.median(tpots[label])
            p, a, v = counts[label]
            line.append(
                f"{label} {1e3 * t:.2f} ms ({b / t:.2f}x better), accepted {a}/{p} in {v} "
                f"verifications"
            )
        print("; ".join(line), flush=True)


if __name__ == "__main__":
    main()
