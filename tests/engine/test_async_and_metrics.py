"""AsyncEngine streams and cancellation, and the metrics an engine publishes."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import generate_latest

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import TINY


@pytest.fixture(scope="module")
def async_engine(stories_engine):
    engine = AsyncEngine(engine=Engine(EngineConfig(**TINY), model=stories_engine.model))
    yield engine
    engine.shutdown()


async def _collect(engine: AsyncEngine, prompt, params):
    outs = []
    async for out in engine.generate(prompt, params):
        outs.append(out)
    return outs


def test_concurrent_streams_match_offline_outputs(async_engine, stories_engine):
    prompts = ["Once upon a time", "Tom had a red ball", "The little dog", "A cat", "Sam"]
    params = SamplingParams(max_tokens=16, temperature=0)

    async def main():
        return await asyncio.gather(*(_collect(async_engine, p, params) for p in prompts))

    streamed = asyncio.run(main())
    offline = LLM(engine=stories_engine).generate(prompts, params)
    for outs, want in zip(streamed, offline, strict=True):
        assert [t for o in outs for t in o.new_token_ids] == want.token_ids
        assert "".join(o.text_delta for o in outs) == want.text
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])


def test_a_step_wakes_each_event_loop_once_not_once_per_output(async_engine):
    """Four streams decoding together: their outputs reach the loop in one callback per step.
    Delivering each output with its own call_soon_threadsafe costs a system call and a
    callback under the GIL per output, which the next step waits for."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["Once upon a time", "Tom had a red ball", "The little dog", "A cat"]
    inner = async_engine.engine

    async def main():
        loop = asyncio.get_running_loop()
        calls = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            calls.append(callback)
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        steps = inner.metrics.stats.num_steps
        try:
            outs = await asyncio.gather(*(_collect(async_engine, p, params) for p in prompts))
        finally:
            del loop.call_soon_threadsafe
        return outs, len(calls), inner.metrics.stats.num_steps - steps

    outs, calls, steps = asyncio.run(main())
    delivered = sum(len(o) for o in outs)
    assert [o[-1].request_id for o in outs] == [o[0].request_id for o in outs]
    assert all(sum(len(x.new_token_ids) for x in o) == 12 for o in outs)
    # One per step with outputs, plus each add's acceptance: far fewer than the outputs.
    assert calls <= steps + len(prompts) < delivered, (calls, steps, delivered)


# How long a poll waits for the engine thread before the test fails: far beyond what it needs
# (one iteration), because a loaded 2-core machine can stall a thread for a second or more.
POLL_S = 30.0


def _wait_until(done, timeout_s: float = POLL_S) -> bool:
    """Polls `done()` every 10 ms until it holds (True) or `timeout_s` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_consumer_that_stops_iterating_aborts_its_request(async_engine):
    inner = async_engine.engine
    finished = dict(inner.metrics.stats.finished)

    async def main():
        stream = async_engine.generate(
            "Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True)
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        return seen

    assert asyncio.run(main()) == 3
    # The abort lands at the next iteration boundary. A wait long enough for any load would
    # also let the request finish by itself (400 tokens take seconds): it must end aborted.
    assert _wait_until(lambda: inner.scheduler.num_slots_used == 0 and not inner.has_unfinished())
    assert _wait_until(lambda: sum(inner.metrics.stats.finished.values()) > sum(finished.values()))
    got = inner.metrics.stats.finished
    new = {k: n - finished.get(k, 0) for k, n in got.items() if n != finished.get(k, 0)}
    assert new == {"abort": 1}
    assert inner.scheduler.num_pages_used == 0


def test_bad_request_fails_alone(async_engine):
    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(async_engine, [1, 10**6], SamplingParams(max_tokens=2))
        return await _collect(async_engine, "Once", SamplingParams(max_tokens=3, temperature=0))

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].num_output_tokens == 3


def test_metrics_object_and_prometheus(stories_engine):
    engine = stories_engine
    before = engine.metrics.stats.finished.get("length", 0)
    LLM(engine=engine).generate(
        ["Once upon a time"] * 3, SamplingParams(max_tokens=6, ignore_eos=True)
    )
    stats = engine.metrics.stats
    assert stats.finished["length"] == before + 3
    assert 0 < stats.padding_efficiency <= 1
    assert 0 <= stats.device_idle_share < 1
    assert stats.kv_pages_used == 0 and stats.num_running == 0
    text = generate_latest(engine.metrics.registry).decode()
    for name in (
        "jaxserve_ttft_seconds_count",
        "jaxserve_tpot_seconds_count",
        "jaxserve_e2e_seconds_count",
        "jaxserve_queue_wait_seconds_count",
        "\njaxserve_kv_pages ",
        "\njaxserve_kv_cache_usage_perc ",
        "jaxserve_compiles_total",
        'jaxserve_requests_finished_total{reason="length"}',
    ):
        assert name in text


def test_goodput_counts_only_requests_within_targets():
    from jaxserve.engine.metrics import EngineMetrics
    from jaxserve.outputs import RequestMetrics

    m = EngineMetrics(ttft_slo_s=0.5, tpot_slo_s=0.1)
    fast = RequestMetrics(
        arrival_time=0, first_scheduled_time=0, first_token_time=0.2, finished_time=1.0
    )  # ttft 0.2, tpot 0.8/9
    slow_start = RequestMetrics(arrival_time=0, first_token_time=0.9, finished_time=1.5)
    slow_tokens = RequestMetrics(arrival_time=0, first_token_time=0.1, finished_time=5.0)
    for metrics in (fast, slow_start, slow_tokens):
        m.on_finished("length", metrics, num_output_tokens=10)
    m.on_finished("abort", fast, num_output_tokens=10)
    assert m.stats.good_requests == 1


def test_outputs_are_made_on_the_output_thread_and_stop_strings_match_offline(
    async_engine, stories_engine
):
    """The engine thread only schedules, takes steps in and dispatches: every output is made
    on the output thread. A stop string found there ends the stream as the offline engine
    ends it (text, tokens, reason), and the engine then frees the request's slot and pages."""
    import threading

    prompts = ["Once upon a time", "Tom had a red ball", "The little dog", "A cat"]
    params = SamplingParams(max_tokens=40, temperature=0, stop=["the", "."])
    offline = LLM(engine=stories_engine).generate(prompts, params)
    assert any(o.finish_reason == "stop" for o in offline)  # the case under test occurs
    threads = set()
    outputs = async_engine.engine.outputs
    outputs.fault_hook = lambda request_id: threads.add(threading.current_thread().name)
    try:

        async def main():
            return await asyncio.gather(*(_collect(async_engine, p, params) for p in prompts))

        streamed = asyncio.run(main())
    finally:
        outputs.fault_hook = None
    assert threads == {"jaxserve-outputs"}
    for outs, want in zip(streamed, offline, strict=True):
        assert "".join(o.text_delta for o in outs) == want.text
        assert [t for o in outs for t in o.new_token_ids] == want.token_ids
        assert outs[-1].finish_reason == want.finish_reason
        assert outs[-1].num_output_tokens == len(want.token_ids)
        assert outs[-1].metrics.finished_time is not None
    # The finishes the output thread asked for reach the engine thread: nothing is left.
    inner = async_engine.engine
    assert _wait_until(
        lambda: not inner.scheduler.has_unfinished() and async_engine.snapshot().kv_pages_used == 0
    )
    assert async_engine.snapshot().slots_used == 0


def test_a_failure_of_the_output_thread_ends_every_stream(stories_engine):
    """The output thread dies: the engine stops and every open stream learns why."""
    from jaxserve.engine.async_engine import EngineDeadError

    engine = AsyncEngine(engine=Engine(EngineConfig(**TINY), model=stories_engine.model))

    def broken(outputs):
        raise RuntimeError("injected output-thread failure")

    engine._deliver = broken
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    try:
        with pytest.raises(EngineDeadError, match="injected output-thread failure"):
            asyncio.run(asyncio.wait_for(_collect(engine, "Once upon a time", params), 30))
        assert not engine.is_alive
    finally:
        engine.shutdown()
