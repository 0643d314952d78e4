"""`jaxserve simulate`: a bench's traffic through the real scheduler on a measured cost model.

No JAX and no device: the step times come from a cost model file written by
`jaxserve bench --profile steps` (cost_model.json), so an hour of traffic takes seconds of CPU.
The traffic flags are `jaxserve bench`'s, and so is the table printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxserve.cli.common import GOODPUT_TARGETS, UserError
from jaxserve.engine_args import add_engine_args, engine_argv, engine_config_from_args

# How simulate and tune read the engine flags (tune replaces the knobs it searches).
SIMULATE_NOTE = (
    "The simulator reads the scheduling flags and --cost-model (required); the others shape an "
    "engine it does not build. Unless given here: --max-model-len is the longest request, "
    f"rounded up to a page; {' '.join(engine_argv(GOODPUT_TARGETS))} are the goodput targets."
)


def register(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="predict `jaxserve bench` metrics from a step-cost model, without a device",
        description="Replays a bench profile or trace through the real scheduler, advancing a "
        "virtual clock by each step's time predicted by --cost-model; prints the bench's table.",
    )
    add_traffic_args(p)
    add_engine_args(p, note=SIMULATE_NOTE)
    p.add_argument("--out", default=None, help="also write the summaries to this JSON file")
    p.set_defaults(func=_cmd_simulate)


def add_traffic_args(p: argparse.ArgumentParser) -> None:
    """The traffic flags, named as `jaxserve bench` names them."""
    t = p.add_argument_group("traffic (as jaxserve bench)")
    t.add_argument(
        "--profile",
        default="mixed",
        choices=["baseline", "concurrency", "mixed", "shared-prefix", "trace"],
    )
    t.add_argument("--trace", help="JSONL trace (with --profile trace)")
    t.add_argument("--rate", "--rates", dest="rates", default="4", help="requests/s (list)")
    t.add_argument("--num-requests", type=int, default=200)
    t.add_argument("--concurrency", default="1,2,4,8,16")
    t.add_argument("--prompt-len", type=int, default=64)
    t.add_argument("--output-len", type=int, default=32)
    t.add_argument("--prompt-range", default="32:128")
    t.add_argument("--output-range", default="16:64")
    t.add_argument("--long-share", type=float, default=0.3)
    t.add_argument("--burst", default=None)
    t.add_argument("--prefix-len", type=int, default=512)
    t.add_argument("--question-range", default="8:32")
    t.add_argument("--seed", type=int, default=0)


def load_inputs(args: argparse.Namespace):
    """(workloads, engine config, cost model) of the command line, or a UserError."""
    from jaxserve.bench.suite import build_workloads, needed_model_len
    from jaxserve.bench.workload import TraceError
    from jaxserve.scheduling.cost_model import CostModel, CostModelError

    try:
        workloads = build_workloads(args)
        defaults = dict(GOODPUT_TARGETS, max_model_len=needed_model_len(workloads))
        config = engine_config_from_args(args, defaults)
        if config.cost_model is None:
            raise UserError(
                "The simulator needs --cost-model FILE (`jaxserve bench --profile steps`)."
            )
        cost = CostModel.load(config.cost_model)
    except (TraceError, CostModelError) as e:
        raise UserError(str(e)) from e
    return workloads, config, cost


def _cmd_simulate(args: argparse.Namespace) -> int:
    from jaxserve.bench import report
    from jaxserve.bench.metrics import SLO, summarize
    from jaxserve.bench.simulator import simulate
    from jaxserve.bench.tuner import label as knobs

    workloads, config, cost = load_inputs(args)
    slo = SLO(config.ttft_slo_s, config.tpot_slo_s)
    label = f"{config.batching} {knobs(config)} (simulated)"
    summaries = [
        report.sanitize(summarize(simulate(w, config, cost, label=label, seed=args.seed), slo))
        for w in workloads
    ]
    print(report.format_table(summaries))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": " ".join(["jaxserve", *sys.argv[1:]]), "cost_model": config.cost_model}
        out.write_text(json.dumps({"meta": meta, "summaries": summaries}, indent=2) + "\n")
        print(f"Wrote {out}.")
    return 0
