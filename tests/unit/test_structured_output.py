"""Structured output without a model: validation at construction, the planner's skip of
grammar rows with a pending token, and the host matcher against llguidance."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_output import StructuredOutput
from tests.unit.helpers import make_request, make_scheduler


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": {"type": "strng"}}, "strng"),
        ({"json": {"type": "object", "not": {"type": "null"}}}, "not"),
        ({"regex": "[a-"}, "unclosed character class"),
        ({"grammar": "start: missing_rule"}, "missing_rule"),
        ({"choice": []}, "1 to 1024"),
        ({"choice": "abc"}, "list of strings"),
        ({}, "got none"),
        ({"regex": "a", "choice": ["b"]}, "['regex', 'choice']"),
        ({"jsn": {}}, "unknown keys ['jsn']"),
    ],
)
def test_bad_constraints_are_refused_by_name(spec, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(structured_output=spec)
    assert words in str(e.value)


def test_a_choice_list_at_its_maximum_is_accepted_and_one_more_refused():
    """MAX_CHOICES entries is the bound, inclusive: that many compile to one alternative each;
    one more is refused with the count and the bound in the message."""
    from jaxserve.structured_output import MAX_CHOICES

    assert MAX_CHOICES == 1024
    most = [f"choice-{i:04d}" for i in range(MAX_CHOICES)]  # none a prefix of another
    at_most = StructuredOutput(choice=most)
    assert len(at_most.choice) == MAX_CHOICES and at_most.kind == "choice"
    # Enforced whole: the last entry is an output the grammar accepts, and not a prefix of it.
    from checkpoints.byte_bpe import byte_bpe_tokenizer
    from jaxserve.engine.grammar import GrammarCompiler

    tok = byte_bpe_tokenizer(1024)
    compiler = GrammarCompiler(tok, 1024, (2,))
    last = tok(most[-1], add_special_tokens=False)["input_ids"]
    g = compiler.matcher(at_most)
    assert g.sync(last[:-1]) and not g.is_accepting()
    assert g.sync(last) and g.is_accepting()
    compiler.close()
    with pytest.raises(ValueError, match=r"choice has 1025 entries; it needs 1 to 1024 "):
        StructuredOutput(choice=[*most, "one more"])
    # The bound reads the same through SamplingParams (every front end's way in).
    assert SamplingParams(structured_output={"choice": most}).constrained
    with pytest.raises(ValueError, match="1025 entries"):
        SamplingParams(structured_output={"choice": [*most, "x"]})


@pytest.mark.parametrize("other", [dict(ignore_eos=True), dict(min_tokens=2)])
def test_options_that_move_the_end_conflict_with_a_grammar(other):
    with pytest.raises(ValueError, match="grammar alone decides"):
        SamplingParams(structured_output={"regex": "a+"}, **other)


def test_equal_schemas_are_one_cache_key():
    a = StructuredOutput(json={"type": "object", "required": ["x"]})
    b = StructuredOutput(json=json.dumps({"required": ["x"], "type": "object"}, indent=2))
    assert a == b and hash(a) == hash(b)
    assert a != StructuredOutput(json={"type": "object"})
    p = SamplingParams(structured_output={"choice": ["a", "b"]})
    assert p.structured_output == StructuredOutput(choice=("a", "b")) and p.constrained


def test_a_grammar_row_is_not_planned_while_its_token_is_pending():
    """Asynchronous scheduling plans step t+1 before step t's token is known: a grammar row
    sits that plan out (its mask needs the token), the other rows run every step."""
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    free = make_request("free", 4, max_tokens=8)
    bound = make_request("bound", 4, max_tokens=8, structured_output={"regex": "a+"})
    for r in (free, bound):
        sched.add_request(r)
    first = sched.schedule()  # both prefill and sample: both now have a pending token
    assert {s.request_id for s in first.seqs} == {free.request_id, bound.request_id}
    second = sched.schedule()  # planned before the first step's tokens are in
    assert [s.request_id for s in second.seqs] == [free.request_id]
    sched.update(first, _tokens(first, 5))
    third = sched.schedule()  # the grammar row's token is known: it runs again
    assert {s.request_id for s in third.seqs} == {free.request_id, bound.request_id}


def _tokens(plan, token):
    from jaxserve.scheduling.types import StepResult

    return StepResult(sampled_token_ids=[token] * len(plan.seqs))


def test_request_grammar_follows_outputs_and_rolls_back():
    """The matcher consumes new outputs, and after outputs that are not an extension of what
    it saw (a recompute that changed them) it rolls back to where they agree."""
    from checkpoints.byte_bpe import byte_bpe_tokenizer
    from jaxserve.engine.grammar import GrammarCompiler

    tok = byte_bpe_tokenizer(1024)
    compiler = GrammarCompiler(tok, 1024, (2,))
    g = compiler.matcher(StructuredOutput(choice=("yes", "no")))
    mask = np.zeros((1, 32), np.int32)

    def allowed():
        g.fill(mask, 0)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        return {int(t) for t in np.flatnonzero(bits)}

    yes = [t for t in tok("yes", add_special_tokens=False)["input_ids"]]
    no = [t for t in tok("no", add_special_tokens=False)["input_ids"]]
    start = allowed()
    assert yes[0] in start and no[0] in start and 2 not in start  # EOS only when complete
    assert g.sync(yes)
    assert g.is_accepting() and allowed() == {2}
    assert g.sync(no)  # rolled back all of "yes", then consumed "no"
    assert g.is_accepting() and allowed() == {2}
    assert g.sync([]) and allowed() == start
    assert not g.sync([2, 2])  # EOS at the start is refused: an error, not a crash
    assert g.error
    compiler.close()


def test_one_token_at_a_time_and_rows_of_a_shared_mask():
    """`sync` one token at a time (every step's case) agrees with consuming all at once, takes
    back a last token that changed, and refuses a forbidden one; rows filled through the mask's
    address land in their own row."""
    from checkpoints.byte_bpe import byte_bpe_tokenizer
    from jaxserve.engine.grammar import GrammarCompiler

    tok = byte_bpe_tokenizer(1024)
    compiler = GrammarCompiler(tok, 1024, (2,))
    spec = StructuredOutput(json={"type": "object", "properties": {"q": {"type": "integer"}}})
    text = tok('{"q":12}', add_special_tokens=False)["input_ids"]
    stepped, at_once = compiler.matcher(spec), compiler.matcher(spec)
    mask = np.zeros((3, 32), np.int32)
    for n in range(1, len(text) + 1):
        assert stepped.sync(text[:n])
    assert at_once.sync(text)
    stepped.fill(mask, 1, mask.ctypes.data)
    at_once.fill(mask, 2)
    assert (mask[1] == mask[2]).all() and not mask[0].any()
    assert stepped.is_accepting()
    # The same length with another last token: a rollback, then the new token.
    other = [*text[:-1], tok("3", add_special_tokens=False)["input_ids"][0]]
    assert stepped.sync(other) and not stepped.is_accepting()
    assert not stepped.sync([*other, ord("x")]) and stepped.error  # refused, not a crash
    with pytest.raises(ValueError, match="C-contiguous int32"):
        at_once.fill(np.zeros((2, 32), np.int64), 0)
    compiler.close()


def test_a_compile_past_its_bound_is_a_clear_error_and_the_cache_serves_later():
    """A compile that outlasts the bound refuses its request by name, goes on off the caller's
    thread, and serves the next request from the cache. The compile is slowed on purpose: a
    real one of a small schema can finish before a loaded machine lets the caller time out."""
    import threading
    import time

    from checkpoints.byte_bpe import byte_bpe_tokenizer
    from jaxserve.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler(byte_bpe_tokenizer(1024), 1024, (2,), timeout_s=0.2)
    compile_ = compiler._compile
    release = threading.Event()

    def slow(spec):
        release.wait(60)  # held until the caller has timed out
        return compile_(spec)

    compiler._compile = slow
    spec = StructuredOutput(json={"type": "object", "properties": {"q": {"type": "integer"}}})
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"did not compile within 0.2 s"):
        compiler.matcher(spec)
    assert time.perf_counter() - start < 30  # the bound, not the compile, ended the wait
    release.set()
    compiler.submit(spec).result(timeout=60)  # it went on, off the caller's thread
    assert compiler.matcher(spec).is_accepting() is False  # now served from the cache at once
    compiler.close()


def test_the_tokenizer_description_is_not_counted_against_the_bound():
    """The first constraint waits for llguidance's description of the tokenizer (once per
    process, seconds for a large vocabulary) before its own bound starts: a slow description
    is not reported as a constraint that did not compile."""
    import time

    from checkpoints.byte_bpe import byte_bpe_tokenizer
    from jaxserve.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler(byte_bpe_tokenizer(1024), 1024, (2,), timeout_s=1.0)
    describe = compiler._describe_tokenizer

    def slow():
        time.sleep(1.5)
        return describe()

    compiler._describe_tokenizer = slow
    g = compiler.matcher(StructuredOutput(choice=("yes", "no")))
    assert not g.is_accepting()
    compiler.close()


def test_a_tokenizer_the_grammar_engine_cannot_read_is_a_clear_error():
    """A WordLevel vocabulary with a WordPiece decoder (what the peers' synthetic models
    ship): every constraint is refused with the reason, and the compiler goes on."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxserve.engine.grammar import GrammarCompiler

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()
    compiler = GrammarCompiler(PreTrainedTokenizerFast(tokenizer_object=raw), 3, (0,))
    for spec in (StructuredOutput(choice=("a", "b")), StructuredOutput(regex="a+")):
        with pytest.raises(ValueError, match=r"tokenizer cannot be described to the grammar"):
            compiler.matcher(spec)
    compiler.close()
