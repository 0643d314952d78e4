"""Structured output end to end: whatever random or tiny weights would say, the constraint holds.

Samples at temperature 1.0 from the embedded stories260k (a byte-fallback SentencePiece
vocabulary) and from a random Qwen3 shape with a byte-level BPE tokenizer, on an engine short
of pages (so grammar rows are preempted and recomputed mid-output). The acceptance's 200
samples per model run in `python -m jaxserve.bench.structured` (docs/benchmarks.md); these
tests take fewer to keep CI short.
"""

from __future__ import annotations

import dataclasses
import re

import jsonschema
import pytest

from checkpoints import load_model
from checkpoints.byte_bpe import byte_bpe_tokenizer
from jaxserve.bench.structured import NESTED_SCHEMA, check_output
from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.runtime import compiles
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import TINY

REGEX = r"(0|[1-9][0-9]{0,2})\.[0-9]{2} (EUR|USD)"
CHOICES = ("red", "green", "light blue", "dark")


@pytest.fixture(scope="module")
def qwen_engine() -> Engine:
    """qwen3-tiny's random weights with a byte-level BPE tokenizer of its vocabulary, 4 rows
    and pages for about two and a half long requests: preemptions happen."""
    model = load_model("qwen3-tiny")
    model.tokenizer = byte_bpe_tokenizer(model.config.vocab_size)
    return Engine(EngineConfig(num_pages=8, page_size=16, **TINY), model=model)


def _constrained(n: int, max_tokens: int, spec: dict) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=1000 + i, structured_output=spec
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("engine_name", ["stories_engine", "qwen_engine"])
def test_sampled_json_validates_against_a_nested_schema(engine_name, request):
    engine = request.getfixturevalue(engine_name)
    before = compiles.serving()
    preemptions = engine.scheduler.num_preemptions
    outs = LLM(engine=engine).generate(
        ["Once upon a time"] * 24, _constrained(24, 96, {"json": NESTED_SCHEMA})
    )
    finished = [o for o in outs if o.finish_reason == "stop"]
    for o in finished:
        jsonschema.validate(check_output(o.text), NESTED_SCHEMA)
    # Outputs cut by max_tokens end by length, as a prefix of valid JSON (not checked here).
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert len(finished) >= len(outs) // 2, [o.text for o in outs]
    assert compiles.serving() == before  # the mask path was compiled at warm-up
    if engine_name == "qwen_engine":  # grammar rows were preempted and recomputed
        assert engine.scheduler.num_preemptions > preemptions


@pytest.mark.parametrize("engine_name", ["stories_engine", "qwen_engine"])
def test_regex_and_choice_hold(engine_name, request):
    engine = request.getfixturevalue(engine_name)
    llm = LLM(engine=engine)
    regex = llm.generate(["Price:"] * 12, _constrained(12, 24, {"regex": REGEX}))
    choice = llm.generate(["Colour:"] * 12, _constrained(12, 16, {"choice": list(CHOICES)}))
    assert all(o.finish_reason == "stop" for o in regex + choice)
    assert all(re.fullmatch(REGEX, o.text) for o in regex), [o.text for o in regex]
    assert all(o.text in CHOICES for o in choice)
    assert len({o.text for o in regex}) > 1  # sampled, not one forced answer


def test_max_tokens_before_the_grammar_can_end_is_length(stories_engine):
    out = LLM(engine=stories_engine).generate(
        ["Once"],
        SamplingParams(max_tokens=4, temperature=0, structured_output={"json": NESTED_SCHEMA}),
    )[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text.startswith("{")


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(stories_engine):
    """A batch of 16 where half the rows are constrained: the other half samples exactly the
    tokens it samples without them (greedy and seeded rows), and nothing compiles."""
    llm = LLM(engine=stories_engine)
    free = [
        SamplingParams(max_tokens=20, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
        for i in range(8)
    ]
    prompts = ["Once upon a time", "The little dog", "Tom had a red ball", "A cat"] * 2
    before = compiles.serving()
    alone = llm.generate(prompts, free)
    mixed = llm.generate(prompts + prompts, free + _constrained(8, 40, {"json": NESTED_SCHEMA}))
    assert [o.token_ids for o in mixed[:8]] == [o.token_ids for o in alone]
    assert compiles.serving() == before


def test_constrained_greedy_output_is_independent_of_the_batch(stories_engine):
    """Grammar rows skip plans while their token is in flight; the skip changes when they
    run, never what they sample."""
    llm = LLM(engine=stories_engine)
    p = SamplingParams(max_tokens=40, temperature=0, structured_output={"json": NESTED_SCHEMA})
    alone = llm.generate(["Once upon a time"], p)[0]
    batch = llm.generate(
        ["Once upon a time"] + ["The little dog"] * 7,
        [p] + [SamplingParams(max_tokens=30, temperature=0.8, seed=i) for i in range(7)],
    )[0]
    assert batch.token_ids == alone.token_ids


def test_token_mask_bits_and_untouched_rows():
    """Bit j of word i allows token 32 i + j, in llguidance's layout (a vocabulary that is not
    a multiple of 32 included); a row with every bit set keeps its logits bit for bit, and
    every sampling mode then draws only allowed tokens."""
    import jax
    import jax.numpy as jnp
    import llguidance.numpy as llnp
    import numpy as np

    from jaxserve.runtime.sampling import SamplingBatch, apply_token_mask, mask_words, sample

    vocab, rows = 70, 4
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    allowed = [[3], [0, 31, 32, 69], list(range(vocab)), [40, 41]]
    mask = np.zeros((rows, mask_words(vocab)), np.int32)
    for r, ids in enumerate(allowed):
        for t in ids:  # set as the grammar engine's own layout says (its shape helper agrees)
            mask.view(np.uint32)[r, t // 32] |= np.uint32(1 << (t % 32))
    assert mask.shape == llnp.get_bitmask_shape(rows, vocab)
    mask[2] = -1
    out = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(mask)))
    for r, ids in enumerate(allowed):
        finite = set(np.flatnonzero(np.isfinite(out[r])).tolist())
        assert finite == set(ids)
    assert np.array_equal(out[2], logits[2])
    params = SamplingBatch.empty(rows)
    params = dataclasses.replace(
        params,
        temperature=np.array([0.0, 1.5, 1.0, 0.7], np.float32),
        top_p=np.array([1.0, 1.0, 0.9, 1.0], np.float32),
        top_k=np.array([0, 0, 0, 5], np.int32),
        seeds=np.arange(rows, dtype=np.uint32),
        constrained=np.bool_(True),
    )
    draw = jax.jit(sample)  # one compile for every position below
    for position in range(20):
        p = dataclasses.replace(params, positions=np.full(rows, position, np.int32))
        tokens = np.asarray(draw(jnp.asarray(logits), p, None, jnp.asarray(mask)).token_ids)
        assert all(int(tokens[r]) in allowed[r] for r in range(rows))
