"""One process of the 2-process test in test_multihost.py (run as a module, not collected).

    python -m tests.scaleout.multihost_worker PORT PROCESS_ID OUT_JSON

Joins a 2-process cluster on localhost (2 CPU devices each, set by the parent's XLA_FLAGS), builds
the same engine as every other process with tensor parallel 4 across both, and then: process 0
generates and writes the tokens to OUT_JSON; process 1 follows process 0's steps until released.
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


def main(port: int, process_id: int, out_path: str) -> None:
    multihost.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    from jaxserve.engine.core import Engine
    from jaxserve.engine_config import EngineConfig

    engine = Engine(EngineConfig(**CONFIG, tensor_parallel=4))
    if not multihost.is_leader():
        engine.runner.follow()
        return
    try:
        tokens = generate(engine)
    finally:
        engine.runner.stop_followers()
    with open(out_path, "w") as f:
        json.dump({"tokens": tokens, "num_pages": engine.runner.config.num_pages}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
