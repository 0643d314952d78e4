"""Beam search over the engine (jaxserve/engine/beam_search.py) on the embedded stories260k model.

The reference is a brute-force beam search written here on transformers' PyTorch forward: every
beam's whole sequence recomputed each step, the 2k best (beam, token) pairs taken over all beams
at once, and the rule of beam_search.py's docstring applied to them (Hugging Face's num_beams
search with early_stopping=True).
"""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from checkpoints import DEFAULT_MODEL_DIR
from jaxserve.engine import beam_search
from jaxserve.engine.beam_search import BeamSearch
from jaxserve.engine.llm import LLM
from jaxserve.sampling_params import SamplingParams
from service.gen.jaxserve.v1 import jaxserve_pb2 as pb
from tests.service.conftest import serving
from tests.torch_reference import require_torch

PROMPTS = ["Once upon a time", "Lily was sad. She cried and"]
PERIOD = 426  # "." in stories260k's vocabulary: as a stop token it ends beams at uneven lengths


@pytest.fixture(scope="module")
def hf():
    # One thread: the reference's tiny matmuls take ~1 ms on one, and up to 100x that when two
    # threads contend with the engine's (and a busy CI machine's) for the 2 cores.
    torch = require_torch()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, torch_dtype=torch.float32).eval()
    torch.set_num_threads(threads)


def reference_beam_search(hf, prompt, k, max_tokens, length_penalty, end_ids):
    """[(tokens, cumulative logprob, score)] best first, recomputing every beam from scratch."""
    torch = require_torch()
    live, finished = [([], 0.0)], []
    while True:
        batch = torch.tensor([prompt + tokens for tokens, _ in live])
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(batch).logits[:, -1].double(), dim=-1)
        totals = torch.tensor([s for _, s in live], dtype=torch.float64)[:, None] + logprobs
        values, flat = torch.topk(totals.flatten(), 2 * k)
        vocab = logprobs.shape[-1]
        next_live = []
        for rank, (value, index) in enumerate(zip(values.tolist(), flat.tolist(), strict=True)):
            tokens = live[index // vocab][0] + [index % vocab]
            if index % vocab in end_ids:
                if rank < k:
                    finished.append((tokens, value, value / len(tokens) ** length_penalty))
            elif len(next_live) < k:
                next_live.append((tokens, value))
        finished = sorted(finished, key=lambda h: -h[2])[:k]
        if len(finished) >= k:
            return finished
        if not next_live or len(next_live[0][0]) == max_tokens:
            finished += [(t, s, s / len(t) ** length_penalty) for t, s in next_live]
            return sorted(finished, key=lambda h: -h[2])[:k]
        live = next_live


def test_width_one_is_greedy(stories_engine):
    compiles = stories_engine.runner.num_compiles
    llm = LLM(engine=stories_engine)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    beams = llm.beam_search(PROMPTS, beam_width=1, max_tokens=10)
    assert [b[0].token_ids for b in beams] == [g.token_ids for g in greedy]
    assert [b[0].text for b in beams] == [g.text for g in greedy]
    # A stop token ends the greedy output and the single beam at the same place.
    greedy = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[PERIOD])
    )
    beams = llm.beam_search(PROMPTS, beam_width=1, max_tokens=12, stop_token_ids=[PERIOD])
    assert [b[0].token_ids for b in beams] == [g.token_ids for g in greedy]
    assert [b[0].finish_reason for b in beams] == [g.finish_reason for g in greedy]
    assert stories_engine.runner.num_compiles == compiles


@pytest.mark.parametrize(
    "prompt, length_penalty, stop",
    [(PROMPTS[0], 1.0, ()), (PROMPTS[1], 0.5, (PERIOD,))],
    ids=["plain", "stop-token-and-penalty"],
)
def test_width_four_matches_brute_force_reference(stories_engine, hf, prompt, length_penalty, stop):
    compiles = stories_engine.runner.num_compiles
    ids = stories_engine.encode(prompt)
    end_ids = {*stories_engine.model.config.eos_token_ids, *stop}
    want = reference_beam_search(hf, ids, 4, 10, length_penalty, end_ids)
    (got,) = LLM(engine=stories_engine).beam_search(
        [ids], beam_width=4, max_tokens=10, length_penalty=length_penalty, stop_token_ids=stop
    )
    assert [b.token_ids for b in got] == [w[0] for w in want]
    np.testing.assert_allclose([b.cumulative_logprob for b in got], [w[1] for w in want], atol=1e-3)
    np.testing.assert_allclose([b.score for b in got], [w[2] for w in want], atol=1e-3)
    if stop:  # the case is chosen so that a beam ends early, and ranking by score matters
        assert {len(b.token_ids) for b in got} != {10}
    assert stories_engine.runner.num_compiles == compiles


def test_beam_search_beside_ordinary_requests_changes_nothing(stories_engine):
    llm = LLM(engine=stories_engine)
    ordinary = [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12),
    ]
    prompts = ["One day, a dog", "The sun was"]
    alone = llm.generate(prompts, ordinary)
    beam = SamplingParams(beam_width=3, max_tokens=8)
    compiles = stories_engine.runner.num_compiles
    mixed = llm.generate([PROMPTS[0], *prompts, PROMPTS[1]], [beam, *ordinary, beam])
    assert [m.token_ids for m in mixed[1:3]] == [a.token_ids for a in alone]
    beams_alone = llm.beam_search([PROMPTS[0], PROMPTS[1]], beam_width=3, max_tokens=8)
    for completion, beams in zip([mixed[0], mixed[3]], beams_alone, strict=True):
        assert [b.token_ids for b in completion.beams] == [b.token_ids for b in beams]
        assert completion.token_ids == beams[0].token_ids
        assert completion.text == beams[0].text
    assert stories_engine.runner.num_compiles == compiles


def test_beams_take_their_parents_pages_from_the_prefix_cache(stories_engine):
    page = stories_engine.config.page_size
    # No BOS: the engine is the module's, and a cached prompt of another test must not agree.
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 500, 2 * page + 8)]
    search = beam_search.start_search(
        stories_engine, prompt, SamplingParams(beam_width=4, max_tokens=8, ignore_eos=True)
    )
    (beams,) = beam_search.run(stories_engine, [search])
    assert len(beams) == 4 and all(len(b.token_ids) == 8 for b in beams)
    computed = search.num_prompt_tokens_sent - search.num_cached_tokens
    # After the first iteration each beam's prompt extends its parent's by one token: its full
    # pages come from the cache and its parent's partial page is forked (copied), so it
    # computes that one token alone.
    assert computed == len(prompt) + search.num_requests - 1
    assert search.num_prompt_tokens_sent > 2 * computed  # what the cache saved, roughly
    assert page > 1


def test_an_aborted_beam_request_ends_its_search_alone(stories_engine):
    params = SamplingParams(beam_width=3, max_tokens=8)
    doomed, fine = (beam_search.start_search(stories_engine, [1, 403, 407], params) for _ in "ab")
    driver = beam_search.BeamDriver(stories_engine)
    driver.submit(doomed)
    driver.submit(fine)
    while len(driver.request_ids(doomed)) < 3:  # its second iteration: one request per beam
        for out in stories_engine.step():
            assert driver.take(out)
    victim = driver.request_ids(doomed)[1]
    stories_engine.abort(victim)
    while stories_engine.has_unfinished():
        for out in stories_engine.step():
            assert driver.take(out)
    assert doomed.done and doomed.failure.request_id == victim
    assert doomed.failure.finish_reason == "abort" and doomed.result() == []
    assert driver.request_ids(doomed) == driver.request_ids(fine) == []
    (alone,) = beam_search.run(
        stories_engine, [beam_search.start_search(stories_engine, [1, 403, 407], params)]
    )
    assert [b.token_ids for b in fine.result()] == [b.token_ids for b in alone]
    # What gRPC answers for it: a last response with the abort and the request that had it.
    out = beam_search.best_output("call-1", doomed, [], arrival_time=0.0)
    assert out.finished and out.finish_reason == "abort" and out.new_token_ids == []
    assert victim in out.error


def test_end_tokens_ranked_past_the_width_are_dropped():
    search = BeamSearch([5], SamplingParams(beam_width=2, max_tokens=4), eos_token_ids=[0])
    # Ranks: 7 (-0.1), 0 = EOS (-0.5, rank 1 < 2: a hypothesis), 8 (-1.0), 9 (-2.0).
    search.advance([[(7, -0.1), (0, -0.5), (8, -1.0), (9, -2.0)]])
    assert [b.token_ids for b in search.live] == [[7], [8]]
    assert [(b.token_ids, b.finish_reason) for b in search.finished] == [([0], "stop")]
    # Offers from both beams ranked together: [7, 3] -0.2, [8, 4] -1.1, then EOS after [7] at
    # rank 2 (>= width: no hypothesis), so the search goes on.
    search.advance([[(3, -0.1), (0, -1.5)], [(4, -0.1), (5, -2.0)]])
    assert [b.token_ids for b in search.live] == [[7, 3], [8, 4]]
    assert len(search.finished) == 1 and not search.done
    # An end token at rank 0 completes the width: the search ends, best score first.
    search.advance([[(0, -0.1), (6, -0.2)], [(6, -0.1), (0, -0.2)]])
    assert search.done and search.live == []
    # Scores: [7, 3, 0] is -0.3 over 3 tokens, [0] -0.5 over 1; the live beams are dropped.
    assert [b.token_ids for b in search.result()] == [[7, 3, 0], [0]]
    assert all(math.isclose(b.score, s) for b, s in zip(search.result(), [-0.1, -0.5], strict=True))


def test_beam_params_are_validated():
    with pytest.raises(ValueError, match="beam_width=11"):
        SamplingParams(beam_width=11)
    with pytest.raises(ValueError, match="beam_width=0"):
        SamplingParams(beam_width=0)
    with pytest.raises(ValueError, match="length_penalty=nan"):
        SamplingParams(length_penalty=float("nan"))
    with pytest.raises(ValueError, match=r"temperature=0\.7, top_p=0\.9"):
        SamplingParams(beam_width=2, temperature=0.7, top_p=0.9)
    with pytest.raises(ValueError, match="stop="):
        SamplingParams(beam_width=2, stop=["."])
    assert SamplingParams(beam_width=2, temperature=0).beam_width == 2


def test_grpc_beam_search_sends_every_beam_in_one_last_response(stories_engine):
    (want,) = LLM(engine=stories_engine).beam_search(
        [PROMPTS[1]], beam_width=3, max_tokens=8, stop_token_ids=[PERIOD]
    )
    with serving(stories_engine) as server, server.client() as client:
        kwargs = dict(beam_width=3, max_tokens=8, stop_token_ids=[PERIOD])
        (streamed,) = list(client.generate(PROMPTS[1], **kwargs))
        unary = client.generate_unary(PROMPTS[1], **kwargs)
        with pytest.raises(grpc.RpcError) as refused:
            client.generate_unary(PROMPTS[1], beam_width=3, top_p=0.5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "beam_width=3" in refused.value.details() and "top_p=0.5" in refused.value.details()
    for response in (streamed, unary):
        assert list(response.token_ids) == want[0].token_ids and response.text == want[0].text
        assert [list(b.token_ids) for b in response.beams] == [b.token_ids for b in want]
        np.testing.assert_allclose(
            [b.cumulative_logprob for b in response.beams],
            [b.cumulative_logprob for b in want],
            atol=1e-5,
        )
        reasons = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
        assert [b.finish_reason for b in response.beams] == [reasons[b.finish_reason] for b in want]
        assert response.finish_reason == reasons[want[0].finish_reason]
        assert response.usage.completion_tokens == len(want[0].token_ids)


def test_the_engine_refuses_a_beam_request_it_would_only_sample(stories_engine):
    with pytest.raises(ValueError, match="beam_width=4 asks for a beam search"):
        stories_engine.add_request("Once upon a time", SamplingParams(beam_width=4))
    assert not stories_engine.has_unfinished()
