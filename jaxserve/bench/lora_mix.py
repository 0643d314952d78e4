"""What serving many LoRA adapters in one batch costs: a burst of requests on the base model
alone against the same burst with every request on one of several adapters, side by side.

    python -m jaxserve.bench.lora_mix --model smollm2-135m --burst 64 --adapters 4 --rank 16

Two engines over one copy of the weights: the base engine (no adapter slots: the plain step)
and one with `--adapters` slots, each holding a random adapter of rank `--rank` on all seven
projections (random, since only the cost is measured here; tests/models/test_lora_parity.py
checks the numbers against peft). Each round sends the same burst (prompts of 32-128 tokens,
outputs of 16-64, greedy, seeded like ../shared/peers' workload) to one engine and then the
other, the adapters assigned round-robin; output tokens/s is the burst's output tokens over the
time from its first request to its last token. Rounds alternate the engines so that the shared
machine's drift falls on both. Prints one JSON line per round and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from checkpoints import load_model
from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.models.lora import LoraAdapter, module_shapes
from jaxserve.sampling_params import SamplingParams


def random_adapter(name: str, config, rank: int, seed: int) -> LoraAdapter:
    """A rank-`rank` adapter on every projection, scaled like a trained one (small updates)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for module, (n_in, n_out) in module_shapes(config).items():
        a = rng.normal(0, n_in**-0.5, (config.num_layers, n_in, rank)).astype(np.float32)
        b = rng.normal(0, 0.02, (config.num_layers, rank, n_out)).astype(np.float32)
        weights[module] = (a, b)
    return LoraAdapter(name=name, rank=rank, weights=weights, source=f"random-{seed}")


def burst(n: int, vocab: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """`n` requests: prompts of 32-128 random tokens, 16-64 greedy output tokens each."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = rng.integers(3, vocab, int(rng.integers(32, 129))).tolist()
        params = SamplingParams(
            max_tokens=int(rng.integers(16, 65)), temperature=0.0, ignore_eos=True
        )
        out.append((prompt, params))
    return out


def run_burst(engine: Engine, requests, loras) -> float:
    """Output tokens/s of `requests` sent at once (each with its adapter in `loras`)."""
    llm = LLM(engine=engine)
    start = time.perf_counter()
    done = llm.generate([p for p, _ in requests], [s for _, s in requests], lora=loras)
    seconds = time.perf_counter() - start
    return sum(len(c.token_ids) for c in done) / seconds


def compare_kernels(model: str, adapters: int, rank: int, rounds: int = 15) -> None:
    """The update's ways (models/lora.py) on one decoder layer of `model`'s shape, interleaved:
    the seven projections alone, with the dense update, with the gathered one; and the update
    alone, dense against grouped by adapter with `jax.lax.ragged_dot` (sort, two ragged dots,
    unsort). Medians in ms, one JSON line per token count."""
    import jax
    import jax.numpy as jnp

    from checkpoints import NAMED_SHAPES
    from jaxserve.models.lora import empty_slots, lora_delta

    config = NAMED_SHAPES[model].replace(num_layers=1)
    rng = np.random.default_rng(0)
    slots = empty_slots(config, adapters, rank, jnp.float32, "unrolled")["layers_0"]
    slots = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.01, a.shape), jnp.float32), slots)
    shapes = module_shapes(config)
    weights = {m: jnp.asarray(rng.normal(size=s), jnp.float32) for m, s in shapes.items()}
    # ragged_dot's groups lead its right operand: [M + 1, in, R] with slot 0's zeros first.
    grouped_a = {
        m: jnp.concatenate([jnp.zeros((1, i, rank)), jnp.transpose(slots[m]["a"], (1, 0, 2))])
        for m, (i, _) in shapes.items()
    }
    grouped_b = {
        m: jnp.concatenate([jnp.zeros_like(slots[m]["b"][:1]), slots[m]["b"]]) for m in shapes
    }

    def grouped(m, x, tok):
        order = jnp.argsort(tok)
        sizes = jnp.bincount(tok, length=adapters + 1).astype(jnp.int32)
        h = jax.lax.ragged_dot(x[order], grouped_a[m], sizes, precision="highest")
        y = jax.lax.ragged_dot(h, grouped_b[m], sizes, precision="highest")
        return jnp.zeros_like(y).at[order].set(y)

    def variant(base: bool, kernel: str | None):
        def run(xs, tok):
            total = 0.0
            for m in shapes:
                y = jnp.dot(xs[m], weights[m], precision="highest") if base else 0.0
                if kernel == "grouped":
                    y = y + grouped(m, xs[m], tok)
                elif kernel is not None:
                    y = y + lora_delta(slots, m, jnp.int32(0), xs[m], tok, kernel)
                total = total + jnp.sum(y)
            return total

        return jax.jit(run)

    fns = {
        "projections": variant(True, None),
        "with_dense": variant(True, "dense"),
        "with_gather": variant(True, "gather"),
        "dense_alone": variant(False, "dense"),
        "grouped_alone": variant(False, "grouped"),
    }
    for tokens in (64, 512):
        xs = {
            m: jnp.asarray(rng.normal(size=(tokens, i)), jnp.float32)
            for m, (i, _) in shapes.items()
        }
        tok = jnp.asarray(rng.integers(0, adapters + 1, tokens), jnp.int32)
        times = {k: [] for k in fns}
        for f in fns.values():
            f(xs, tok).block_until_ready()
        for _ in range(rounds):
            for k, f in fns.items():
                start = time.perf_counter()
                f(xs, tok).block_until_ready()
                times[k].append(time.perf_counter() - start)
        ms = {k: round(1e3 * statistics.median(v), 2) for k, v in times.items()}
        print(json.dumps({"tokens": tokens, "median_ms": ms}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--min-token-bucket", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--kernels", action="store_true", help="compare the update's ways on one layer instead"
    )
    args = ap.parse_args(argv)
    if args.kernels:
        compare_kernels(args.model, args.adapters, args.rank)
        return 0

    model = load_model(args.model, dtype="float32", seed=args.seed)
    shapes = dict(
        max_num_seqs=args.max_num_seqs,
        min_token_bucket=args.min_token_bucket,
        show_progress=False,
        dtype="float32",
        # Every round sends the same prompts: a cache would serve the later rounds' prefills.
        enable_prefix_caching=False,
    )
    engines = {"base": Engine(EngineConfig(**shapes), model=model)}
    lora = Engine(
        EngineConfig(**shapes, max_loras=args.adapters, max_lora_rank=args.rank), model=model
    )
    names = [f"adapter{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        lora.add_lora(name, random_adapter(name, model.config, args.rank, seed=100 + i))
    engines["lora"] = lora
    requests = burst(args.burst, model.config.vocab_size, args.seed)
    loras = {"base": None, "lora": [names[i % len(names)] for i in range(len(requests))]}
    # A short warm burst on each: first-run costs (branch set-up, allocations) fall outside.
    for key, engine in engines.items():
        run_burst(engine, requests[:4], None if loras[key] is None else loras[key][:4])
    rates: dict[str, list[float]] = {"base": [], "lora": []}
    for r in range(args.rounds):
        order = ("base", "lora") if r % 2 == 0 else ("lora", "base")
        for key in order:
            rate = run_burst(engines[key], requests, loras[key])
            rates[key].append(rate)
            print(json.dumps({"round": r, "engine": key, "output_tok_s": round(rate, 1)}))
    for engine in engines.values():
        engine.step()  # nothing to run: the gauges refresh
    ratio = statistics.median(rates["lora"]) / statistics.median(rates["base"])
    summary = {
        "model": args.model,
        "burst": args.burst,
        "adapters": args.adapters,
        "rank": args.rank,
        "base_output_tok_s": [round(x, 1) for x in rates["base"]],
        "lora_output_tok_s": [round(x, 1) for x in rates["lora"]],
        "lora_over_base": round(ratio, 3),
        "lora_slot_loads": lora.scheduler.lora_slots.num_loads,
        "compiles_after_warmup": {
            k: e.metrics.stats.compiles_after_warmup for k, e in engines.items()
        },
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
