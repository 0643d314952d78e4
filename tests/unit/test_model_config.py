"""`MoeConfig` refuses what cannot be a mixture of experts, and configs with experts survive the
JSON that orbax checkpoints store them in."""

from __future__ import annotations

import json

import pytest

from checkpoints.config_json import config_from_json, config_to_json
from checkpoints.random_weights import NAMED_SHAPES
from jaxserve.models.config import MoeConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_experts=0, top_k=1, intermediate_size=8), r"num_experts=0 must be a positive"),
        (dict(num_experts=8, top_k=9, intermediate_size=8), r"top_k=9 exceeds num_experts=8"),
        (dict(num_experts=8, top_k=2, intermediate_size=-1), r"intermediate_size=-1"),
        (
            dict(num_experts=8, top_k=2, intermediate_size=8, normalization="sigmoid"),
            r"normalization='sigmoid' is not one of",
        ),
    ],
)
def test_a_moe_config_refuses_what_it_cannot_route(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoeConfig(**kwargs)


def test_top_k_equal_to_the_experts_is_allowed():
    assert MoeConfig(num_experts=4, top_k=4, intermediate_size=8).top_k == 4


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "mixtral-tiny", "qwen3-tiny"])
def test_the_json_round_trip_keeps_the_experts(name):
    config = NAMED_SHAPES[name]
    back = config_from_json(json.loads(json.dumps(config_to_json(config))))
    assert back == config
    assert (back.moe is None) == (config.moe is None)
