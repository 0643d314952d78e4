"""A caller's request_id never routes another request's output to it (issue 15, defect 1).

The old AsyncEngine routed outputs by the caller's id and freed the id on cancel, before the
engine had aborted the request: a new request sent at once with the same id could receive the
cancelled request's leftover tokens. Now the engine sees an internal id per call, and a caller's
id is refused (INVALID_ARGUMENT) until the engine has finished with the earlier request.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm import LLM
from jaxserve.sampling_params import SamplingParams
from service.gen.jaxserve.v1 import jaxserve_pb2 as pb
from tests.service.conftest import serving

PROMPT_A = [1, 403, 407]  # 3 tokens, streamed long and cancelled
PROMPT_B = [1, 261, 378, 432, 383, 286, 300, 301, 302]  # 9 tokens, short and greedy
B_TOKENS = 6


def test_reused_id_after_cancel_never_gets_another_requests_tokens(engine):
    (expected_b,) = LLM(engine=engine).generate(
        [PROMPT_B], SamplingParams(max_tokens=B_TOKENS, temperature=0.0, ignore_eos=True)
    )
    assert len(expected_b.token_ids) == B_TOKENS
    refused = 0
    with serving(engine) as server, server.client() as first, server.client() as second:
        for i in range(50):
            rid = f"reused-{i % 3}"
            stream = first.generate(
                PROMPT_A, request_id=rid, max_tokens=200, temperature=0.0, ignore_eos=True
            )
            for _ in range(3):
                assert next(stream).request_id == rid
            stream.cancel()
            # At once, from another connection, with the same id: either refused while the
            # engine still holds A, or B's own answer; never A's leftovers.
            for attempt in range(200):
                call = first.generate_unary if attempt % 2 else second.generate_unary
                try:
                    reply = call(
                        PROMPT_B,
                        request_id=rid,
                        max_tokens=B_TOKENS,
                        temperature=0.0,
                        ignore_eos=True,
                        timeout=30,
                    )
                except grpc.RpcError as e:
                    assert e.code() is grpc.StatusCode.INVALID_ARGUMENT, e.details()
                    assert rid in e.details()
                    refused += 1
                    continue
                break
            else:
                pytest.fail(f"request_id {rid!r} was never released after its cancel")
            assert reply.request_id == rid
            assert reply.usage.prompt_tokens == len(PROMPT_B)
            assert reply.usage.completion_tokens == B_TOKENS
            assert reply.finish_reason == pb.FINISH_REASON_LENGTH
            assert list(reply.token_ids) == expected_b.token_ids
            assert reply.text == expected_b.text
    print(f"{refused} reuses refused while the engine still held the cancelled request")


def test_reusing_a_running_id_is_refused_and_a_finished_one_is_not(engine):
    async def scenario(async_engine: AsyncEngine):
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        first = async_engine.generate(PROMPT_A, params, request_id="same")
        out = await anext(first)
        assert out.request_id == "same"
        with pytest.raises(ValueError, match="'same'"):
            await anext(async_engine.generate(PROMPT_B, params, request_id="same"))
        async for out in first:  # runs to its end: the id is free again afterwards
            assert out.request_id == "same"
        assert out.finished and out.num_prompt_tokens == len(PROMPT_A)
        short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        outs = [o async for o in async_engine.generate(PROMPT_B, short, request_id="same")]
        assert outs[-1].num_prompt_tokens == len(PROMPT_B)
        assert sum(len(o.new_token_ids) for o in outs) == 2

    async_engine = AsyncEngine(engine=engine)
    try:
        asyncio.run(scenario(async_engine))
    finally:
        async_engine.shutdown()
    assert not engine.has_unfinished()
