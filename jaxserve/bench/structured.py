"""Structured output measured: constraint holds over many samples, and what grammar rows cost.

    python -m jaxserve.bench.structured --samples 200          # the acceptance's 200 samples
    python -m jaxserve.bench.structured --tpot --rows 32       # TPOT, half the batch constrained
    python -m jaxserve.bench.structured --step --rows 32       # the step with and without a mask

`--samples N`: N samples at temperature 1.0 per model (the embedded stories260k, and qwen3-tiny's
random weights with a byte-level BPE tokenizer) for each of a nested JSON schema, a regex and a
choice; counts outputs that finished, and fails loudly on any finished one that does not
validate / fullmatch / belong.

`--tpot`: the same engine runs three batches of `rows` decodes side by side, repeated and
interleaved: none constrained; half constrained (the other half unconstrained); all
constrained. It reports the TPOT of the unconstrained rows with and without constrained
neighbours, and that of the constrained rows, as ratios (the machine is noisy; docs/
benchmarks.md has the figures), and how many unconstrained rows came out identical in both
runs (all of them on the embedded model; on larger models a sampled row can differ, with or
without constraints, as the batch around it changes: docs/benchmarks.md). `--model NAME`
measures one other model instead, a folder or a named random shape.

`--step`: the device step alone, a decode batch of `rows` rows at temperature 0.8, as a batch
without grammar rows runs it (the mask branch skipped, the device-resident all-ones mask), as
one with grammar rows does (the branch taken, a mask shipped from the host), and the two parts
of the difference alone; interleaved, each first in turn (the first of a round runs slower on
this machine).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

# Nested objects, arrays with bounds, enums, integers with bounds, required and optional
# fields, patterns: what the acceptance asks a schema to have.
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {
            "type": "array",
            "items": {"enum": ["a", "b", "c"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "owner": {
            "type": "object",
            "properties": {
                "age": {"type": "integer", "minimum": 0, "maximum": 99},
                "city": {"type": "string", "pattern": "^[a-z]{2,5}$"},
            },
            "required": ["age"],
            "additionalProperties": False,
        },
        "score": {"type": "integer", "minimum": -5, "maximum": 5},
    },
    "required": ["id", "name", "kind", "owner"],
    "additionalProperties": False,
}
REGEX = r"(0|[1-9][0-9]{0,2})\.[0-9]{2} (EUR|USD)"
CHOICES = ("red", "green", "light blue", "dark")


def check_output(text: str):
    """The JSON value of an output (raises if it is not JSON)."""
    return json.loads(text)


def _engines(args):
    from checkpoints import load_model
    from checkpoints.byte_bpe import byte_bpe_tokenizer
    from jaxserve.engine.core import Engine
    from jaxserve.engine_config import EngineConfig

    config = dict(
        max_num_seqs=args.rows,
        max_num_batched_tokens=max(64, args.rows),
        min_token_bucket=16,
        seq_bucket_factor=4,
        show_progress=False,
        async_scheduling=not args.sync,
    )
    if args.model is not None:  # a model folder, or a named shape with a byte-level BPE
        model = load_model(args.model)
        if model.tokenizer is None:
            model.tokenizer = byte_bpe_tokenizer(model.config.vocab_size)
        yield args.model, Engine(EngineConfig(**config), model=model)
        return
    yield "stories260k", Engine(EngineConfig(**config))
    if not (args.tpot or args.step):
        model = load_model("qwen3-tiny")
        model.tokenizer = byte_bpe_tokenizer(model.config.vocab_size)
        yield "qwen3-tiny", Engine(EngineConfig(**config), model=model)


# Each constraint's spec and the output tokens its samples get (the bench's; enough to finish).
CONSTRAINTS = {
    "json": ({"json": NESTED_SCHEMA}, 160),
    "regex": ({"regex": REGEX}, 32),
    "choice": ({"choice": list(CHOICES)}, 16),
}


def finished_samples(llm, kind: str, n: int, max_tokens: int, validate=None) -> int:
    """n samples of one of CONSTRAINTS at temperature 1.0: how many finished, each checked
    (raises on one that breaks its constraint). `validate(value, schema)` checks the JSON;
    None: parsed only."""
    from jaxserve.sampling_params import SamplingParams

    spec = CONSTRAINTS[kind][0]
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured_output=spec)
        for i in range(n)
    ]
    done = [o for o in llm.generate(["Once upon a time"] * n, params) if o.finish_reason == "stop"]
    for o in done:
        if kind == "json":
            value = check_output(o.text)
            if validate is not None:
                validate(value, NESTED_SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, o.text), o.text
        else:
            assert o.text in CHOICES, o.text
    return len(done)


def samples(engine, n: int) -> dict:
    """n samples per constraint at temperature 1.0: how many finished, all checked."""
    import jsonschema

    from jaxserve.engine.llm import LLM

    llm = LLM(engine=engine)
    report = {}
    for kind, (_, max_tokens) in CONSTRAINTS.items():
        done = finished_samples(llm, kind, n, max_tokens, jsonschema.validate)
        report[kind] = f"{done}/{n} finished, all valid"
    return report


def tpot(engine, rows: int, repeats: int, max_tokens: int) -> dict:
    """Median TPOT (s) of unconstrained rows alone, beside constrained ones, and of the
    constrained rows, in interleaved runs of one engine."""
    from jaxserve.engine.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    llm = LLM(engine=engine)
    half = rows // 2
    free = [
        SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)
        for i in range(half)
    ]
    bound = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=0.8,
            seed=i,
            structured_output={"regex": f"[a-z ]{{{4 * max_tokens}}}"},
        )
        for i in range(half)
    ]
    prompts = ["Once upon a time"] * rows
    runs = {
        "none": free + [dataclass_copy(p, seed=p.seed + half) for p in free],
        "half": free + bound,
        "all": bound + [dataclass_copy(p, seed=p.seed + half) for p in bound],
    }
    times: dict[str, list[float]] = {"free_alone": [], "free_mixed": [], "bound": []}
    # The engine thread's mask work (grammar.py's sync and fill for each grammar row), timed
    # where the engine calls it.
    masks = [0.0, 0, 0]  # seconds, steps, rows
    fill = engine._token_mask

    def timed_fill(rows, seqs, num_seqs):
        start = time.perf_counter()
        mask = fill(rows, seqs, num_seqs)
        masks[0] += time.perf_counter() - start
        masks[1] += 1
        masks[2] += len(rows)
        return mask

    engine._token_mask = timed_fill
    reference = None
    same = [0, 0]  # unconstrained rows of the half run equal to the run without constraints
    for _ in range(repeats):
        for name, params in runs.items():
            outs = llm.generate(prompts, params)
            per_row = [_tpot(o) for o in outs]
            if name == "none":
                times["free_alone"].append(statistics.median(per_row[:half]))
                reference = reference or [o.token_ids for o in outs[:half]]
            elif name == "half":
                times["free_mixed"].append(statistics.median(per_row[:half]))
                pairs = zip(outs[:half], reference, strict=True)
                same[0] += sum(o.token_ids == r for o, r in pairs)
                same[1] += half
            else:
                times["bound"].append(statistics.median(per_row))
    engine._token_mask = fill
    med = {k: statistics.median(v) for k, v in times.items()}
    # Each round's two runs side by side: the ratio the machine's drift moves least.
    rounds = sorted(m / a for m, a in zip(times["free_mixed"], times["free_alone"], strict=True))
    return {
        "host us per grammar row per step (mask)": masks[0] / max(masks[2], 1) * 1e6,
        "host ms per step with grammar rows (mask)": masks[0] / max(masks[1], 1) * 1e3,
        "unconstrained TPOT, half the batch constrained / none": med["free_mixed"]
        / med["free_alone"],
        "the same, median of the rounds' ratios": statistics.median(rounds),
        "the same, rounds' quartiles": [rounds[len(rounds) // 4], rounds[3 * len(rounds) // 4]],
        "constrained TPOT / unconstrained TPOT (no constraint)": med["bound"] / med["free_alone"],
        "unconstrained TPOT ms (no constraint)": med["free_alone"] * 1e3,
        "unconstrained rows identical with and without the constrained half": f"{same[0]} of "
        f"{same[1]}",
    }


def step_times(engine, rows: int, repeats: int) -> dict:
    """Median ms per device step of one decode batch, with and without the mask branch."""
    import dataclasses

    import jax
    import numpy as np

    from jaxserve.models.step_batch import SeqChunk, pack_chunks
    from jaxserve.runtime.sampling import SamplingBatch

    runner = engine.runner
    rc = runner.config
    pages = -(-64 // rc.page_size)
    chunks = [SeqChunk([5], 60, [pages * i + j for j in range(pages)]) for i in range(rows)]
    num_tokens = next(t for t in rc.token_buckets if t >= rows)
    num_seqs = rc.seq_bucket_for(num_tokens)
    batch = pack_chunks(
        chunks,
        page_size=rc.page_size,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        pages_per_seq=rc.pages_per_seq,
        num_pages=rc.num_pages,
    )
    plain = dataclasses.replace(
        SamplingBatch.empty(num_seqs), temperature=np.full(num_seqs, 0.8, np.float32)
    )
    masked = dataclasses.replace(plain, constrained=np.bool_(True))
    host = np.full((num_seqs, runner.mask_words), -1, np.int32)
    device = runner.all_allowed(num_seqs)
    variants = {  # what a step without grammar rows runs first, then the parts of the other
        "no grammar row": lambda: runner.execute(batch, plain),
        "host mask, branch skipped": lambda: runner.execute(batch, plain, None, host.copy()),
        "device mask, branch taken": lambda: runner.execute(batch, masked, None, device),
        "host mask, branch taken": lambda: runner.execute(batch, masked, None, host.copy()),
    }
    times = {name: [] for name in variants}
    items = list(variants.items())
    for i in range(repeats):  # each variant first in turn: the first of a round runs slower
        for name, fn in items[i % len(items) :] + items[: i % len(items)]:
            jax.block_until_ready(fn().token_ids)
            start = time.perf_counter()
            for _ in range(20):
                out = fn()
            jax.block_until_ready(out.token_ids)
            times[name].append((time.perf_counter() - start) / 20 * 1e3)
    base = statistics.median(times["no grammar row"])
    return {"step ms, no grammar row": base} | {
        f"{name} / no grammar row": statistics.median(v) / base
        for name, v in times.items()
        if name != "no grammar row"
    }


def dataclass_copy(p, **changes):
    import dataclasses

    return dataclasses.replace(p, **changes)


def _tpot(out) -> float:
    """Seconds per output token after the first, from the output's timings."""
    m = out.metrics
    return (m.finished_time - m.first_token_time) / max(len(out.token_ids) - 1, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--tpot", action="store_true", help="measure TPOT instead of samples")
    parser.add_argument("--step", action="store_true", help="time the device step's mask path")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument(
        "--model",
        help="one model instead of the embedded one and qwen3-tiny: a folder, or a named "
        "random shape (given a byte-level BPE tokenizer of its vocabulary size)",
    )
    parser.add_argument(
        "--sync", action="store_true", help="without asynchronous scheduling (no plan skipped)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    for name, engine in _engines(args):
        start = time.perf_counter()
        if args.step:
            result = step_times(engine, args.rows, args.repeats)
        elif args.tpot:
            result = tpot(engine, args.rows, args.repeats, args.max_tokens)
        else:
            result = samples(engine, args.samples)
        print(name, f"({time.perf_counter() - start:.0f} s):", json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
