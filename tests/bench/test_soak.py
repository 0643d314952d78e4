"""`jaxserve bench --soak`: a 12-second soak of a real `jaxserve serve` must end clean, and the
soak's own checks must flag the faults it exists to find."""

from __future__ import annotations

import json
import subprocess
import sys

from jaxserve.bench.soak import (
    EXPECTED,
    Outcome,
    Plan,
    ServerProcess,
    _Observed,
    _report,
    check_answer,
    format_report,
    rss_timeline,
)
from service.gen.jaxserve.v1 import jaxserve_pb2 as pb
from tests.service.conftest import SMALL

# The service tests' two-bucket engine: quick to compile, 8 slots to share out.
SERVE = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items() if k != "max_waiting_requests"]


def test_12_second_soak_leaks_nothing_compiles_nothing_and_answers_as_expected(tmp_path):
    out = tmp_path / "soak"
    # 12 s at 0.9 x the capacity of 8 slots is still hundreds of requests on an idle machine (and
    # dozens on a loaded one): enough for every fate below, at 20 s less of CI than 30 s.
    cmd = [sys.executable, "-m", "jaxserve.cli", "bench", "--soak", "12", "--soak-probe", "3"]
    cmd += [*SERVE, "--prompt-range", "8:96", "--output-range", "4:48", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert (out / "soak.json").exists(), proc.stderr[-3000:]
    report = json.loads((out / "soak.json").read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert report["ok"] and report["failures"] == []
    assert report["unexpected"]["count"] == 0, report["unexpected"]["examples"]
    assert report["wrong_answers"]["count"] == 0, report["wrong_answers"]["examples"]
    assert report["idle"]
    assert report["leaks"] == {
        "slots_used": 0,
        "kv_pages_used": 0,
        "num_running": 0,
        "num_waiting": 0,
    }
    assert report["compiles_after_warmup"] == 0
    assert report["server_exit_code"] == 0
    # The traffic did what a soak promises: cancels and deadlines cut requests short, and the
    # client's tally agrees with the server's own count of Generate calls (less those cancelled
    # or expired before they reached it).
    fates = report["by_fate"]
    cancelled = fates["cancel"].get("CANCELLED", 0)
    assert cancelled > 0
    assert sum(fates["deadline"].values()) > 0
    assert sum(report["by_code"].values()) == report["requests"] > 30
    server_generates = sum(
        n for key, n in report["server_calls"].items() if key.split("/")[1].startswith("Generate")
    )
    sent = report["requests"] + report["probe_requests"]
    cut_short = cancelled + fates["deadline"].get("DEADLINE_EXCEEDED", 0)
    assert sent - cut_short <= server_generates <= sent
    rss = report["rss_mib"]
    assert all(rss[k] > 0 for k in ("ready", "start", "middle", "end"))
    assert "soak: PASS" in proc.stdout


def _plan(**sampling) -> Plan:
    return Plan(7, "normal", "stream", "r7", [5, 6, 7], None, {"ignore_eos": True, **sampling})


def _final(prompt_tokens: int, token_ids: list[int], reason=pb.FINISH_REASON_LENGTH, rid="r7"):
    resp = pb.GenerateResponse(request_id=rid, token_ids=token_ids, finish_reason=reason)
    resp.usage.prompt_tokens, resp.usage.completion_tokens = prompt_tokens, len(token_ids)
    return resp


def _check(plan, tokens, last, seen=None) -> list[str]:
    import threading

    return check_answer(
        plan, plan.ids, tokens, 0, last, {} if seen is None else seen, threading.Lock()
    )


def test_check_answer_flags_another_requests_answer():
    plan = _plan(max_tokens=4, temperature=0.0)
    assert _check(plan, [1, 2, 3, 4], _final(3, [1, 2, 3, 4])) == []
    # Defect 1 of issue 15: the answer of a request with another prompt, or an aborted one.
    wrong_prompt = _check(plan, [1, 2, 3, 4], _final(9, [1, 2, 3, 4]))
    assert len(wrong_prompt) == 1 and "usage.prompt_tokens=9" in wrong_prompt[0]
    aborted = _check(plan, [1, 2], _final(3, [1, 2], pb.FINISH_REASON_ABORT))
    assert any("finish_reason=abort" in p for p in aborted)
    assert any(
        "request_id 'other'" in p
        for p in _check(plan, [1, 2, 3, 4], _final(3, [1, 2, 3, 4], rid="other"))
    )
    # EOS ignored: exactly max_tokens, else tokens went missing on the way.
    assert any("EOS ignored" in p for p in _check(plan, [1, 2], _final(3, [1, 2])))


def test_check_answer_compares_repeated_greedy_prompts():
    seen: dict = {}
    plan = _plan(max_tokens=4, temperature=0.0)
    assert _check(plan, [1, 2, 3, 4], _final(3, [1, 2, 3, 4]), seen) == []
    shorter = _plan(max_tokens=2, temperature=0.0)
    assert _check(shorter, [1, 2], _final(3, [1, 2]), seen) == []  # a prefix agrees
    differs = _check(plan, [1, 2, 9, 4], _final(3, [1, 2, 9, 4]), seen)
    assert len(differs) == 1 and "greedy answer" in differs[0]
    sampled = _plan(max_tokens=4, temperature=0.8, seed=1)  # not greedy: never compared
    assert _check(sampled, [8, 8, 8, 8], _final(3, [8, 8, 8, 8]), seen) == []


class _StoppedServer(ServerProcess):
    """A ServerProcess that never ran: `_report` reads only its log state."""

    def __init__(self):
        self.tail, self.errors, self.ready_info = [], [], {}


def test_report_fails_on_leaks_compiles_unexpected_codes_and_exit_status():
    info = pb.ModelInfo(model="m", dtype="float32", context_length=64)
    idle = {
        f"jaxserve_{k}": 0.0 for k in ("slots_used", "kv_pages_used", "num_running", "num_waiting")
    }
    clean = _Observed(
        info=info,
        warm_metrics={"jaxserve_compiles_total": 2.0},
        final_metrics={**idle, "jaxserve_compiles_total": 2.0},
        idle=True,
        outcomes=[
            Outcome(_plan(), "OK"),
            Outcome(Plan(8, "cancel", "unary", "", [1], None, {}), "CANCELLED"),
        ],
        exit_code=0,
    )
    server = _StoppedServer()
    assert _report(_spec(), server, clean)["failures"] == []
    # A cancelled request whose id a later one reuses may find the id taken: no failure.
    shared = Plan(9, "cancel", "stream", "r9", [1], None, {}, id_shared=True)
    lent = _Observed(**{**clean.__dict__, "outcomes": [Outcome(shared, "INVALID_ARGUMENT")]})
    assert _report(_spec(), server, lent)["failures"] == []
    cases = {
        "leak": dict(
            final_metrics={**idle, "jaxserve_kv_pages_used": 3.0, "jaxserve_compiles_total": 2.0}
        ),
        "compile": dict(final_metrics={**idle, "jaxserve_compiles_total": 3.0}),
        "unexpected": dict(outcomes=[Outcome(_plan(), "INTERNAL", "boom")]),
        "cancel answered INVALID_ARGUMENT": dict(
            outcomes=[Outcome(Plan(8, "cancel", "unary", "", [1], None, {}), "INVALID_ARGUMENT")]
        ),
        "exit status": dict(exit_code=1),
        "died": dict(died=True, exit_code=-9),
    }
    for name, change in cases.items():
        seen = _Observed(**{**clean.__dict__, **change})
        report = _report(_spec(), server, seen)
        assert not report["ok"] and len(report["failures"]) == 1, (name, report["failures"])
    assert "INVALID_ARGUMENT" in EXPECTED["reuse"] and "INVALID_ARGUMENT" not in EXPECTED["normal"]


def test_report_gives_rss_over_time_its_growth_and_the_host_kv_tier():
    info = pb.ModelInfo(model="m", dtype="float32", context_length=64)
    mib = 2**20
    samples = [(t, (100 + t) * mib) for t in (1.0, 2.0, 9.9, 10.0, 10.5, 25.0, 31.0)]
    thinned = [[1.0, 101.0], [10.0, 110.0], [25.0, 125.0], [31.0, 131.0]]
    assert rss_timeline(samples, 10.0) == thinned
    assert rss_timeline([], 10.0) == []
    server = _StoppedServer()
    server.ready_info = {"kv_bytes": 8 * mib, "host_kv_bytes": 16 * mib, "host_kv_pages": 64}
    final = {"jaxserve_host_kv_pages_used": 40.0}
    seen = _Observed(info=info, rss=samples, rss_start=100 * mib, traffic_s=31.0, exit_code=0)
    seen.final_metrics = final
    report = _report(_spec(), server, seen)
    assert report["rss_mib"]["max"] == 131.0 and report["rss_mib"]["growth"] == 31.0
    assert report["rss_timeline_mib"][-1] == [31.0, 131.0]
    assert (report["server"]["kv_bytes"], report["server"]["host_kv_bytes"]) == (8 * mib, 16 * mib)
    text = format_report(report)
    assert "(growth 31.0)" in text
    assert "host KV tier: 16.0 MiB, 40 of its 64 pages used once idle (device pool 8.0" in text


def _spec():
    from jaxserve.bench.soak import SoakSpec

    return SoakSpec(duration_s=1.0)
