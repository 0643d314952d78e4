"""The host KV pool measured: swap-or-recompute preemption and the host tier of the prefix cache.

    python -m jaxserve.bench.offload --model smollm2-135m --out /tmp/offload.json

Two experiments on one device pool sized to a third of their working set, each run with and
without the host pool, engines built one after another in one process (like with like, as
ratios; docs/benchmarks.md):

- burst: N long generations submitted at once. Preemptions are forced; recompute drops the
  victims' KV and computes it again, auto swaps it out and back where the cost model prices that
  cheaper. Reported: prefill tokens computed again and end-to-end latency percentiles.
- chat: S sessions of T turns, each turn re-sending the session's whole history (the last
  prompt, a reply and a new message: tokens drawn at random, so the history grows by the turn's
  output length plus --grow) as soon as the last turn finished. The device pool holds about a
  third of the sessions' histories; the host tier keeps the rest. Reported: TTFT of returning
  turns (p50, p90), prefix hits by tier.

Outputs of each pair of runs are compared token for token (greedy): the host pool must not
change them.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def _offload(engine: Engine) -> dict[str, int]:
    return dict(engine.metrics.stats.kv_offload)


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def _pct(values, q) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def burst(engine: Engine, *, n: int, prompt_len: int, output_len: int, seed: int) -> dict:
    """N generations at once; returns e2e percentiles, recomputed tokens and the outputs."""
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    before, start = _offload(engine), time.monotonic()
    preempted = engine.metrics.stats.num_preemptions
    for i in range(n):
        engine.add_request(_ids(rng, prompt_len, vocab), params, request_id=f"b{i}")
    outs, tokens = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                outs[out.request_id] = out
    e2e = [o.metrics.finished_time - o.metrics.arrival_time for o in outs.values()]
    offload = _delta(_offload(engine), before)
    return dict(
        wall_s=time.monotonic() - start,
        e2e_p50_s=_pct(e2e, 50),
        e2e_p99_s=_pct(e2e, 99),
        preemptions=engine.metrics.stats.num_preemptions - preempted,
        swap_preemptions=offload.get("swap_preemptions", 0),
        recompute_preemptions=offload.get("recompute_preemptions", 0),
        recomputed_tokens=offload.get("recomputed_tokens", 0),
        pages_swapped_out=offload.get("pages_swapped_out", 0),
        outputs=dict(sorted(tokens.items())),
    )


def chat(
    engine: Engine,
    *,
    sessions: int,
    turns: int,
    first_len: int,
    grow: int,
    output_len: int,
    seed: int,
) -> dict:
    """Closed-loop chat sessions; returns TTFT of first and returning turns and hits by tier."""
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    history = {s: _ids(rng, first_len, vocab) for s in range(sessions)}
    turn = dict.fromkeys(range(sessions), 0)
    before, start = _offload(engine), time.monotonic()
    stats = engine.metrics.stats
    queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
    for s in range(sessions):
        engine.add_request(history[s], params, request_id=f"s{s}t0")
    ttft = {0: [], 1: []}  # first turns, returning turns
    outputs, longest = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if not out.finished:
                continue
            s, t = (int(x) for x in out.request_id[1:].split("t"))
            ttft[min(t, 1)].append(out.metrics.first_token_time - out.metrics.arrival_time)
            if t + 1 < turns:
                history[s] = history[s] + outputs[out.request_id] + _ids(rng, grow, vocab)
                longest = max(longest, len(history[s]))
                turn[s] = t + 1
                engine.add_request(history[s], params, request_id=f"s{s}t{t + 1}")
    offload = _delta(_offload(engine), before)
    queried = stats.prefix_cache_queries - queries
    return dict(
        wall_s=time.monotonic() - start,
        longest_history=longest,
        ttft_first_p50_s=_pct(ttft[0], 50),
        ttft_returning_p50_s=_pct(ttft[1], 50),
        ttft_returning_p90_s=_pct(ttft[1], 90),
        prefix_queried_tokens=queried,
        hit_rate=(stats.prefix_cache_hits - hits) / queried if queried else 0.0,
        device_hit_rate=offload.get("device_hits", 0) / queried if queried else 0.0,
        host_hit_rate=offload.get("host_hits", 0) / queried if queried else 0.0,
        pages_offloaded=offload.get("pages_offloaded", 0),
        outputs=dict(sorted(outputs.items())),
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--host-kv-gb", type=float, default=2.0)
    p.add_argument("--burst", type=int, default=15)
    p.add_argument("--burst-prompt", type=int, default=128)
    p.add_argument("--burst-output", type=int, default=384)
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=512)
    p.add_argument("--grow", type=int, default=240)
    p.add_argument("--chat-output", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None, help="default: a third of the work")
    p.add_argument("--only", choices=("burst", "chat"), default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    page = 16
    burst_pages = args.burst * -(-(args.burst_prompt + args.burst_output) // page)
    chat_len = args.first_len + (args.turns - 1) * (args.chat_output + args.grow)
    chat_pages = args.sessions * -(-chat_len // page)
    num_pages = args.num_pages or max(burst_pages, chat_pages) // 3
    base = dict(
        model=args.model,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        min_token_bucket=16,
        max_model_len=max(2048, chat_len + args.chat_output),
        num_pages=num_pages,
        page_size=page,
        show_progress=False,
    )
    runs = {
        "off": dict(host_kv_gb=0, preemption="recompute"),
        "on": dict(host_kv_gb=args.host_kv_gb, preemption="auto"),
    }
    report = dict(num_pages=num_pages, burst_pages=burst_pages, chat_pages=chat_pages, runs={})
    for name, extra in runs.items():
        start = time.monotonic()
        engine = Engine(EngineConfig(**base, **extra))
        row = dict(warm_up_s=time.monotonic() - start)
        if args.only in (None, "burst"):
            row["burst"] = burst(
                engine,
                n=args.burst,
                prompt_len=args.burst_prompt,
                output_len=args.burst_output,
                seed=1,
            )
        if args.only in (None, "chat"):
            row["chat"] = chat(
                engine,
                sessions=args.sessions,
                turns=args.turns,
                first_len=args.first_len,
                grow=args.grow,
                output_len=args.chat_output,
                seed=2,
            )
        row["compiles_after_warmup"] = engine.metrics.stats.compiles_after_warmup
        report["runs"][name] = row
        print(name, json.dumps({k: _brief(v) for k, v in row.items()}), flush=True)
        del engine
    for exp in ("burst", "chat"):
        if exp in report["runs"]["off"]:
            same = report["runs"]["off"][exp]["outputs"] == report["runs"]["on"][exp]["outputs"]
            report[f"{exp}_outputs_equal"] = same
            print(f"{exp}: outputs equal with and without the host pool: {same}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


def _brief(v):
    if isinstance(v, dict):
        return {k: x for k, x in v.items() if k != "outputs"}
    return v


if __name__ == "__main__":
    main()
