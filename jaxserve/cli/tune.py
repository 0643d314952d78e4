"""`jaxserve tune`: the scheduling knobs with the most goodput for a traffic, found in the
simulator (jaxserve/bench/tuner.py); prints the best configurations and the `jaxserve serve`
line."""

from __future__ import annotations

import argparse
import sys

from jaxserve.cli.common import UserError
from jaxserve.cli.simulate import SIMULATE_NOTE, add_traffic_args, load_inputs
from jaxserve.engine_args import add_engine_args, on_off


def register(sub) -> None:
    p = sub.add_parser(
        "tune",
        help="search scheduling knobs for goodput in the simulator",
        description="Simulates every combination of the lists below on the traffic and the cost "
        "model, ranks them by goodput under --ttft-slo-s/--tpot-slo-s, and prints the best with "
        "its predicted metrics and the `jaxserve serve` command line. The engine flags of the "
        "knobs searched (--max-num-batched-tokens, --max-num-seqs, --enable-chunked-prefill, "
        "--policy, --slo-scheduling, --shed-late) are replaced by the lists searched.",
    )
    add_traffic_args(p)
    add_engine_args(p, note=SIMULATE_NOTE)
    g = p.add_argument_group("searched (comma-separated lists)")
    g.add_argument("--budgets", default=None, help="token budgets (default: the cost model's "
                   "buckets from 64 up)")  # fmt: skip
    g.add_argument("--seqs", default="16,32,64,128", help="max_num_seqs values")
    g.add_argument("--chunked", default="on,off", help="chunked prefill: on, off or on,off")
    g.add_argument("--policies", default="fcfs,priority")
    g.add_argument("--slo-aware", default="off,on", help="SLO-aware scheduling: on, off or both")
    g.add_argument("--shed", default="off", help="--shed-late (with SLO-aware): on, off or both")
    p.add_argument("--top", type=int, default=5, help="configurations shown")
    p.set_defaults(func=_cmd_tune)


def _cmd_tune(args: argparse.Namespace) -> int:
    from jaxserve.bench import report
    from jaxserve.bench.metrics import SLO
    from jaxserve.bench.suite import parse_list
    from jaxserve.bench.tuner import Grid, label, serve_command, tune

    workloads, base, cost = load_inputs(args)
    try:
        budgets = (
            parse_list(args.budgets, int)
            if args.budgets
            else [b for b in cost.key.token_buckets if b >= 64] or [max(cost.key.token_buckets)]
        )
        grid = Grid(
            max_num_batched_tokens=tuple(budgets),
            max_num_seqs=tuple(parse_list(args.seqs, int)),
            enable_chunked_prefill=_on_offs(args.chunked, "--chunked"),
            policy=tuple(parse_list(args.policies, str)),
            slo_scheduling=_on_offs(args.slo_aware, "--slo-aware"),
            shed_late=_on_offs(args.shed, "--shed"),
        )
    except ValueError as e:
        raise UserError(str(e)) from e
    # The grid sets the knobs it searches; shedding without SLO-aware scheduling is invalid.
    base = base.replace(slo_scheduling=False, shed_late=False)
    slo = SLO(base.ttft_slo_s, base.tpot_slo_s)
    trials = tune(
        workloads,
        base,
        cost,
        slo,
        grid,
        max_model_len=base.max_model_len,
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
    print(serve_command(best.config, base.model))
    return 0


def _on_offs(text: str, flag: str) -> tuple[bool, ...]:
    from jaxserve.bench.suite import parse_list

    try:
        return tuple(on_off(v) for v in parse_list(text, str))
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
