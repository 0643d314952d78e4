"""Issue 46, item 3, measured on the engine: KV memory one 8k-token sequence of gemma3-1b's
layer pattern holds with kv_layout hybrid vs uniform.

gemma3-1b's attention layout as it is (26 layers, global at 5, 11, 17, 23, window 512, 1 KV
head of 256, pages of 16) with its hidden sizes thinned (hidden 64, MLP 128, 4 query heads,
vocabulary 512) so an 8,192-token prefill runs on a 2-core CPU: the pages a sequence holds
depend on the layers, the window and the page size, not on the widths. The engine serves one
8,192-token random prompt (chunks of 512) and 64 greedy tokens; every step records the pages
in use. Reported: the peak in layer-pages (page IDs x the layers a page holds) and in bytes,
the layer-pages while decoding (the prefill's peak adds a chunk to each local window), and the
two layouts' greedy tokens (equal: the layout changes no logit).

    PYTHONPATH=. python docs/history/hybrid_kv_pages.py
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from checkpoints import NAMED_SHAPES
from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams

PROMPT, OUT = 8192, 64


def main() -> None:
    base = NAMED_SHAPES["gemma3-1b"]
    thin = dataclasses.replace(
        base, hidden_size=64, intermediate_size=128, num_heads=4, vocab_size=512
    )
    NAMED_SHAPES["gemma3-1b-thin"] = thin
    prompt = np.random.default_rng(0).integers(3, 512, PROMPT).tolist()
    tokens = {}
    for layout in ("hybrid", "uniform"):
        engine = Engine(
            EngineConfig(
                model="gemma3-1b-thin",
                dtype="float32",
                kv_layout=layout,
                max_model_len=PROMPT + OUT + 16,
                max_num_seqs=4,
                max_num_batched_tokens=512,
                num_pages=600 if layout == "uniform" else 2000,  # 516 IDs vs ~910 needed
                show_progress=False,
                precompile=False,
            )
        )
        engine.add_request(prompt, SamplingParams(max_tokens=OUT, temperature=0, ignore_eos=True))
        peak, used, start = 0, 0, time.perf_counter()
        out = []
        while engine.has_unfinished():
            for o in engine.step():
                out.extend(o.new_token_ids)
            now = engine.scheduler.kv.num_used_pages
            used = now or used  # the last step's before the request finished: decoding at 8.2k
            peak = max(peak, now)
        pool = engine.runner.kv.kv
        per_id = pool.shape[0]
        page_bytes = pool.nbytes // pool.shape[1]
        cfg = engine.runner.config.kv_layout
        groups = cfg.num_groups if cfg is not None else 1
        print(
            f"{layout:8s} groups {groups} layers/page {per_id:2d}  peak pages {peak:6d}  "
            f"layer-pages {peak * per_id:6d}  MiB {peak * page_bytes / 2**20:7.1f}  "
            f"decoding {used * per_id:6d} layer-pages ({time.perf_counter() - start:.0f} s)"
        )
        tokens[layout] = list(out)
    print("greedy tokens equal:", tokens["hybrid"] == tokens["uniform"], len(tokens["hybrid"]))


if __name__ == "__main__":
    main()
