"""Bench output: a terminal table, one JSON file, and three PNG plots.

- `throughput_latency.png`: output tokens/s against TTFT and TPOT (p50 and p99), one line per
  configuration through its loads: where each configuration's latency gives way.
- `latency_distributions.png`: TTFT and TPOT CDFs per configuration at the heaviest load, with
  the SLO targets marked.
- `timeline.png`: batch occupancy, queue length and KV-cache use over time at the heaviest
  load, one panel per configuration: shows static batching's drained batches and idle slots.
  An online run (`--online`, `--backend openai`) has no engine gauges: its panel shows what the
  client saw instead, requests in flight and output tokens/s over time (`client_timeline`).

Latencies are printed in milliseconds with at least two significant digits (0.43, 4.3, 43), so
the sub-millisecond TPOT of a small model does not read "0".

matplotlib is imported only here, with the Agg backend, so the engine never needs it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxserve.bench.runner import RunResult

PLOTS = ("throughput_latency.png", "latency_distributions.png", "timeline.png")


def _ms(x: float | None) -> str:
    """Seconds as milliseconds, at least two significant digits: 0.43, 4.3, 43, 4321."""
    if x is None or math.isnan(x):
        return "-"
    ms = 1000 * x
    return f"{ms:.0f}" if abs(ms) >= 10 else f"{ms:.2g}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _share(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def format_table(summaries: Sequence[dict]) -> str:
    """One row per (configuration, load); latencies in milliseconds."""
    head = (
        "config",
        "load",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "E2E p50",
        "E2E p99",
        "queue p50",
        "goodput",
        "refused",
        "KV peak",
        "preempt",
        "prefix hit",
        "spec acc",
        "spec len",
    )
    rows = []
    for s in summaries:
        kv = s["kv_cache"]["peak_use"]
        rows.append(
            (
                s["label"],
                s["workload"],
                _num(s["request_throughput"]),
                _num(s["output_token_throughput"], ".1f"),
                _ms(s["ttft"]["p50"]),
                _ms(s["ttft"]["p99"]),
                _ms(s["tpot"]["p50"]),
                _ms(s["tpot"]["p99"]),
                _ms(s["e2e"]["p50"]),
                _ms(s["e2e"]["p99"]),
                _ms(s["queue_wait"]["p50"]),
                _num(s["goodput"]),
                str(s.get("num_refused", 0)),
                "-" if kv is None else f"{100 * kv:.0f}%",
                "-" if s["preemptions"] is None else str(s["preemptions"]),
                _share(s.get("prefix_cache", {}).get("hit_rate")),
                _share(s.get("speculation", {}).get("acceptance_rate")),
                _num(s.get("speculation", {}).get("mean_accepted_length")),
            )
        )
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines = [
        "  ".join(
            str(c).rjust(w) if i > 1 else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [head, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + (
        "\n(latencies in ms; goodput in requests/s meeting both targets; spec acc: speculative"
        " proposals accepted, spec len: accepted per verification)"
    )


def write_json(
    path: Path, meta: dict, summaries: Sequence[dict], results: Sequence[RunResult]
) -> None:
    """Summaries plus the raw per-request records and timelines, so plots can be redrawn."""
    runs = []
    for s, r in zip(summaries, results, strict=True):
        raw = {
            "requests": [
                {
                    "id": x.request_id,
                    "prompt_len": x.prompt_len,
                    "output_len": x.output_len,
                    "arrival": x.arrival,
                    "first_scheduled": x.first_scheduled,
                    "first_token": x.first_token,
                    "finished": x.finished,
                    "finish_reason": x.finish_reason,
                    "preemptions": x.preemptions,
                }
                for x in r.records
            ],
            "timeline": None
            if r.timeline is None
            else {
                "t": r.timeline.t,
                "running": r.timeline.running,
                "waiting": r.timeline.waiting,
                "kv_pages_used": r.timeline.kv_pages_used,
            },
        }
        runs.append({**s, "raw": raw})
    path.write_text(
        json.dumps({**meta, "runs": runs}, indent=1, allow_nan=False, default=_json_default) + "\n"
    )


def load_json(path: Path) -> tuple[dict, list[dict], list[RunResult]]:
    """(meta, summaries, results) of a bench.json: what `write_json` wrote, to redraw plots."""
    from jaxserve.bench.runner import RequestRecord, Timeline
    from jaxserve.bench.workload import Workload

    data = json.loads(Path(path).read_text())
    runs = data.pop("runs")
    summaries, results = [], []
    for run in runs:
        raw = run.pop("raw")
        load = math.inf if run["load"] == "inf" else float(run["load"])
        workload = Workload(
            name=run["workload"], load=load, load_kind=run["load_kind"], requests=()
        )
        records = [
            RequestRecord(
                x["id"],
                x["prompt_len"],
                x["output_len"],
                x["arrival"],
                x["first_scheduled"],
                x["first_token"],
                x["finished"],
                x["finish_reason"],
                x["preemptions"],
            )
            for x in raw["requests"]
        ]
        tl = raw["timeline"]
        results.append(
            RunResult(
                label=run["label"],
                workload=workload,
                records=records,
                duration_s=run["duration_s"],
                max_num_seqs=run["batch_occupancy"]["max_num_seqs"],
                kv_pages_total=run["kv_cache"]["pages_total"],
                timeline=None
                if tl is None
                else Timeline(tl["t"], tl["running"], tl["waiting"], tl["kv_pages_used"]),
            )
        )
        summaries.append(run)
    return data, summaries, results


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def sanitize(obj):
    """NaN becomes None (JSON has no NaN; allow_nan=False would refuse it)."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: sanitize(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [sanitize(v) for v in obj]
    return obj


# ---- plots --------------------------------------------------------------------------------


def write_plots(
    out_dir: Path,
    summaries: Sequence[dict],
    results: Sequence[RunResult],
    *,
    slo_ttft_s: float,
    slo_tpot_s: float,
    title: str = "",
) -> list[Path]:
    """Draws the three PNGs into out_dir; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(s["label"] for s in summaries))
    colors = {lab: plt.cm.tab10(i % 10) for i, lab in enumerate(labels)}
    heaviest = _heaviest_runs(summaries, results)
    paths = [
        _plot_throughput_latency(plt, out_dir, summaries, labels, colors, title),
        _plot_distributions(plt, out_dir, heaviest, colors, slo_ttft_s, slo_tpot_s, title),
        _plot_timeline(plt, out_dir, heaviest, colors, title),
    ]
    plt.close("all")
    return paths


def _heaviest_runs(summaries, results) -> dict[str, RunResult]:
    """Per configuration, the run at the highest load (the last one for equal loads)."""
    best: dict[str, tuple[float, RunResult]] = {}
    for s, r in zip(summaries, results, strict=True):
        load = r.workload.load
        if s["label"] not in best or load >= best[s["label"]][0]:
            best[s["label"]] = (load, r)
    return {label: r for label, (_, r) in best.items()}


def _plot_throughput_latency(plt, out_dir, summaries, labels, colors, title) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        for label in labels:
            rows = sorted(
                (s for s in summaries if s["label"] == label),
                key=lambda s: s["output_token_throughput"] or 0,
            )
            x = [s["output_token_throughput"] for s in rows]
            for pct, style in (("p50", "-o"), ("p99", "--^")):
                y = [_to_ms(s[metric][pct]) for s in rows]
                ax.plot(x, y, style, color=colors[label], label=f"{label} {pct}")
            for s, xi in zip(rows, x, strict=True):
                ax.annotate(
                    _load_tag(s),
                    (xi, _to_ms(s[metric]["p99"])),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(3, 3),
                )
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{name} (ms)")
        _log_axis(ax.yaxis)
        ax.grid(alpha=0.3)
        ax.set_title(f"{name} against throughput across loads")
    axes[1].legend(fontsize=7, ncol=1)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, out_dir / PLOTS[0])


def _plot_distributions(plt, out_dir, heaviest, colors, slo_ttft, slo_tpot, title) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, name, slo in (
        (axes[0], "ttft", "TTFT", slo_ttft),
        (axes[1], "tpot", "TPOT", slo_tpot),
    ):
        for label, run in heaviest.items():
            xs = np.sort([1000 * v for r in run.records if (v := getattr(r, metric)) is not None])
            if xs.size:
                ax.step(
                    xs,
                    np.arange(1, xs.size + 1) / xs.size,
                    where="post",
                    color=colors[label],
                    label=f"{label} ({run.workload.name})",
                )
        ax.axvline(1000 * slo, color="k", ls=":", lw=1, label=f"target {1000 * slo:.0f} ms")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests")
        _log_axis(ax.xaxis)
        ax.grid(alpha=0.3)
        ax.set_title(f"{name} distribution (CDF) at the heaviest load")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, out_dir / PLOTS[1])


def _plot_timeline(plt, out_dir, heaviest, colors, title) -> Path:
    n = max(1, len(heaviest))
    fig, axes = plt.subplots(n, 1, figsize=(11, 2.3 * n + 0.6), sharex=True, squeeze=False)
    for ax, (label, run) in zip(axes[:, 0], heaviest.items(), strict=False):
        tl = run.timeline
        if tl is None or not tl.t:
            _plot_client_timeline(ax, label, run, colors)
            continue
        ax.step(tl.t, tl.running, where="pre", color=colors[label], label="running (slots)")
        ax.step(tl.t, tl.waiting, where="pre", color="0.6", lw=0.8, label="waiting")
        if run.max_num_seqs:
            ax.axhline(run.max_num_seqs, color=colors[label], ls=":", lw=0.8)
        ax.set_ylabel("requests")
        ax2 = ax.twinx()
        if run.kv_pages_total:
            kv = 100 * np.asarray(tl.kv_pages_used, np.float64) / run.kv_pages_total  # f64[steps]
            ax2.step(tl.t, kv, where="pre", color="tab:red", lw=0.8, alpha=0.7, label="KV use %")
        ax2.set_ylim(0, 105)
        ax2.set_ylabel("KV use (%)")
        ax.set_title(f"{label}: {run.workload.name}", fontsize=9)
        handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(handles=handles, fontsize=7, loc="upper right")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("time since the run started (s)")
    engine_seen = any(r.timeline is not None and r.timeline.t for r in heaviest.values())
    what = "Batch occupancy and KV-cache use. " if engine_seen else "As the client saw it. "
    fig.suptitle((what + title).strip(), fontsize=9)
    fig.tight_layout()
    return _save(fig, out_dir / PLOTS[2])


def client_timeline(
    run: RunResult, bins: int = 100
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """What a client saw over a run, at `bins` times from the start to the last finish: (t,
    requests in flight at t, output tokens/s in the interval ending at t). None when no
    request finished.

    The client times a request's arrival, first token and end; its other tokens are spread
    evenly between its first token and its end (a stream's chunks are not timed one by one).
    """
    done = [r for r in run.records if r.finished is not None]
    if not done:
        return None
    end = max(r.finished for r in done)
    if end <= 0:
        return None
    t = np.linspace(0.0, end, bins + 1)  # f64[bins + 1]: interval edges
    arrival = np.array([r.arrival for r in done])  # f64[requests]
    finished = np.array([r.finished for r in done])  # f64[requests]
    in_flight = ((arrival[None, :] <= t[1:, None]) & (t[1:, None] < finished[None, :])).sum(1)
    token_times = [
        r.first_token + (r.finished - r.first_token) * np.arange(r.output_len) / (r.output_len - 1)
        if r.output_len > 1
        else np.array([r.first_token])
        for r in done
        if r.first_token is not None and r.output_len > 0
    ]
    times = np.concatenate(token_times) if token_times else np.zeros(0)  # f64[tokens]
    per_bin, _ = np.histogram(times, bins=t)  # i64[bins]
    return t[1:], in_flight, per_bin / (end / bins)


def _plot_client_timeline(ax, label: str, run: RunResult, colors) -> None:
    """An online run's panel: requests in flight and output tokens/s, as the client saw them."""
    seen = client_timeline(run)
    if seen is None:
        ax.text(0.5, 0.5, "no request finished", ha="center", transform=ax.transAxes)
        return
    t, in_flight, tokens_per_s = seen
    ax.step(t, in_flight, where="pre", color=colors[label], label="requests in flight")
    ax.set_ylabel("requests")
    ax2 = ax.twinx()
    ax2.plot(t, tokens_per_s, color="tab:green", lw=0.9, alpha=0.8, label="output tokens/s")
    ax2.set_ylim(bottom=0)
    ax2.set_ylabel("output tokens/s")
    ax.set_title(f"{label}: {run.workload.name} (as the client saw it)", fontsize=9)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=7, loc="upper right")
    ax.grid(alpha=0.3)


def _log_axis(axis) -> None:
    """Log scale labelled in plain numbers: latencies span decades, and 10^x labels on minor
    ticks would overlap."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    if axis.axis_name == "x":
        axis.axes.set_xscale("log")
    else:
        axis.axes.set_yscale("log")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())


def _to_ms(x: float | None) -> float:
    return math.nan if x is None else 1000 * x


def _load_tag(s: dict) -> str:
    return f"c={s['load']}" if s["load_kind"] == "concurrency" else f"{s['load']}/s"


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path
