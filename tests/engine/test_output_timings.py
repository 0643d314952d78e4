"""The timings each output carries stay true while outputs share them between changes.

The output processor builds a request's `RequestMetrics` again only when its first token, a
preemption or its finish changes them (output_processor.py); these tests catch a stale share.
"""

from __future__ import annotations

from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import short_of_pages


def test_outputs_report_first_token_preemptions_and_finish_as_they_happen(stories_engine):
    """Pages for ~2.5 of 4 long requests, so requests are preempted mid-output."""
    engine = short_of_pages(stories_engine.model)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for prompt in ["Once upon a time", "Tom had a red ball", "The little dog", "A cat"]:
        engine.add_request(prompt, params)
    outputs, stale = [], []
    while engine.has_unfinished():
        step = engine.step()
        outputs += step
        for out in step:  # an unfinished request's timings as of now
            request = engine.scheduler.get_request(out.request_id)
            if not out.finished and out.metrics.num_preemptions != request.num_preemptions:
                stale.append((out.request_id, out.metrics.num_preemptions))
    assert engine.metrics.stats.num_preemptions > 0
    assert not stale, f"outputs with a preemption count behind their request's: {stale}"

    by_request: dict[str, list] = {}
    for out in outputs:
        by_request.setdefault(out.request_id, []).append(out)
    final_preemptions = 0
    for rid, outs in by_request.items():
        seen = 0
        for out in outs:
            m = out.metrics
            assert m.first_token_time is not None, f"{rid}: a token was out before its time"
            assert m.num_preemptions >= seen, f"{rid}: preemptions went back to {m.num_preemptions}"
            seen = m.num_preemptions
            # Finished only in the last output: no earlier output's timings were changed later.
            assert (m.finished_time is not None) == out.finished, rid
        assert outs[-1].finished
        final_preemptions += outs[-1].metrics.num_preemptions
    # Each preemption shows in its request's later outputs, none lost to a stale share.
    assert final_preemptions == engine.metrics.stats.num_preemptions
