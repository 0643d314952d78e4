"""One process of the 2-process test in test_multihost.py (run as a module, not collected).

    python -m tests.scaleout.multihost_worker PORT PROCESS_ID OUT_JSON [slow-follower]

Joins a 2-process cluster on localhost (2 CPU devices each, set by the parent's XLA_FLAGS), builds
the same engine as every other process with tensor parallel 4 across both, and then: process 0
generates and writes the tokens to OUT_JSON; process 1 follows process 0's steps until released.

With `slow-follower`, process 1 waits FOLLOWER_DELAY_S before dispatching each step it receives,
so no step can end (its collectives need process 1's devices) until that long after process 1
got it; process 0 writes, per step it dispatched, whether the step before was still running
then: it is, every time, when process 0 plans ahead of the followers.
"""

from __future__ import annotations

import json
import sys

from jaxserve.runtime import multihost

PROMPTS = [[5, 17, 300, 42, 9, 77], [8, 400, 401], [999, 11, 12, 13, 14]]
CONFIG = dict(
    model="llama-tiny",  # 2 KV heads over 4 devices: each on one host, replicated on its 2
    max_num_seqs=4,
    max_num_batched_tokens=16,
    min_token_bucket=16,
    seq_bucket_factor=4,
    show_progress=False,
)


def generate(engine) -> list[list[int]]:
    from jaxserve.engine.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    params = [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
    ]
    return [out.token_ids for out in LLM(engine=engine).generate(PROMPTS, params)]


FOLLOWER_DELAY_S = 0.3


def _slow_follower(runner) -> None:
    """Process 1 dispatches each step FOLLOWER_DELAY_S after receiving it."""
    import time

    dispatch = runner._dispatch

    def late(*args):
        time.sleep(FOLLOWER_DELAY_S)
        return dispatch(*args)

    runner._dispatch = late


def _record_overlap(runner, overlap: list[bool]) -> None:
    """Process 0 notes, at each step it dispatches (once the step went to the followers),
    whether the step before was still running."""
    dispatch, last = runner._dispatch, []

    def watched(*args):
        if last:
            overlap.append(not last[-1].token_ids.is_ready())
        out = dispatch(*args)
        last[:] = [out]
        return out

    runner._dispatch = watched


def main(port: int, process_id: int, out_path: str, mode: str = "") -> None:
    multihost.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    from jaxserve.engine.core import Engine
    from jaxserve.engine_config import EngineConfig

    engine = Engine(EngineConfig(**CONFIG, tensor_parallel=4))
    if not multihost.is_leader():
        if mode == "slow-follower":
            _slow_follower(engine.runner)
        engine.runner.follow()
        return
    overlap: list[bool] = []
    if mode == "slow-follower":
        _record_overlap(engine.runner, overlap)
    try:
        tokens = generate(engine)
    finally:
        engine.runner.stop_followers()
    with open(out_path, "w") as f:
        result = {"tokens": tokens, "num_pages": engine.runner.config.num_pages}
        json.dump({**result, "overlap": overlap}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
