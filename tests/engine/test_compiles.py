"""No compile after warm-up, anywhere in the process (docs/architecture.md, Decision 3).

The engine counts JAX's own compile events (jaxserve/runtime/compiles.py), not traces of its
step: the penalty state's initialiser once compiled on the first request with penalties,
stalling every stream, while the step's trace counter stayed at 0.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import TINY

# The event JAX 0.10 records around each backend compile; counted here by a listener of the
# test's own, so the check does not rest on the engine's counter it also checks.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class _Compiles:
    """Backend compiles anywhere in the process while listening, by function name."""

    def __init__(self):
        self.names: list[str] = []
        self.listening = False

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if self.listening and event == _COMPILE_EVENT:
            self.names.append(str(kwargs.get("fun_name")))


@pytest.fixture(scope="module")
def heard():
    listener = _Compiles()
    jax.monitoring.register_event_duration_secs_listener(listener)
    yield listener
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture
def fresh(stories_engine) -> Engine:
    """An engine of this test alone: nothing it runs was compiled by an earlier test's runner
    (each runner jits its own functions)."""
    return Engine(EngineConfig(**TINY), model=stories_engine.model)


def test_every_sampling_feature_serves_without_a_compile(fresh, heard):
    """Penalties, logit bias, min_tokens, logprobs, prompt logprobs, n > 1, beams and stop
    strings in one batch: nothing compiles, and the engine's own count agrees."""
    llm = LLM(engine=fresh)
    heard.listening = True
    try:
        prompt = "Once upon a time"
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        text = llm.generate([prompt], greedy)[0].text
        stop = text.split()[2]  # a word the greedy output reaches: the stop string ends it
        sampled = dict(max_tokens=10, temperature=0.8, top_p=0.9, top_k=20)
        params = [
            SamplingParams(
                **sampled, seed=1, presence_penalty=0.5, frequency_penalty=0.3, ignore_eos=True
            ),
            SamplingParams(**sampled, seed=2, repetition_penalty=1.3),
            SamplingParams(**sampled, seed=3, logit_bias={5: 3.0, 17: -100.0}, min_tokens=4),
            SamplingParams(**sampled, seed=4, logprobs=5, prompt_logprobs=3),
            SamplingParams(**sampled, seed=5, logprobs=0),  # n = 2: one prompt, seeds 5 and 6
            SamplingParams(**sampled, seed=6, logprobs=0),
            SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,)),
            SamplingParams(max_tokens=6, beam_width=3),
        ]
        prompts = ["The little dog", "Tom had a red ball", "A cat", "Sam and Mia", "The sun"]
        prompts += ["The sun", prompt, "One day"]
        outs = llm.generate(prompts, params)
    finally:
        heard.listening = False
    assert outs[6].finish_reason == "stop" and stop not in outs[6].text
    assert outs[3].prompt_logprobs is not None and len(outs[3].logprobs) == 10
    assert len(outs[7].beams) == 3
    assert heard.names == [], f"compiled after warm-up: {heard.names}"
    fresh.step()  # nothing to run: the gauges refresh
    assert fresh.metrics.stats.compiles_after_warmup == 0


def test_a_compile_anywhere_after_warm_up_is_counted(fresh):
    """Not only the step's: a jitted function of any thread's code, after warm-up."""
    assert fresh.metrics.stats.compiles_after_warmup == 0
    total = fresh.metrics.stats.num_compiles
    jax.block_until_ready(jax.jit(lambda x: x * 7 - 2)(np.arange(5, dtype=np.int32)))
    fresh.step()  # nothing to run: the gauges refresh
    assert fresh.metrics.stats.compiles_after_warmup == 1
    assert fresh.metrics.stats.num_compiles == total + 1
