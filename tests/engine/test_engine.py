"""The engine end to end on stories260k: parity, batch invariance, aborts, stops, compiles."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from checkpoints import DEFAULT_MODEL_DIR
from jaxserve.engine.llm import LLM
from jaxserve.runtime import compiles
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import drain
from tests.torch_reference import require_torch

PROMPTS = [
    "Once upon a time",
    "Tom had a red ball",
    "The little dog",
    "One day, Lily went to the park with her mom. She saw",
    "Sam",
    "The sun was hot and the birds",
    "Mia and Ben found a big box in the garden. Inside the box there was",
    "A cat",
]


def test_greedy_matches_transformers_generate(stories_engine):
    """Eight prompts batched in the engine give exactly transformers' greedy tokens."""
    torch = require_torch()
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, torch_dtype=torch.float32)
    llm = LLM(engine=stories_engine)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([out.prompt_token_ids])
        ref = hf.generate(
            ids, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids)
        )
        expected = ref[0, ids.shape[1] :].tolist()
        assert out.token_ids == expected, prompt


def test_batch_invariance_greedy_and_seeded(stories_engine):
    """16 concurrent requests give exactly the tokens each gives alone."""
    tok = stories_engine.tokenizer
    prompts = [tok(p)["input_ids"][: 3 + i % 9] for i, p in enumerate(PROMPTS * 2)]
    params = [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(
            max_tokens=20, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True
        )
        for i in range(16)
    ]
    llm = LLM(engine=stories_engine)
    together = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        alone = llm.generate([prompt], p)[0]
        assert out.token_ids == alone.token_ids
        assert len(out.token_ids) == 20


def test_seeded_sampling_is_reproducible_and_seed_dependent(stories_engine):
    llm = LLM(engine=stories_engine)
    p = dict(max_tokens=24, temperature=1.0, ignore_eos=True)
    a, b, c = llm.generate(
        ["Once upon a time"] * 3,
        [SamplingParams(seed=1, **p), SamplingParams(seed=1, **p), SamplingParams(seed=2, **p)],
    )
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_is_never_streamed(stories_engine):
    """The stop text and anything after it never reach the client; the reason is 'stop'."""
    engine = stories_engine
    rid = engine.add_request(
        "Once upon a time", SamplingParams(max_tokens=60, temperature=0, stop=("girl named",))
    )
    outs = [o for o in drain(engine) if o.request_id == rid]
    text = "".join(o.text_delta for o in outs)
    assert text == ", there was a little "
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert not any("girl" in o.text_delta for o in outs)


def test_eos_stops_and_length_limits(stories_engine):
    llm = LLM(engine=stories_engine)
    long, short, custom = llm.generate(
        ["Once upon a time"] * 3,
        [
            SamplingParams(max_tokens=400, temperature=0),
            SamplingParams(max_tokens=5, temperature=0),
            SamplingParams(max_tokens=50, temperature=0, stop_token_ids=(383,)),
        ],
    )
    assert long.finish_reason == "stop" and long.token_ids[-1] in (1, 2)
    assert short.finish_reason == "length" and len(short.token_ids) == 5
    # Greedy continues 432, 383: the custom stop id ends it right there.
    assert custom.finish_reason == "stop" and custom.token_ids == [432, 383]


def test_logprobs_are_log_probabilities(stories_engine):
    out = LLM(engine=stories_engine).generate(
        ["Once upon a time"], SamplingParams(max_tokens=4, temperature=0, logprobs=5)
    )[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token
        assert len(lp.top) == 5
        top_ids, top_lps = zip(*lp.top, strict=True)
        assert top_ids[0] == token  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(top_lps[0])
        assert list(top_lps) == sorted(top_lps, reverse=True)
        assert 0 < np.exp(top_lps).sum() <= 1 + 1e-5


def test_aborting_100_requests_frees_every_slot_and_page(stories_engine):
    engine = stories_engine
    ids = [
        engine.add_request(f"Story number {i}", SamplingParams(max_tokens=200, ignore_eos=True))
        for i in range(100)
    ]
    for _ in range(5):
        engine.step()
    assert engine.scheduler.num_slots_used > 0
    for rid in ids:
        engine.abort(rid)
    outs = drain(engine)
    finished = {o.request_id: o.finish_reason for o in outs if o.finished}
    assert set(finished) == set(ids)
    assert set(finished.values()) == {"abort"}
    assert engine.scheduler.num_slots_used == 0
    assert engine.scheduler.num_pages_used == 0


def test_mixed_workload_never_compiles_after_warmup(stories_engine):
    """Prefill-only, decode-only, mixed and chunked-prefill iterations reuse precompiled shapes."""
    engine = stories_engine
    before = engine.runner.num_compiles
    serving = compiles.serving()  # the process's: other tests' engines compile between tests
    tok = engine.tokenizer
    long_prompt = tok("Once upon a time, " * 30)["input_ids"]  # > 64 tokens: chunked prefill
    assert len(long_prompt) > 64
    engine.add_request(long_prompt, SamplingParams(max_tokens=8, temperature=0))
    for i in range(12):
        engine.add_request(PROMPTS[i % 8], SamplingParams(max_tokens=3 + i, temperature=0.7))
        engine.step()  # joins while others decode: mixed iterations
    drain(engine)
    assert engine.runner.num_compiles == before
    assert compiles.serving() == serving, f"compiled after warm-up: {compiles.recent()}"


def test_a_stop_token_ends_the_request_and_its_text_is_not_sent(stories_engine):
    """The stop id is the last token id out, and no text of it reaches the client."""
    llm = LLM(engine=stories_engine)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    free = llm.generate([PROMPTS[0]], greedy)[0].token_ids
    stop = free[5]
    first = free.index(stop)  # the first time the stop id comes out
    out = llm.generate([PROMPTS[0]], dataclasses.replace(greedy, stop_token_ids=(stop,)))
    assert out[0].token_ids == free[: first + 1]
    tok = stories_engine.tokenizer
    assert out[0].text == tok.decode(free[:first], skip_special_tokens=True)
