"""Finds the scheduling knobs that give the most goodput for a traffic, in the simulator.

The knobs (token budget, max sequences, chunked prefill, policy, SLO-aware scheduling) trade
TTFT against TPOT in ways that depend on the model, the machine and the traffic. `tune`
simulates every combination of a grid (jaxserve/bench/simulator.py, a few hundred milliseconds each)
and ranks them by goodput under the SLO, then by lower TTFT p50; `serve_command` prints the
`jaxserve serve` line of the winner. The ranking is only as good as the cost model: measure the
winner for real (docs/benchmarks.md does) before trusting a small margin.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

from jaxserve.bench.metrics import SLO, summarize
from jaxserve.bench.simulator import simulate
from jaxserve.bench.workload import Workload
from jaxserve.engine_config import EngineConfig
from jaxserve.scheduling.cost_model import CostModel


@dataclasses.dataclass(frozen=True, kw_only=True)
class Grid:
    """The values tried for each knob; their product is searched."""

    max_num_batched_tokens: tuple[int, ...] = (64, 128, 256, 512)
    max_num_seqs: tuple[int, ...] = (16, 32, 64, 128)
    enable_chunked_prefill: tuple[bool, ...] = (True, False)
    policy: tuple[str, ...] = ("fcfs", "priority")
    slo_scheduling: tuple[bool, ...] = (False, True)
    shed_late: tuple[bool, ...] = (False,)  # tried only with slo_scheduling

    def configs(self, base: EngineConfig, max_model_len: int) -> list[EngineConfig]:
        """Every valid combination applied to `base` (e.g. no chunking with a budget shorter
        than a prompt, or fewer tokens than sequences, is skipped)."""
        out = []
        for budget, seqs, chunked, policy, slo, shed in itertools.product(
            self.max_num_batched_tokens,
            self.max_num_seqs,
            self.enable_chunked_prefill,
            self.policy,
            self.slo_scheduling,
            self.shed_late,
        ):
            if budget < seqs or (not chunked and budget < max_model_len) or (shed and not slo):
                continue
            out.append(
                base.replace(
                    max_num_batched_tokens=budget,
                    max_num_seqs=seqs,
                    enable_chunked_prefill=chunked,
                    policy=policy,
                    slo_scheduling=slo,
                    shed_late=shed,
                )
            )
        return out


@dataclasses.dataclass(frozen=True)
class Trial:
    """One simulated configuration: its summaries (one per workload) and its score."""

    config: EngineConfig
    summaries: tuple[dict, ...]

    @property
    def goodput(self) -> float:
        return sum(s["goodput"] for s in self.summaries) / len(self.summaries)

    @property
    def ttft_p50(self) -> float:
        values = [s["ttft"]["p50"] for s in self.summaries if s["ttft"]["p50"] is not None]
        return sum(values) / len(values) if values else float("inf")


def tune(
    workloads: Sequence[Workload],
    base: EngineConfig,
    cost: CostModel,
    slo: SLO,
    grid: Grid,
    *,
    max_model_len: int,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> list[Trial]:
    """Simulates every configuration of `grid`; returns the trials, best first."""
    trials = []
    configs = grid.configs(base, max_model_len)
    if not configs:
        raise ValueError(f"The grid {grid} has no valid configuration for {max_model_len=}.")
    for i, config in enumerate(configs):
        summaries = tuple(
            summarize(simulate(w, config, cost, label=label(config), seed=seed), slo)
            for w in workloads
        )
        trials.append(Trial(config, summaries))
        if log is not None:
            log(f"[{i + 1}/{len(configs)}] {label(config)}: goodput {trials[-1].goodput:.2f}/s")
    trials.sort(key=lambda t: (-t.goodput, t.ttft_p50))
    return trials


def label(config: EngineConfig) -> str:
    """The knobs the tuner varies, in a few words."""
    return (
        f"tokens={config.max_num_batched_tokens} seqs={config.max_num_seqs} "
        f"chunked={'on' if config.enable_chunked_prefill else 'off'} {config.policy}"
        f"{' slo' if config.slo_scheduling else ''}{' shed' if config.shed_late else ''}"
    )


def serve_command(config: EngineConfig, model: str | None = None) -> str:
    """The `jaxserve serve` line that runs `config`'s knobs."""
    parts = ["jaxserve serve"]
    if model:
        parts.append(f"--model {model}")
    parts += [
        f"--max-num-seqs {config.max_num_seqs}",
        f"--max-num-batched-tokens {config.max_num_batched_tokens}",
        f"--policy {config.policy}",
    ]
    if not config.enable_chunked_prefill:
        parts.append("--no-chunked-prefill")
    if config.max_model_len is not None:
        parts.append(f"--max-model-len {config.max_model_len}")
    if config.ttft_slo_s is not None:
        parts.append(f"--ttft-slo {config.ttft_slo_s:g}")
    if config.tpot_slo_s is not None:
        parts.append(f"--tpot-slo {config.tpot_slo_s:g}")
    if config.slo_scheduling:
        parts += ["--slo-scheduling", f"--cost-model {config.cost_model}"]
    if config.shed_late:
        parts.append("--shed-late")
    return " ".join(parts)
