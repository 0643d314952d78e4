"""Stop strings: what the matcher lets a stream send, with and without stop strings."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from jaxserve.engine.detokenizer import StopStringMatcher

_deltas = st.lists(st.text(alphabet="abc xy", max_size=6), max_size=30)


@given(st.lists(st.tuples(st.text(alphabet="abc xy", max_size=6), st.booleans()), max_size=30))
def test_without_stop_strings_the_text_is_sent_as_it_comes(steps):
    """Each take sends everything added since the last take, nothing held back."""
    matcher = StopStringMatcher(())
    unsent = ""
    for delta, take_now in steps:
        matcher.add(delta)
        unsent += delta
        if take_now:
            assert matcher.take(final=False) == unsent
            unsent = ""
    assert matcher.take(final=True) == unsent and matcher.matched is None


@given(_deltas, st.sampled_from(["xy", "a b", "cc"]))
def test_with_a_stop_string_the_stream_is_exactly_the_text_before_it(deltas, stop):
    whole = "".join(deltas)
    expected = whole[: whole.index(stop)] if stop in whole else whole
    matcher = StopStringMatcher((stop,))
    sent = ""
    for delta in deltas:
        matcher.add(delta)
        sent += matcher.take(final=False)
        assert expected.startswith(sent)  # nothing is ever sent that the final text lacks
    sent += matcher.take(final=True)
    assert sent == expected
    assert (matcher.matched is not None) == (stop in whole)
