"""`python -m jaxserve.bench.forking`: beam search and n > 1 sampling, the two workloads that fork
one sequence into several, timed on one engine.

Both fork a prompt: every beam of a search is a request whose prompt extends its parent's, and the
n samples of a prompt are n requests with the same prompt. The prefix cache shares their full
pages; what each computes beyond that (the partial page, unless it is copied: issue 47, item 4)
is what this measures, as wall time and as tokens the model ran (EngineStats.real_tokens).

Each case runs once to warm up (nothing is compiled then: every step shape is compiled at start),
then `--rounds` times; the report is one JSON line per case with every round's seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from jaxserve.engine.build import build_engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams


def _prompts(vocab: int, count: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def _timed(llm: LLM, run) -> dict:
    """Seconds, steps and model tokens of one call of `run`."""
    stats = llm.engine.metrics.stats
    steps, tokens, padded = stats.num_steps, stats.real_tokens, stats.padded_tokens
    start = time.perf_counter()
    out = run()
    return {
        "seconds": time.perf_counter() - start,
        "steps": stats.num_steps - steps,
        "model_tokens": stats.real_tokens - tokens,
        "padded_tokens": stats.padded_tokens - padded,
        "outputs": out,
    }


def main(argv: list[str] | None = None) -> int:
    """Runs the cases and prints one JSON line each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder or named shape (default: embedded)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per case")
    ap.add_argument("--min-len", type=int, default=24)
    ap.add_argument("--max-len", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", default="beam,n", help="comma-separated: beam, n")
    args = ap.parse_args(argv)
    config = EngineConfig(model=args.model) if args.model else EngineConfig()
    llm = LLM(engine=build_engine(config))
    vocab = llm.engine.model.config.vocab_size
    rounds_run = [0]  # new prompts every round: the cache must not serve a round's full pages

    def next_prompts() -> list[list[int]]:
        rounds_run[0] += 1
        seed = args.seed * 1000 + rounds_run[0]
        return _prompts(vocab, args.prompts, (args.min_len, args.max_len), seed)

    def beam():
        prompts = next_prompts()
        return llm.beam_search(
            prompts, beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=True
        )

    def n_samples():
        prompts = next_prompts()
        params = [
            SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
            for _ in prompts
            for i in range(args.n)
        ]
        return llm.generate([p for p in prompts for _ in range(args.n)], params)

    cases = {"beam": beam, "n": n_samples}
    for name in args.cases.split(","):
        run = cases[name]
        _timed(llm, run)  # warm-up round
        rounds = [_timed(llm, run) for _ in range(args.rounds)]
        first = rounds[0]
        print(
            json.dumps(
                {
                    "case": name,
                    "model": args.model or "embedded",
                    "prompts": args.prompts,
                    "beam_width" if name == "beam" else "n": (
                        args.beam_width if name == "beam" else args.n
                    ),
                    "max_tokens": args.max_tokens,
                    "seconds": [round(r["seconds"], 3) for r in rounds],
                    "steps": first["steps"],
                    "model_tokens": first["model_tokens"],
                    "padded_tokens": first["padded_tokens"],
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
