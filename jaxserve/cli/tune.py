"""`jaxserve tune`: the scheduling knobs with the most goodput for a traffic, found in the
simulator (jaxserve/bench/tuner.py); prints the best configurations and the `jaxserve serve`
line."""

from __future__ import annotations

import argparse
import sys

from jaxserve.cli import UserError
from jaxserve.cli.simulate import add_engine_args, add_traffic_args, engine_config, load_inputs


def register(sub) -> None:
    p = sub.add_parser(
        "tune",
        help="search scheduling knobs for goodput in the simulator",
        description="Simulates every combination of the lists below on the traffic and the cost "
        "model, ranks them by goodput under --ttft-slo/--tpot-slo, and prints the best with "
        "its predicted metrics and the `jaxserve serve` command line. The single-valued engine "
        "flags (--max-num-seqs, ...) are replaced by the lists searched.",
    )
    add_traffic_args(p)
    add_engine_args(p)
    g = p.add_argument_group("searched (comma-separated lists)")
    g.add_argument("--budgets", default=None, help="token budgets (default: the cost model's "
                   "buckets from 64 up)")  # fmt: skip
    g.add_argument("--seqs", default="16,32,64,128", help="max_num_seqs values")
    g.add_argument("--chunked", default="on,off", help="chunked prefill: on, off or on,off")
    g.add_argument("--policies", default="fcfs,priority")
    g.add_argument("--slo-aware", default="off,on", help="SLO-aware scheduling: on, off or both")
    g.add_argument("--shed", default="off", help="--shed-late (with SLO-aware): on, off or both")
    p.add_argument("--model", default=None, help="named in the printed serve command")
    p.add_argument("--top", type=int, default=5, help="configurations shown")
    p.set_defaults(func=_cmd_tune)


def _cmd_tune(args: argparse.Namespace) -> int:
    from jaxserve.bench import report
    from jaxserve.bench.metrics import SLO
    from jaxserve.bench.suite import _on_off, parse_list
    from jaxserve.bench.tuner import Grid, label, serve_command, tune

    workloads, max_model_len, cost = load_inputs(args)
    try:
        budgets = (
            parse_list(args.budgets, int)
            if args.budgets
            else [b for b in cost.key.token_buckets if b >= 64] or [max(cost.key.token_buckets)]
        )
        grid = Grid(
            max_num_batched_tokens=tuple(budgets),
            max_num_seqs=tuple(parse_list(args.seqs, int)),
            enable_chunked_prefill=tuple(
                _on_off(v, "--chunked") for v in parse_list(args.chunked, str)
            ),
            policy=tuple(parse_list(args.policies, str)),
            slo_scheduling=tuple(
                _on_off(v, "--slo-aware") for v in parse_list(args.slo_aware, str)
            ),
            shed_late=tuple(_on_off(v, "--shed") for v in parse_list(args.shed, str)),
        )
    except ValueError as e:
        raise UserError(str(e)) from e
    base = engine_config(args, max_model_len).replace(slo_scheduling=False, shed_late=False)
    slo = SLO(args.ttft_slo, args.tpot_slo)
    trials = tune(
        workloads,
        base,
        cost,
        slo,
        grid,
        max_model_len=max_model_len,
        seed=args.seed,
        log=lambda m: print(m, file=sys.stderr, flush=True),
    )
    shown = trials[: args.top]
    summaries = [
        dict(s, label=f"#{i + 1} {label(t.config)}")
        for i, t in enumerate(shown)
        for s in t.summaries
    ]
    print(report.format_table([report.sanitize(s) for s in summaries]))
    best = trials[0]
    print(
        f"\nBest of {len(trials)} for goodput (predicted {best.goodput:.2f} req/s, TTFT p50 "
        f"{best.ttft_p50 * 1e3:.0f} ms): {label(best.config)}"
    )
    print(serve_command(best.config, args.model))
    return 0
