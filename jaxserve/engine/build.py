"""Engines as their config asks for them: the core, and above it the SLO policy.

The engine core (core.py) runs the loop and knows no calibration; an engine whose config asks
for SLO-aware scheduling or a cost model gets its policy here, measured on the engine itself at
warm-up when no saved cost model applies (calibration.py). Every front door (LLM, AsyncEngine,
the commands, batch jobs, the benchmarks) builds its engine here, and `jaxserve.engine.Engine`
is this module's `Engine`: what a library user (or ../shared/peers) constructs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxserve.engine import calibration, core
from jaxserve.engine_config import EngineConfig
from jaxserve.models.loaded import LoadedModel
from jaxserve.runtime.model_runner import ModelRunner


class Engine(core.Engine):
    """`core.Engine` with the step-budget policy its config asks for (the SLO policy)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        model: LoadedModel | None = None,
        *,
        runner: ModelRunner | None = None,
        budget_policy: Callable[[core.Engine], object | None] | None = None,
        devices: Sequence | None = None,
        mesh=None,
    ):
        super().__init__(
            config,
            model,
            runner=runner,
            budget_policy=budget_policy or calibration.slo_policy_for,
            devices=devices,
            mesh=mesh,
        )


def build_engine(
    config: EngineConfig | None = None,
    model: LoadedModel | None = None,
    *,
    runner: ModelRunner | None = None,
    devices: Sequence | None = None,
    mesh=None,
) -> Engine:
    """An `Engine` for `config` (the default config when None), with the SLO policy it asks for,
    on the config's mesh or on `devices` / `mesh` (core.Engine)."""
    return Engine(config, model, runner=runner, devices=devices, mesh=mesh)
