"""Device idle time: working wall time with no step in flight, and host time per step by phase."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest

from jaxserve.bench.host import host_engine
from jaxserve.engine.metrics import HOST_PHASES, DeviceTimeline, EngineStats
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import SMALL, drain


def test_no_idle_time_while_a_step_is_always_in_flight():
    """Step t+1 dispatched before step t is seen done (asynchronous scheduling): no gap."""
    stats = EngineStats()
    timeline = DeviceTimeline(stats)
    timeline.dispatched(0.0)
    for t in range(1, 10):
        timeline.dispatched(float(t))  # the next step goes out before the last one is back
        timeline.finished(t + 0.5)
    timeline.finished(10.0)
    assert stats.device_idle_s == 0.0
    assert stats.busy_wall_s == 10.0 and stats.device_idle_share == 0.0


def test_gaps_between_steps_are_idle_and_time_without_work_is_not():
    stats = EngineStats()
    timeline = DeviceTimeline(stats)
    timeline.dispatched(0.0)
    timeline.finished(1.0)
    timeline.dispatched(1.25)  # the host took 0.25 s to take the result in and send the next
    timeline.finished(2.25)
    timeline.no_work(2.5)  # then found nothing to run: idle until then, not after
    timeline.dispatched(100.0)
    timeline.finished(101.0)
    assert stats.device_idle_s == pytest.approx(0.5)
    assert stats.busy_wall_s == pytest.approx(3.0)
    assert stats.device_idle_share == pytest.approx(0.5 / 3.5)
    with pytest.raises(ValueError, match="with 0 steps in flight"):
        timeline.finished(102.0)


@pytest.fixture(scope="module")
def model():
    from checkpoints import load_model

    return load_model(None)


def _echo(batch, sampling):
    """next = last + 1, on the host: a result that is ready the moment it is dispatched."""
    return (batch.token_ids[batch.logits_indices] + 1) % 512


def _engine(model, step_time_s: float = 0.0):
    # Host-only runner: the device call costs nothing (or step_time_s), no model compiled.
    config = EngineConfig(**SMALL, max_model_len=128, num_pages=64)
    engine = host_engine(config, model, step_time_s=step_time_s, next_tokens=_echo)
    for i in range(3):
        engine.add_request([5 + i] * 8, SamplingParams(max_tokens=12, ignore_eos=True))
    return engine


def _steps(engine, n: int, host_sleep_s: float) -> tuple[float, float]:
    """Runs n steps, the host sleeping between them; returns (idle, busy) seconds they added."""
    stats = engine.metrics.stats
    idle, busy = stats.device_idle_s, stats.busy_wall_s
    for _ in range(n):
        engine.step()
        time.sleep(host_sleep_s)
    return stats.device_idle_s - idle, stats.busy_wall_s - busy


def test_idle_time_grows_when_the_host_sleeps_between_steps(model):
    """Results are ready at once: the device then waits for the host through each sleep."""
    engine = _engine(model)
    engine.step()  # the first dispatch
    idle, _ = _steps(engine, 5, host_sleep_s=0.02)
    assert idle >= 4 * 0.02  # the first 4 sleeps; the 5th ends at the next step's dispatch
    drain(engine)
    assert engine.metrics.stats.generation_tokens == 36


def test_a_slow_device_is_busy_for_its_step_time(model):
    """A fake device of 30 ms a step: each step is in flight for at least that long."""
    engine = _engine(model, step_time_s=0.03)
    engine.step()
    _, busy = _steps(engine, 4, host_sleep_s=0.0)
    assert busy >= 0.9 * 4 * 0.03
    phases = engine.metrics.stats.host_phase_s
    assert phases["wait"] > 0  # the host blocked on the fake device
    drain(engine)


def test_host_phases_in_stats_and_prometheus(model):
    engine = _engine(model)
    drain(engine)
    stats = engine.metrics.stats
    assert stats.host_steps > 0 and set(stats.host_phase_s) == set(HOST_PHASES)
    text = generate_latest(engine.metrics.registry).decode()
    for phase in HOST_PHASES:
        line = f'jaxserve_host_step_seconds_count{{phase="{phase}"}} {float(stats.host_steps)}'
        assert line in text
    for phase in ("schedule", "pack", "outputs"):
        seconds = engine.metrics.registry.get_sample_value(
            "jaxserve_host_step_seconds_sum", {"phase": phase}
        )
        assert seconds == pytest.approx(stats.host_phase_s[phase]) and seconds > 0
