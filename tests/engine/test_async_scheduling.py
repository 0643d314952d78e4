"""Asynchronous scheduling gives token for token what synchronous scheduling gives.

The engine plans step t+1 before step t's tokens reach the host; decodes take their last
token from the device. Everything the host learns late (EOS, stop ids, stop strings, aborts)
may cost a wasted row but must never change or add an emitted token. The same requests run
through two engines on the same weights, one with `async_scheduling=False`, must agree in
tokens, text, finish reasons and logprobs.
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.engine.core import Engine
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import drain
from tests.engine.test_engine import PROMPTS

# Every way a request can end or be shaped; the greedy continuation of "Once upon a time" goes
# through 432, 383 (tests/engine/test_engine.py), so stop id 383 ends it early.
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0),
    SamplingParams(max_tokens=300, temperature=0),  # runs to EOS
    SamplingParams(max_tokens=20, temperature=0.9, seed=7),
    SamplingParams(max_tokens=20, temperature=1.1, top_k=20, top_p=0.9, seed=11, logprobs=3),
    SamplingParams(max_tokens=40, temperature=0, stop=["park", " the"]),
    SamplingParams(max_tokens=50, temperature=0, stop_token_ids=(383,)),
    SamplingParams(max_tokens=1, temperature=0),
    SamplingParams(max_tokens=16, temperature=0.8, seed=3, min_tokens=10, logit_bias={13: 2.0}),
    SamplingParams(max_tokens=16, temperature=0.7, seed=5, frequency_penalty=0.5),
]


@pytest.fixture(scope="module")
def engines(stories_engine) -> tuple[Engine, Engine]:
    """The shared (asynchronous) engine and a synchronous one on the same weights."""
    assert stories_engine.config.async_scheduling
    sync = Engine(
        dataclasses.replace(stories_engine.config, async_scheduling=False),
        model=stories_engine.model,
    )
    return stories_engine, sync


def _run(engine: Engine, jobs) -> dict:
    ids = {engine.add_request(prompt, params): k for k, (prompt, params) in enumerate(jobs)}
    got = {k: {"tokens": [], "text": "", "reason": None, "logprobs": []} for k in ids.values()}
    for out in drain(engine):
        entry = got[ids[out.request_id]]
        entry["tokens"] += out.new_token_ids
        entry["text"] += out.text_delta
        entry["logprobs"] += [(lp.token_id, round(lp.logprob, 4)) for lp in out.logprobs or []]
        if out.finished:
            entry["reason"] = out.finish_reason
    assert engine.scheduler.num_pages_used == 0 and engine.scheduler.num_slots_used == 0
    return got


def test_async_equals_sync_token_for_token(engines):
    jobs = [(p, params) for p in PROMPTS[:3] for params in PARAMS]
    async_engine, sync_engine = engines
    fast, slow = _run(async_engine, jobs), _run(sync_engine, jobs)
    assert fast == slow
    reasons = {entry["reason"] for entry in fast.values()}
    assert reasons == {"stop", "length"}  # both kinds of ending were exercised
    assert any(entry["logprobs"] for entry in fast.values())


def test_an_abort_while_its_next_step_is_in_flight_emits_nothing_more(engines):
    engine, sync_engine = engines
    other_params = SamplingParams(max_tokens=12, temperature=0)
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True))
    other = engine.add_request(PROMPTS[1], other_params)
    emitted, other_tokens = [], []
    while len(emitted) < 5:
        for o in engine.step():
            (emitted if o.request_id == rid else other_tokens).extend(o.new_token_ids)
    # The step that samples its next token was dispatched before the host saw the last one.
    assert any(s.request_id == rid for s in engine._inflight[-1].plan.seqs)
    engine.abort(rid)
    rest = drain(engine)
    after = [o for o in rest if o.request_id == rid]
    assert [t for o in after for t in o.new_token_ids] == []
    assert after[-1].finished and after[-1].finish_reason == "abort"
    assert after[-1].num_output_tokens == len(emitted)
    assert engine.scheduler.num_pages_used == 0 and engine.scheduler.num_slots_used == 0
    # The other request went on undisturbed: its tokens equal a run of it alone.
    other_tokens += [t for o in rest if o.request_id == other for t in o.new_token_ids]
    alone = _run(sync_engine, [(PROMPTS[1], other_params)])[0]["tokens"]
    assert other_tokens == alone and len(alone) == 12
