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

from jaxserve.cli import UserError


def register(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="predict `jaxserve bench` metrics from a step-cost model, without a device",
        description="Replays a bench profile or trace through the real scheduler, advancing a "
        "virtual clock by each step's time predicted by --cost-model; prints the bench's table.",
    )
    add_traffic_args(p)
    add_engine_args(p)
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
    t.add_argument("--max-model-len", type=int, default=None, help="default: the longest request")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The cost model, the SLO and the engine knobs that shape scheduling."""
    e = p.add_argument_group("engine")
    e.add_argument(
        "--cost-model",
        required=True,
        metavar="FILE",
        help="cost_model.json from `jaxserve bench --profile steps`",
    )
    e.add_argument("--ttft-slo", type=float, default=1.0, help="TTFT target, seconds")
    e.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT target, seconds")
    e.add_argument("--max-num-seqs", type=int, default=32)
    e.add_argument("--max-num-batched-tokens", type=int, default=256)
    e.add_argument("--num-pages", type=int, default=None)
    e.add_argument("--batching", default="continuous", choices=["continuous", "static", "dynamic"])
    e.add_argument("--policy", default="fcfs", choices=["fcfs", "priority"])
    e.add_argument("--chunked-prefill", default="on", choices=["on", "off"])
    e.add_argument("--dynamic-timeout", type=float, default=0.05)
    e.add_argument("--min-token-bucket", type=int, default=1)
    e.add_argument("--token-bucket-step", type=int, default=None)
    e.add_argument(
        "--slo-scheduling",
        action="store_true",
        help="size each step's prefill to keep decodes within --tpot-slo (slo_policy.py)",
    )
    e.add_argument(
        "--shed-late",
        action="store_true",
        help="with --slo-scheduling: refuse waiting requests that can no longer meet --ttft-slo",
    )


def engine_config(args: argparse.Namespace, max_model_len: int):
    from jaxserve.engine_config import EngineConfig

    return EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        num_pages=args.num_pages,
        batching=args.batching,
        policy=args.policy,
        enable_chunked_prefill=args.chunked_prefill == "on",
        dynamic_timeout_s=args.dynamic_timeout,
        min_token_bucket=args.min_token_bucket,
        token_bucket_step=args.token_bucket_step,
        ttft_slo_s=args.ttft_slo,
        tpot_slo_s=args.tpot_slo,
        slo_scheduling=args.slo_scheduling,
        shed_late=args.shed_late,
        cost_model=args.cost_model,
        precompile=False,
        compilation_cache_dir=None,
    )


def load_inputs(args: argparse.Namespace):
    """(workloads, max_model_len, cost model) of the command line, or a UserError."""
    from jaxserve.bench.suite import build_workloads, needed_model_len
    from jaxserve.bench.workload import TraceError
    from jaxserve.scheduling.cost_model import CostModel, CostModelError

    try:
        workloads = build_workloads(args)
        cost = CostModel.load(args.cost_model)
    except (TraceError, CostModelError) as e:
        raise UserError(str(e)) from e
    return workloads, args.max_model_len or needed_model_len(workloads), cost


def _cmd_simulate(args: argparse.Namespace) -> int:
    from jaxserve.bench import report
    from jaxserve.bench.metrics import SLO, summarize
    from jaxserve.bench.simulator import simulate

    workloads, max_model_len, cost = load_inputs(args)
    config = engine_config(args, max_model_len)
    slo = SLO(args.ttft_slo, args.tpot_slo)
    from jaxserve.bench.tuner import label as knobs

    label = f"{args.batching} {knobs(config)} (simulated)"
    summaries = [
        report.sanitize(summarize(simulate(w, config, cost, label=label, seed=args.seed), slo))
        for w in workloads
    ]
    print(report.format_table(summaries))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": " ".join(["jaxserve", *sys.argv[1:]]), "cost_model": args.cost_model}
        out.write_text(json.dumps({"meta": meta, "summaries": summaries}, indent=2) + "\n")
        print(f"Wrote {out}.")
    return 0
