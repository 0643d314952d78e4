"""Request state: status order, finish reasons, token slicing, stop tokens."""

from __future__ import annotations

import pytest

from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.request import FinishReason, Request, RequestStatus


def test_status_order_puts_every_finished_status_after_preempted():
    finished = {s for s in RequestStatus if s > RequestStatus.PREEMPTED}
    assert {s for s in RequestStatus if s.is_finished} == finished
    assert finished == {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
        RequestStatus.FINISHED_REFUSED,
    }


def test_finish_reason_round_trips_through_status():
    req = Request(request_id="a", prompt_token_ids=[1])
    assert req.finish_reason is None and not req.is_finished
    for reason in FinishReason:
        req.status = reason.status
        assert req.finish_reason is reason and req.is_finished
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error", "refused"]
    assert FinishReason.LENGTH == "length"


def test_token_slices_match_all_token_ids():
    req = Request(request_id="a", prompt_token_ids=[10, 11, 12])
    req.output_token_ids.extend([20, 21])
    assert req.all_token_ids == [10, 11, 12, 20, 21]
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (5, 3, 2)
    for start in range(6):
        for end in range(start, 6):
            assert req.token_ids(start, end) == req.all_token_ids[start:end], (start, end)


def test_stop_tokens_respect_ignore_eos_but_not_stop_token_ids():
    plain = Request(request_id="a", prompt_token_ids=[1], eos_token_ids=(2,))
    assert plain.stop_ids == {2}
    params = SamplingParams(ignore_eos=True, stop_token_ids=(3,))
    ignoring = Request(
        request_id="b", prompt_token_ids=[1], eos_token_ids=(2,), sampling_params=params
    )
    assert ignoring.stop_ids == {3}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(request_id="", prompt_token_ids=[1]), "request_id=''"),
        (dict(request_id="a", prompt_token_ids=[]), "empty prompt"),
        (dict(request_id="a", prompt_token_ids=[1, -1]), "not ints >= 0"),
        (dict(request_id="a", prompt_token_ids=[1], priority=0.5), "priority=0.5"),
    ],
)
def test_bad_requests_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Request(**kwargs)
