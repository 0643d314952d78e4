"""A burst that free slots will take is never refused as "queue full" (issue 15, defect 3).

Every request added between two iterations used to count as waiting until the next schedule(),
so an idle server with 4 slots and a waiting limit of 2 refused some of 4 simultaneous requests
with RESOURCE_EXHAUSTED. Sent over real gRPC from 4 threads released together, 20 times.
"""

from __future__ import annotations

import concurrent.futures
import threading

import grpc
import pytest

from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from service.gen.jaxserve.v1 import jaxserve_pb2 as pb
from tests.service.conftest import serving

SLOTS = 4


@pytest.fixture(scope="module")
def four_slot_engine() -> Engine:
    """4 slots, at most 2 waiting; one token bucket x two seq buckets keeps compiling short."""
    return Engine(
        EngineConfig(
            max_num_seqs=SLOTS,
            max_waiting_requests=2,
            max_num_batched_tokens=32,
            min_token_bucket=32,
            seq_bucket_factor=SLOTS,
            max_model_len=128,
            show_progress=False,
        )
    )


def test_four_simultaneous_requests_on_four_free_slots_all_succeed(four_slot_engine):
    with serving(four_slot_engine) as server:
        clients = [server.client() for _ in range(SLOTS)]
        try:
            for round_ in range(20):
                barrier = threading.Barrier(SLOTS)

                def send(i, barrier=barrier, round_=round_):
                    barrier.wait()
                    return clients[i].generate_unary(
                        "Once upon a time",
                        request_id=f"r{round_}-{i}",
                        max_tokens=8,
                        temperature=0.0,
                        ignore_eos=True,
                        timeout=60,
                    )

                with concurrent.futures.ThreadPoolExecutor(SLOTS) as pool:
                    futures = [pool.submit(send, i) for i in range(SLOTS)]
                    codes = []
                    for f in futures:
                        try:
                            reply = f.result()
                        except grpc.RpcError as e:
                            codes.append((e.code(), e.details()))
                            continue
                        assert reply.finish_reason == pb.FINISH_REASON_LENGTH
                        assert reply.usage.completion_tokens == 8
                assert not codes, f"round {round_}: refused {codes}"
        finally:
            for c in clients:
                c.close()
