"""Per-request fault isolation: a failure while making one request's output ends that request
with finish reason `error`; the others run on with the same tokens, and nothing leaks."""

from __future__ import annotations

import pytest

from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import drain

PROMPTS = ["Once upon a time", "The sun was hot", "Lily went to the park", "A big box"]
OTHERS = [(f"ok-{i}", PROMPTS[i % 4], 10 + i) for i in range(8)]  # (id, prompt, max_tokens)


def _run(engine, requests, hook=None) -> dict[str, list]:
    """Runs (id, prompt, max_tokens) greedy requests together; returns each one's outputs."""
    engine.outputs.fault_hook = hook
    try:
        for rid, prompt, n in requests:
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            engine.add_request(prompt, params, request_id=rid)
        outputs: dict[str, list] = {rid: [] for rid, _, _ in requests}
        for out in drain(engine):
            outputs[out.request_id].append(out)
    finally:
        engine.outputs.fault_hook = None
    engine.scheduler.check_invariants()
    assert engine.scheduler.num_pages_used == 0 and engine.scheduler.num_slots_used == 0
    return outputs


@pytest.mark.parametrize("fault_at", [3, 12], ids=["mid-stream", "on-its-last-token"])
def test_fault_in_one_requests_output_ends_it_with_error_and_spares_8_others(
    stories_engine, fault_at
):
    engine = stories_engine
    want = _run(engine, OTHERS)
    seen = {"bad": 0}

    def hook(request_id):
        if request_id == "bad":
            seen["bad"] += 1
            if seen["bad"] == fault_at:
                raise RuntimeError("injected detokenizer failure")

    got = _run(engine, [*OTHERS[:4], ("bad", PROMPTS[0], 12), *OTHERS[4:]], hook)

    bad = got.pop("bad")
    assert seen["bad"] == fault_at  # nothing was processed for it after the fault
    assert len(bad) == fault_at
    assert [o.finished for o in bad] == [False] * (fault_at - 1) + [True]
    last = bad[-1]
    assert last.finish_reason == "error"
    assert "injected detokenizer failure" in last.error
    assert last.num_output_tokens == fault_at  # one token per output; the last one's unsent
    assert sum(len(o.new_token_ids) for o in bad) == fault_at - 1
    for rid, outs in got.items():
        assert outs[-1].finish_reason == "length" and outs[-1].error is None
        assert [t for o in outs for t in o.new_token_ids] == [
            t for o in want[rid] for t in o.new_token_ids
        ]
        assert "".join(o.text_delta for o in outs) == "".join(o.text_delta for o in want[rid])
    assert engine.metrics.stats.finished.get("error", 0) >= 1


def test_engine_serves_new_requests_after_an_output_fault(stories_engine):
    engine = stories_engine

    def hook(request_id):
        raise ValueError(f"injected fault for {request_id}")

    got = _run(engine, [("doomed", PROMPTS[1], 6)], hook)
    assert [o.finish_reason for o in got["doomed"]] == ["error"]
    assert "doomed" in got["doomed"][0].error
    again = _run(engine, [("doomed", PROMPTS[1], 6)])  # the same id is free again
    assert again["doomed"][-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in again["doomed"]) == 6
