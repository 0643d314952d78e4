"""`jaxserve batch` lines with beam_width > 1 (batch_job.EngineFeed) on stories260k: the line's
beams equal `LLM.beam_search`'s, ordinary lines beside it are untouched, and a rerun skips what
is written."""

from __future__ import annotations

import json
import math

from jaxserve.engine.llm import LLM
from jaxserve.jobs.batch_job import run_batch
from jaxserve.sampling_params import SamplingParams

PERIOD = 426  # "." in stories260k's vocabulary: as a stop token it ends beams at uneven lengths
BEAM_PROMPT = "Lily was sad. She cried and"
LINES = [
    {"id": "greedy", "prompt": "Once upon a time", "max_tokens": 10, "ignore_eos": True},
    {
        "id": "beams",
        "prompt": BEAM_PROMPT,
        "max_tokens": 12,
        "beam_width": 4,
        "length_penalty": 0.3,
        "stop_token_ids": [PERIOD],
    },
    {"id": "sampled", "prompt": "Tom had", "max_tokens": 10, "temperature": 0.8, "seed": 5},
]


def _records(path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_a_beam_line_holds_llm_beam_searchs_beams_and_reruns_skip_it(stories_engine, tmp_path):
    llm = LLM(engine=stories_engine)
    [want] = llm.beam_search(
        [BEAM_PROMPT], beam_width=4, max_tokens=12, length_penalty=0.3, stop_token_ids=[PERIOD]
    )
    assert {b.finish_reason for b in want} == {"stop", "length"}, "beams of uneven lengths"
    greedy, sampled = llm.generate(
        [LINES[0]["prompt"], LINES[2]["prompt"]],
        [
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=0.8, seed=5),
        ],
    )
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in LINES))

    summary = run_batch(stories_engine, inp, out, include_token_ids=True, progress=False)
    assert summary.completed == 3 and not summary.bad_lines
    records = _records(out)
    got = records["beams"]
    assert [b["token_ids"] for b in got["beams"]] == [b.token_ids for b in want]
    assert [b["text"] for b in got["beams"]] == [b.text for b in want]
    assert [b["finish_reason"] for b in got["beams"]] == [b.finish_reason for b in want]
    for g, w in zip(got["beams"], want, strict=True):
        assert math.isclose(g["cumulative_logprob"], w.cumulative_logprob, abs_tol=1e-4)
        assert math.isclose(g["score"], w.score, abs_tol=1e-4)
    # The best beam where any line's result goes.
    best = want[0]
    assert got["text"] == best.text and got["token_ids"] == best.token_ids
    assert got["output_tokens"] == len(best.token_ids)
    assert got["finish_reason"] == best.finish_reason
    assert got["prompt_tokens"] == len(stories_engine.encode(BEAM_PROMPT))
    assert "error" not in got
    # The lines beside the search: as without it, and without beams.
    assert records["greedy"]["token_ids"] == greedy.token_ids
    assert records["sampled"]["token_ids"] == sampled.token_ids
    assert "beams" not in records["greedy"] and "beams" not in records["sampled"]

    # A rerun writes nothing; with the beam line's result lost (as if killed before writing it)
    # the rerun runs that line alone, to the same record.
    written = out.read_bytes()
    again = run_batch(stories_engine, inp, out, include_token_ids=True, progress=False)
    assert (again.already_done, again.completed) == (3, 0) and out.read_bytes() == written
    out.write_text("".join(json.dumps(r) + "\n" for r in records.values() if r["id"] != "beams"))
    again = run_batch(stories_engine, inp, out, include_token_ids=True, progress=False)
    assert (again.already_done, again.completed) == (2, 1)
    # Alone the line runs in other token buckets than beside the others: the same tokens and
    # text, its log-probabilities equal up to the float differences of another bucket's step.
    rerun = _records(out)["beams"]
    scores = ("cumulative_logprob", "score")
    assert {k: v for k, v in rerun.items() if k != "beams"} == {
        k: v for k, v in got.items() if k != "beams"
    }
    for r, g in zip(rerun["beams"], got["beams"], strict=True):
        assert {k: v for k, v in r.items() if k not in scores} == {
            k: v for k, v in g.items() if k not in scores
        }
        for key in scores:
            assert math.isclose(r[key], g[key], abs_tol=1e-4), (key, r[key], g[key])


def test_bad_beam_lines_are_reported_and_skipped(stories_engine, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"id": "hot", "prompt": "Tom had", "beam_width": 3, "temperature": 0.7},
        {"id": "wide", "prompt": "Tom had", "beam_width": 11},
        {"id": "long", "prompt": "Tom had", "beam_width": 2, "max_tokens": 10**6},
        {"id": "vocab", "prompt_token_ids": [1, 10**6], "beam_width": 2},
        {"id": "ok", "prompt": "Tom had", "beam_width": 2, "max_tokens": 3},
    ]
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = run_batch(stories_engine, inp, out, progress=False, log=print)
    reasons = dict(summary.bad_lines)
    assert sorted(reasons) == [1, 2, 3, 4]
    assert "beam_width=3" in reasons[1] and "temperature=0.7" in reasons[1]
    assert "beam_width=11" in reasons[2]
    assert "max_tokens=1000000" in reasons[3]
    assert "1000000" in reasons[4] and "vocabulary" in reasons[4]
    assert list(_records(out)) == ["ok"] and len(_records(out)["ok"]["beams"]) == 2
    assert not stories_engine.has_unfinished()
