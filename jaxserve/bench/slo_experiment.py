"""Issue 12's measurement in one process: scheduling for goodput, real runs beside the simulator.

    python -m jaxserve.bench.slo_experiment --out DIR --quick   # a smoke run: 30 requests
    python -m jaxserve.bench.slo_experiment --out DIR --full    # 200 requests, full calibration
    python -m jaxserve.bench.slo_experiment --out DIR --full --tune   # and the tuner's pick

Time: on the idle 2-core development machine `--full` took 375 s and `--full --tune` 457 s
(2026-11-30, before the full calibration grew to 24 decode tokens a request) and then 422 s
(`--full --tune`, after); on the same machine shared with other jobs (load 7-11) `--full` took
17 minutes and `--quick` 9.5: precompiling and the calibration dominate.

One process, one model (`--model`, default the peers' `tiny`), one seeded workload (the bench's
mixed profile at a saturating `--rate`, prompts 16-512 and outputs 8-256 tokens, 30% long),
engines sharing the weights with 64 rows and a 512-token budget (today's, which also runs the
SLO-aware configurations with the policy attached as the engine attaches it; static; dynamic;
the prefix cache off, since one engine serves the same prompts several times):

1. The step-cost model is measured first, on today's engine, by the engine's own calibration
   (jaxserve/engine/calibration.py: the warm-up one with --quick, the `bench --profile steps` one
   with
   --full) and saved as DIR/cost_model.json; the SLO-aware engines load it (same key), so the
   real runs and the simulator use one model measured in this run.
2. Real runs, back to back on the same workload (as `jaxserve bench` runs them): continuous
   batching as today, static and dynamic batching, SLO-aware scheduling and SLO-aware + shed
   late (`--shed-late`: requests refused with finish reason "refused", counted apart).
3. The simulator (jaxserve/bench/simulator.py) on the same workload and configurations with that
cost
   model; the error of its TTFT p50, TPOT p50 and goodput against each real run. Goodput shows
   the good requests' count too, and no error where fewer than FEW_GOOD were good in the real
   run (then one request more or less moves it by tens of percent: a count, not a rate).
   Each real run's steps are timed as calibration times them; a second table sets the cost
   model's error on them (measured over predicted) beside the simulator replaying the run with
   a model fitted to those very steps: the error left there is the simulator's own (its loop,
   the scheduler's decisions), the rest the cost model's (the machine changed pace since the
   calibration, or the fit misses the contexts the run saw). The first real run (today's) also
   measures the cost model's serving scale (cost_model.serving_scale: served steps over
   calibrated ones, saved as DIR/cost_model_served.json, as an engine saves it when it stops),
   and that table gives the simulator's p50s once more with steps of the served model: the
   error left after the serving correction, on runs it was not measured on but the first.
   Every step of the calibration and of each real run, its time and its chunks, is written to
   DIR/steps.json, so other cost-model features can be fitted and checked offline on the very
   steps this run timed.
4. With --tune: `jaxserve tune`'s search in the simulator, and its pick measured for real.

The SLO is the issue's (TTFT <= 0.25 s, TPOT <= 0.02 s). When the cost model says the step alone
cannot meet it on this machine (a decode step of every row already slower than the TPOT target,
or the longest prompt's prefill slower than the TTFT target), the script says so and also runs
the SLO-aware configurations under `--loose-ttft` / `--loose-tpot` (default 1 s / 0.1 s, the
bench's defaults); the other configurations do not depend on the SLO and are scored under both,
and once more under `--compare-slo` (default 10 s / 0.1 s): at a saturating rate today's, static
and dynamic batching meet the tighter targets with a handful of requests (a few of 200), so
their goodput only becomes a rate worth comparing with the simulator's under targets that most
of their requests meet (on the idle machine their TTFT p50 was 5-12 s, TPOT p50 45-71 ms).
The output is one markdown table for docs/benchmarks.md (also DIR/slo_experiment.md, and every
summary in DIR/slo_experiment.json). Ratios inside this run are what to quote, never absolutes
across runs: the development machine is shared.

llama.cpp on the same workload and SLO: ../shared/peers reports goodput for its `mixed`
condition under the SLO it is given (tiny: 200 requests at 25 req/s, TTFT <= 0.25 s, TPOT
<= 0.02 s; small: 40 at 1 req/s, 2 s / 0.1 s), and its jaxserve adapter takes EngineConfig
fields from JS_EXTRA; SLO-aware scheduling needs no cost model file (the engine measures one at
warm-up). A refused request counts there as failed (no token), never as good. So, per size:

    SIZES=tiny CONDITIONS=mixed JS_TTFT_SLO=0.25 JS_TPOT_SLO=0.02 \\
      JS_EXTRA='{"slo_scheduling": true, "shed_late": true}' ../shared/peers/run_side_by_side.sh
    SIZES=small CONDITIONS=mixed JS_TTFT_SLO=2.0 JS_TPOT_SLO=0.1 \\
      JS_EXTRA='{"slo_scheduling": true, "shed_late": true}' ../shared/peers/run_side_by_side.sh

(without JS_EXTRA, the same commands give jaxserve's goodput with today's scheduling).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from jaxserve.bench.metrics import SLO, summarize
from jaxserve.bench.workload import LengthMix, Workload, mixed_workloads
from jaxserve.engine_config import EngineConfig
from jaxserve.scheduling import cost_model
from jaxserve.scheduling.cost_model import CostModel

ISSUE_SLO = SLO(ttft_s=0.25, tpot_s=0.02)
PEERS_TINY = os.path.expanduser("~/.cache/peers/models/tiny")
MIX = LengthMix(prompt_range=(16, 512), output_range=(8, 256), long_share=0.3, extended_share=0.3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What one invocation runs."""

    model: str | None
    out: Path
    rate: float
    num_requests: int
    full_calibration: bool
    slo: SLO
    loose: SLO
    tune: bool
    # Scores the configurations that do not depend on the SLO once more, under targets most of
    # their requests meet, so that their goodput counts many requests (module docstring).
    compare: SLO | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    seed: int = 0


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for cost_model.json and the results")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--quick", action="store_true", help="30 requests, warm-up calibration")
    size.add_argument("--full", action="store_true", help="200 requests, full calibration")
    p.add_argument("--model", default=PEERS_TINY if os.path.isdir(PEERS_TINY) else None)
    p.add_argument("--rate", type=float, default=25.0, help="requests/s (saturating on tiny)")
    p.add_argument("--num-requests", type=int, default=None, help="default: 30 quick, 200 full")
    p.add_argument("--ttft-slo", type=float, default=ISSUE_SLO.ttft_s)
    p.add_argument("--tpot-slo", type=float, default=ISSUE_SLO.tpot_s)
    p.add_argument("--loose-ttft", type=float, default=1.0, help="when the SLO cannot be met")
    p.add_argument("--loose-tpot", type=float, default=0.1, help="when the SLO cannot be met")
    p.add_argument("--tune", action="store_true", help="also measure the tuner's pick for real")
    p.add_argument(
        "--compare-slo",
        default="10:0.1",
        help="TTFT:TPOT seconds to also score today's, static and dynamic batching under "
        "('none': not)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    plan = Plan(
        model=args.model,
        out=Path(args.out),
        rate=args.rate,
        num_requests=args.num_requests or (200 if args.full else 30),
        full_calibration=args.full,
        slo=SLO(args.ttft_slo, args.tpot_slo),
        loose=SLO(args.loose_ttft, args.loose_tpot),
        tune=args.tune,
        seed=args.seed,
        compare=_parse_slo(args.compare_slo),
    )
    table = run(plan)
    print(table)
    return 0


def _parse_slo(text: str) -> SLO | None:
    if text == "none":
        return None
    try:
        ttft, tpot = (float(x) for x in text.split(":"))
    except ValueError:
        why = f"--compare-slo {text!r} must be TTFT:TPOT in seconds, or 'none'."
        raise SystemExit(why) from None
    return SLO(ttft, tpot)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # progress; the table alone goes to stdout


def run(plan: Plan, log: Callable[[str], None] = _log) -> str:
    """Runs the whole experiment; returns the markdown table (also written under plan.out)."""
    from checkpoints import load_model
    from jaxserve.bench.runner import run_offline
    from jaxserve.bench.suite import needed_model_len
    from jaxserve.engine import calibration
    from jaxserve.engine.build import build_engine
    from jaxserve.engine.core import Engine
    from jaxserve.scheduling import slo_policy

    started = time.perf_counter()
    plan.out.mkdir(parents=True, exist_ok=True)
    workload = mixed_workloads(
        [plan.rate], num_requests=plan.num_requests, mix=MIX, seed=plan.seed
    )[0]
    max_model_len = needed_model_len([workload])
    model = load_model(plan.model, seed=plan.seed)
    cost_path = plan.out / "cost_model.json"
    cost_path.unlink(missing_ok=True)  # measured in this run, never a stale one
    base = EngineConfig(
        model=plan.model,
        max_num_seqs=plan.max_num_seqs,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        max_model_len=max_model_len,
        ttft_slo_s=plan.slo.ttft_s,
        tpot_slo_s=plan.slo.tpot_s,
        show_progress=False,
        seed=plan.seed,
        # Today's engine serves several runs of the same prompts: a prefix cache would serve the
        # later runs from the earlier. Random prompts share no prefix within a run, so nothing
        # else changes.
        enable_prefix_caching=False,
    )

    def build(config: EngineConfig) -> Engine:
        t = time.perf_counter()
        engine = build_engine(config, model=model)
        log(f"built an engine in {time.perf_counter() - t:.1f}s")
        return engine

    # 1. The cost model, on today's engine (its buckets are every configuration's).
    today = build(base)
    spec = calibration.Calibration(seed=plan.seed) if plan.full_calibration else calibration.WARM_UP
    # Every step's time and chunks, by run (DIR/steps.json): other features fit offline to them.
    recorded: dict[str, list] = {}
    spans: list[list[tuple[int, int]]] = []
    with calibration.recording_steps(today, spans) as steps:
        cost = calibration.calibrate(today, spec, log)
    recorded["calibration"] = [[s.seconds, c] for s, c in zip(steps, spans, strict=True)]
    calibration.forget(today)
    cost.save(cost_path)
    log(cost.describe())
    feasible, why = slo_feasible(cost, plan.slo, plan.max_num_seqs, MIX)
    log(why)
    slos = [plan.slo] if feasible else [plan.slo, plan.loose]

    # 2. The configurations (the SLO-aware ones once per SLO), then the real runs. The SLO-aware
    # ones run on today's engine with the policy attached as Engine attaches it (slo_policy):
    # the same compiled steps, and four engine builds (minutes of precompile) saved.
    configs: list[tuple[str, SLO | None, EngineConfig]] = [
        ("continuous, today", None, base),
        ("static", None, base.replace(batching="static")),
        ("dynamic", None, base.replace(batching="dynamic")),
    ]
    for slo in slos:
        aware = base.replace(
            ttft_slo_s=slo.ttft_s,
            tpot_slo_s=slo.tpot_s,
            slo_scheduling=True,
            cost_model=str(cost_path),
        )
        configs += [("SLO-aware", slo, aware), ("SLO-aware + shed late", slo, aware.replace(
            shed_late=True))]  # fmt: skip
    if plan.tune:
        configs += _tuned(workload, base, cost, cost_path, slos[-1], max_model_len, plan, log)
    engines = {"continuous, today": today}
    for label, _, config in configs:
        if label not in engines and not config.slo_scheduling:
            engines[label] = build(config)
        elif label.startswith("tuner"):
            engines[label] = build(config.replace(calibrate_cost_model=False))
    rows, checks = [], []
    served = None  # the cost model with the serving scale of the first real run
    scored_slos = slos + ([plan.compare] if plan.compare and plan.compare not in slos else [])
    for label, slo, config in configs:
        engine = engines.get(label, today)
        if engine is today:
            slo_policy.attach(today.scheduler, config, cost)  # None unless SLO-aware
        t = time.perf_counter()
        spans: list[list[tuple[int, int]]] = []
        with calibration.recording_steps(engine, spans) as steps:
            real = run_offline(engine, workload, label=label, seed=plan.seed)
        recorded[f"{label} ({_slo_name(slo)})"] = [
            [s.seconds, c] for s, c in zip(steps, spans, strict=True)
        ]
        today.scheduler.budget_policy = None
        log(f"real {label} ({_slo_name(slo)}): {time.perf_counter() - t:.1f}s")
        # 3. The simulator on the same workload, configuration and cost model; and once more
        # with each step as long as this run's own steps were (a model fitted to them), which
        # tells the simulator's error from the cost model's.
        sim = _simulate(workload, config, cost, label, max_model_len, model, plan.seed)
        own = cost_model.fit(steps, cost.key, cost.features, cost.slots) if steps else None
        replay = _simulate(workload, config, cost, label, max_model_len, model, plan.seed, own)
        if served is None and (scale := cost_model.serving_scale(cost, steps)) is not None:
            served = cost.with_serving_scale(scale, len(steps))
            served.save(plan.out / "cost_model_served.json")
            log(f"served steps ran x{scale:.3f} of calibration's ({label}, {len(steps)} steps)")
        # The policy plans with the model the real run loaded; steps take the served model's time.
        after = _simulate(workload, config, cost, label, max_model_len, model, plan.seed, served)
        for scored in [slo] if slo else scored_slos:
            rows.append((label, scored, summarize(real, scored), summarize(sim, scored)))
        checks.append(
            (label, slo or slos[0], step_error(cost, steps), summarize(real, slo or slos[0]),
             summarize(replay, slo or slos[0]), summarize(after, slo or slos[0]))
        )  # fmt: skip
    rows.sort(key=lambda row: scored_slos.index(row[1]))  # by SLO, then configurations in order
    table = format_table(rows, plan, why, time.perf_counter() - started)
    table += "\n\n" + format_checks(checks)
    (plan.out / "slo_experiment.md").write_text(table + "\n")
    (plan.out / "steps.json").write_text(json.dumps(recorded) + "\n")
    (plan.out / "slo_experiment.json").write_text(
        json.dumps(
            {
                "plan": {**dataclasses.asdict(plan), "out": str(plan.out)},
                "cost_model": cost.to_json(),
                "rows": [
                    {"label": lb, "slo": dataclasses.asdict(s), "real": r, "simulated": m}
                    for lb, s, r, m in rows
                ],
                "checks": [
                    {
                        "label": lb,
                        "slo": dataclasses.asdict(s),
                        "steps": e,
                        "replayed": m,
                        "served_sim": a,
                    }
                    for lb, s, e, _, m, a in checks
                ],
            },
            indent=1,
            default=_jsonable,
        )
        + "\n"
    )
    return table


def slo_feasible(cost: CostModel, slo: SLO, rows: int, mix: LengthMix) -> tuple[bool, str]:
    """Whether the machine's step alone can meet `slo` (by the cost model), and a sentence."""
    mean_context = (sum(mix.prompt_range) + sum(mix.output_range)) // 4
    decode_s = cost.predict(cost_model.decode_work(rows, rows * mean_context, mean_context))
    longest = mix.prompt_range[1]
    prefill_s = cost.predict(cost_model.work_of([(0, longest)]))
    ok = decode_s <= slo.tpot_s and prefill_s <= slo.ttft_s
    verdict = "can meet" if ok else "cannot meet"
    return ok, (
        f"By the cost model, this machine's step alone {verdict} the SLO (TTFT <= {slo.ttft_s} s, "
        f"TPOT <= {slo.tpot_s} s): a decode step of {rows} rows at context {mean_context} takes "
        f"{decode_s * 1e3:.1f} ms and a {longest}-token prefill {prefill_s * 1e3:.1f} ms."
    )


def _simulate(workload: Workload, config, cost, label, max_model_len, model, seed, steps=None):
    from jaxserve.bench.simulator import simulate

    return simulate(
        workload,
        config,
        cost,
        label=label,
        max_model_len=max_model_len,
        vocab_size=model.config.vocab_size,
        seed=seed,
        step_cost=steps,
    )


def step_error(cost: CostModel, steps) -> dict:
    """How the cost model predicted the steps of one real run (cost_model.StepSample list):
    their measured over predicted total time, and the median step's ratio."""
    if not steps:
        return {"steps": 0, "total_ratio": math.nan, "median_ratio": math.nan}
    predicted = [cost.predict(s.work) for s in steps]
    ratios = sorted(s.seconds / p for s, p in zip(steps, predicted, strict=True))
    return {
        "steps": len(steps),
        "total_ratio": sum(s.seconds for s in steps) / sum(predicted),
        "median_ratio": ratios[len(ratios) // 2],
    }


def _tuned(workload, base, cost, cost_path, slo, max_model_len, plan, log):
    """The tuner's best configuration for `slo` (budgets within the measured ladder, so the
    cost model file applies to it)."""
    from jaxserve.bench import tuner

    grid = tuner.Grid(
        max_num_batched_tokens=(128, 256, plan.max_num_batched_tokens),
        max_num_seqs=(16, 32, 64),
        shed_late=(False, True),
    )
    cfg = base.replace(ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s, cost_model=str(cost_path))
    t = time.perf_counter()
    trials = tuner.tune([workload], cfg, cost, slo, grid, max_model_len=max_model_len)
    best = trials[0].config
    log(
        f"tuner: {len(trials)} configurations in {time.perf_counter() - t:.1f}s; best "
        f"{tuner.label(best)} (predicted goodput {trials[0].goodput:.2f} req/s)"
    )
    return [(f"tuner's pick: {tuner.label(best)}", slo, best)]


def format_table(rows, plan: Plan, why: str, wall_s: float) -> str:
    """One markdown table: each configuration's real metrics beside the simulator's."""
    lines = [
        f"{plan.num_requests} requests, mixed {plan.rate:g} req/s, {plan.max_num_seqs} rows, "
        f"{plan.max_num_batched_tokens}-token budget, model {plan.model or 'embedded'}; "
        f"{'full' if plan.full_calibration else 'warm-up'} calibration; {wall_s:.0f} s in all.",
        why,
        "",
        "| SLO (TTFT / TPOT) | config | out tok/s | TTFT p50 real / sim (s) | TPOT p50 real / sim "
        "(ms) | goodput real / sim (req/s) | refused real / sim |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label, slo, real, sim in rows:
        lines.append(
            f"| {slo.ttft_s:g} s / {slo.tpot_s * 1e3:g} ms | {label} | "
            f"{_num(real['output_token_throughput'], '.0f')} | "
            f"{_pair(real['ttft']['p50'], sim['ttft']['p50'], 1, '.2f')} | "
            f"{_pair(real['tpot']['p50'], sim['tpot']['p50'], 1e3, '.0f')} | "
            f"{_goodput_pair(real, sim)} | "
            f"{real['num_refused']} / {sim['num_refused']} |"
        )
    lines += ["", *_ratios(rows)]
    return "\n".join(lines)


def format_checks(checks) -> str:
    """Per real run: the cost model's error on its steps, and the simulator replaying it with
    those steps' own times (a model fitted to them): what is left there is the simulator's."""
    lines = [
        "Per real run: measured over predicted time of its steps (total; median step), and the "
        "simulator again with steps as long as this run's own (a cost model fitted to them), "
        "and with the serving scale the first run measured (served sim):",
        "",
        "| config | SLO | steps | measured / predicted | TTFT p50 real / replayed (s) | TPOT p50 "
        "real / replayed (ms) | good real / replayed | TTFT p50 real / served sim (s) | TPOT p50 "
        "real / served sim (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, slo, err, real, replay, after in checks:
        lines.append(
            f"| {label} | {slo.ttft_s:g} s / {slo.tpot_s * 1e3:g} ms | {err['steps']} | "
            f"{err['total_ratio']:.2f}; {err['median_ratio']:.2f} | "
            f"{_pair(real['ttft']['p50'], replay['ttft']['p50'], 1, '.2f')} | "
            f"{_pair(real['tpot']['p50'], replay['tpot']['p50'], 1e3, '.0f')} | "
            f"{real['good_requests']} / {replay['good_requests']} | "
            f"{_pair(real['ttft']['p50'], after['ttft']['p50'], 1, '.2f')} | "
            f"{_pair(real['tpot']['p50'], after['tpot']['p50'], 1e3, '.0f')} |"
        )
    return "\n".join(lines)


# Fewer requests than this met the SLO in the real run: goodput is a count of a handful of
# requests, and its relative error says little (a request more or less moves it by 5-50%).
FEW_GOOD = 20


def _goodput_pair(real: dict, sim: dict) -> str:
    """'real / sim (+e%; n / m requests)', the error left out when few requests were good."""
    counts = f"{real['good_requests']} / {sim['good_requests']} req"
    pair = _pair(real["goodput"], sim["goodput"], 1, ".2f")
    if real["good_requests"] >= FEW_GOOD:
        return f"{pair[:-1]}; {counts})" if pair.endswith(")") else f"{pair} ({counts})"
    return f"{pair.split(' (')[0]} (few: {counts})"


def _ratios(rows) -> list[str]:
    """The acceptance ratios, per SLO, from the real runs."""
    out = []
    for slo in dict.fromkeys(s for _, s, _, _ in rows):
        good = {label: real["goodput"] for label, s, real, _ in rows if s == slo}
        today = good.get("continuous, today", math.nan)
        aware = max(
            (v for k, v in good.items() if k.startswith(("SLO-aware", "tuner"))), default=math.nan
        )
        if math.isnan(aware):
            continue  # an SLO the others are only scored under (--compare-slo)
        batch = max(good.get("static", math.nan), good.get("dynamic", math.nan))
        out.append(
            f"SLO {slo.ttft_s:g} s / {slo.tpot_s:g} s: best SLO-aware goodput {aware:.2f} req/s "
            f"against today's {today:.2f} ({_ratio(aware, today)}) and the better of static and "
            f"dynamic {batch:.2f} ({_ratio(aware, batch)})."
        )
    return out


def _ratio(a: float, b: float) -> str:
    if not b > 0:
        return "against 0" if a > 0 else "both 0"
    return f"{a / b:.1f}x"


def _pair(real, sim, scale: float, fmt: str) -> str:
    """'real / sim (+e%)': the simulator's error relative to the real run."""
    if real is None or sim is None or (isinstance(real, float) and math.isnan(real)):
        return f"{_num(real, fmt, scale)} / {_num(sim, fmt, scale)}"
    err = f" ({100 * (sim / real - 1):+.0f}%)" if real else ""
    return f"{real * scale:{fmt}} / {sim * scale:{fmt}}{err}"


def _num(x, fmt: str, scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x * scale:{fmt}}"


def _slo_name(slo: SLO | None) -> str:
    return "any SLO" if slo is None else f"{slo.ttft_s:g} s / {slo.tpot_s:g} s"


def _jsonable(x):
    return str(x) if not isinstance(x, float | int) else None


if __name__ == "__main__":
    sys.exit(main())
