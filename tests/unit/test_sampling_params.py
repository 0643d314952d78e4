"""SamplingParams refuses bad values at submission, naming the field and the value."""

from __future__ import annotations

import math
import re

import pytest

from jaxserve.sampling_params import SamplingParams


def test_defaults_are_valid_and_hashable():
    params = SamplingParams()
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p) == (16, 1.0, 0, 1.0)
    assert params.min_p == 0.0 and params.seed is None and params.logprobs is None
    assert hash(params) == hash(SamplingParams())
    assert not params.greedy and SamplingParams(temperature=0).greedy


def test_lists_become_tuples_so_params_stay_hashable():
    params = SamplingParams(stop=["\n\n", "END"], stop_token_ids=[2, 3])
    assert params.stop == ("\n\n", "END") and params.stop_token_ids == (2, 3)
    assert SamplingParams(stop="END").stop == ("END",)
    hash(params)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 2.0),
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", 1e300),  # inf in float32
        ("temperature", 1e-300),  # 0 in float32: 1 / temperature is inf
        ("temperature", 100.5),
        ("temperature", 9e-6),
        ("top_k", -1),
        ("top_k", True),
        ("top_k", 2**31),  # past int32: it killed the engine thread
        ("top_k", 10**30),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("seed", -1),
        ("seed", 2**32),
        ("seed", 1.5),
        ("logprobs", -1),
        ("logprobs", 21),
        ("ignore_eos", 1),
        ("repetition_penalty", 1e-300),  # 0 in float32: every logit became inf or NaN
        ("repetition_penalty", 0.09),
        ("repetition_penalty", 10.5),
        ("length_penalty", 1000.0),  # length ** 1000 overflows a float
        ("length_penalty", -1e300),  # length ** -1e300 is 0: a division by zero
        ("length_penalty", math.inf),
    ],
)
def test_bad_numbers_are_refused_with_field_and_value(field, value):
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r}")) as info:
        SamplingParams(**{field: value})
    assert str(info.value).endswith(".")


def test_logprobs_mode_takes_either_spelling_and_refuses_others():
    assert SamplingParams().logprobs_mode == "raw"
    assert SamplingParams(logprobs_mode="processed_logprobs").logprobs_mode == "processed"
    assert SamplingParams(logprobs_mode="raw_logprobs").logprobs_mode == "raw"
    for bad in ("processed_logits", "RAW", None):
        with pytest.raises(ValueError, match=re.escape(f"logprobs_mode={bad!r} must be one of")):
            SamplingParams(logprobs_mode=bad)


def test_edges_are_accepted():
    SamplingParams(temperature=0, top_p=1e-6, min_p=1.0, seed=2**32 - 1, logprobs=20)
    SamplingParams(top_k=1, min_p=0.0, logprobs=0, seed=0, max_tokens=1)
    SamplingParams(temperature=1e-5, top_k=2**31 - 1, repetition_penalty=0.1)
    SamplingParams(temperature=100.0, repetition_penalty=10.0)
    SamplingParams(logit_bias={2**31 - 1: 1.0}, stop_token_ids=(2**31 - 1,))
    SamplingParams(beam_width=2, length_penalty=10.0)
    SamplingParams(beam_width=2, length_penalty=-10.0)


def test_token_ids_past_int32_are_refused():
    """The device holds token ids as int32: 2**31 raised OverflowError on the engine thread
    (a logit bias, or a stop id under min_tokens, which goes into the bias slots)."""
    with pytest.raises(ValueError, match=r"logit_bias token 2147483648 must be a token id"):
        SamplingParams(logit_bias={2**31: 1.0})
    with pytest.raises(ValueError, match=r"stop_token_ids=\(2147483648,\) must hold token ids"):
        SamplingParams(stop_token_ids=(2**31,), min_tokens=2)


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        (tuple(str(i) for i in range(17)), "17 stop strings given; at most 16"),
        (("",), "non-empty"),
        (("x" * 257,), "at most 256 characters"),
        ((5,), "Stop string 5"),
    ],
)
def test_bad_stop_strings_are_refused(stop, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(stop=stop)
    SamplingParams(stop=tuple("x" * 256 for _ in range(16)))


def test_bad_stop_token_ids_are_refused():
    with pytest.raises(ValueError, match=r"stop_token_ids=.*-3 is not"):
        SamplingParams(stop_token_ids=(1, -3))
