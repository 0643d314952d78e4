"""Bench traffic, metrics and the batch job's output recovery: plain Python, no model."""

from __future__ import annotations

import json
import math

import pytest

from jaxserve.bench.metrics import SLO, distribution, summarize
from jaxserve.bench.runner import RequestRecord, RunResult, Timeline
from jaxserve.bench.workload import (
    Burst,
    LengthMix,
    TraceError,
    load_trace,
    mixed_workloads,
    poisson_arrivals,
    random_prompt_ids,
    repetitive_workloads,
)
from jaxserve.jobs.batch_job import OutputCorrupt, parse_line, recover_output
from jaxserve.sampling_params import SamplingParams


def test_mixed_loads_share_lengths_and_differ_only_in_arrivals():
    mix = LengthMix(prompt_range=(32, 128), output_range=(16, 64), long_share=0.3)
    slow, fast = mixed_workloads([1.0, 8.0], num_requests=400, mix=mix, seed=3)
    lengths = lambda w: sorted((r.prompt_len, r.max_tokens) for r in w.requests)  # noqa: E731
    assert lengths(slow) == lengths(fast)
    assert all(32 <= r.prompt_len <= 128 and 16 <= r.max_tokens <= 64 for r in slow.requests)
    long = sum(r.prompt_len > 80 for r in slow.requests) / 400
    assert 0.2 < long < 0.4  # the long share, not a uniform draw (which would give ~0.5)
    span = lambda w: w.requests[-1].arrival_s  # noqa: E731
    assert span(slow) == pytest.approx(8 * span(fast))  # same seeded gaps, scaled by the rate
    assert span(slow) == pytest.approx(399, rel=0.2)  # Poisson: mean gap 1/rate


def test_burst_arrives_together_and_infinite_rate_sends_all_at_once():
    (w,) = mixed_workloads([2.0], num_requests=10, mix=LengthMix(), burst=Burst.parse("5@1.5"))
    assert len(w.requests) == 15
    assert sum(r.arrival_s == 1.5 for r in w.requests) >= 5
    assert [r.arrival_s for r in w.requests] == sorted(r.arrival_s for r in w.requests)
    assert poisson_arrivals(4, math.inf) == [0.0] * 4
    with pytest.raises(ValueError, match="N@T"):
        Burst.parse("five")


def test_trace_errors_name_the_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"arrival_time": 0.5, "prompt_len": 40, "max_tokens": 8}\n'
        "\n"
        '{"arrival_time": 0.1, "prompt_token_ids": [5, 6, 7], "max_tokens": 2, "id": "x"}\n'
    )
    w = load_trace(trace)
    assert [(r.request_id, r.prompt_len) for r in w.requests] == [("x", 3), ("t1", 40)]
    trace.write_text('{"arrival_time": 0, "prompt_len": 4, "max_tokens": 1}\n{"max_tokens": 2}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:2: give exactly one of"):
        load_trace(trace)


def _record(i, *, ttft, tpot, out=11, reason="length"):
    arrival = float(i)
    first = arrival + ttft
    return RequestRecord(
        f"r{i}", 20, out, arrival, arrival + ttft / 2, first, first + tpot * (out - 1), reason
    )


def test_summary_goodput_counts_requests_meeting_both_targets():
    """Worked example: 4 requests over 10 s; only r0 and r3 meet TTFT <= 1 s, TPOT <= 125 ms.

    (Binary fractions throughout, so "exactly on the target" is exact in floating point.)"""
    records = [
        _record(0, ttft=0.5, tpot=0.0625),
        _record(1, ttft=2.0, tpot=0.0625),  # TTFT too slow
        _record(2, ttft=0.5, tpot=0.25),  # TPOT too slow
        _record(3, ttft=1.0, tpot=0.125),  # exactly on both targets: good
    ]
    workload = mixed_workloads([1.0], num_requests=4, mix=LengthMix())[0]
    result = RunResult(
        label="x",
        workload=workload,
        records=records,
        duration_s=10.0,
        max_num_seqs=4,
        kv_pages_total=10,
        timeline=Timeline([1.0, 3.0], [4, 2], [0, 0], [10, 5]),
    )
    s = summarize(result, SLO(ttft_s=1.0, tpot_s=0.125))
    assert s["good_requests"] == 2 and s["goodput"] == pytest.approx(0.2)
    assert s["request_throughput"] == pytest.approx(0.4)
    assert s["output_token_throughput"] == pytest.approx(4.4)
    assert s["ttft"]["p50"] == pytest.approx(0.75) and s["ttft"]["max"] == pytest.approx(2.0)
    assert s["queue_wait"]["mean"] == pytest.approx(0.5)
    # KV: full for the first 1 s, half for the next 2 s: time-weighted mean 2/3.
    assert s["kv_cache"]["peak_use"] == 1.0
    assert s["kv_cache"]["mean_use"] == pytest.approx(2 / 3)
    assert distribution([None])["p99"] is None


def test_recover_output_cuts_a_torn_tail_and_refuses_foreign_lines(tmp_path):
    out = tmp_path / "out.jsonl"
    good = b'{"id": "a", "text": "x"}\n{"id": 7, "text": "y"}\n'
    out.write_bytes(good + b'{"id": "c", "te')
    assert recover_output(out) == ({"a", "7"}, True)
    assert out.read_bytes() == good
    assert recover_output(out) == ({"a", "7"}, False)
    out.write_bytes(b'{"id": "a"}\nnot a result\n{"id": "b"}\n')
    with pytest.raises(OutputCorrupt, match="line 2"):
        recover_output(out)


def test_parse_line_reasons():
    d = SamplingParams(max_tokens=8)
    assert parse_line(b'{"prompt": "hi"}', 3, d) == ("line-3", "hi", d, None)
    rid, ids, p, lora = parse_line(
        json.dumps({"id": 5, "prompt_token_ids": [1, 2], "max_tokens": 2, "lora": "sql"}).encode(),
        1,
        d,
    )
    assert (rid, ids, p.max_tokens, lora) == ("5", [1, 2], 2, "sql")
    for raw, reason in [
        (b"{oops", "not valid JSON"),
        (b"[1]", "JSON object"),
        (b'{"id": "a"}', "exactly one of"),
        (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens=0"),
        (b'{"prompt": "hi", "stop": 5}', "sampling options"),
        (b'{"prompt": "hi", "lora": 3}', "lora 3 must be the name"),
        (b'\xff{"prompt": 1}', "UTF-8"),
    ]:
        with pytest.raises(ValueError, match=reason):
            parse_line(raw, 1, d)


def test_repetitive_prompts_say_their_own_passage_again():
    (w,) = repetitive_workloads(num_requests=3, prompt_len=50, max_tokens=8)
    assert (w.concurrency, len(w.requests)) == (1, 3)
    prompts = [random_prompt_ids(s, 512, seed=1) for s in w.requests]
    for ids in prompts:
        assert len(ids) == 50 and ids[:17] == ids[17:34] and ids[34:] == ids[:16]
    assert prompts[0][:17] != prompts[1][:17]  # each request its own passage
