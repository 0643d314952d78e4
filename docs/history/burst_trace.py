# ruff: noqa: E501 (a probe, kept as it ran)
"""Every step of an in-process run of the peers' workloads: its bucket, real tokens, rows, time.

Behind docs/benchmarks.md, "2026-12-04: the step's profile" (tokens computed against padded).
Each step is waited for, so the run is a little slower than served; group totals show where a
burst's time goes (prefill and mixed steps against decode steps, by bucket).

    python docs/history/burst_trace.py ~/.cache/peers/models/small 64            # burst of 64
    python docs/history/burst_trace.py ~/.cache/peers/models/small 64 '{"max_num_batched_tokens": 1024}'
    python docs/history/burst_trace.py ~/.cache/peers/models/tiny 200 '{}' mixed 25  # Poisson
"""

import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../../shared/peers"))
import jax
import numpy as np
from workload import make_workload

from jaxserve.engine import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.runtime import model_runner as mr
from jaxserve.sampling_params import SamplingParams

model, n = sys.argv[1], int(sys.argv[2])
extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
eng = Engine(
    EngineConfig(model=model, max_num_seqs=64, max_model_len=1024, show_progress=False, **extra)
)
rec = []
orig = mr.ModelRunner._dispatch


def traced(self, batch, sampling, words=None, mask=None):
    t = time.perf_counter()
    out = orig(self, batch, sampling, words, mask)
    jax.block_until_ready(out)
    dt = time.perf_counter() - t
    T = int(batch.token_ids.shape[0])
    S = int(batch.query_start.shape[0]) - 1
    qs = np.asarray(batch.query_start)
    ns = int(np.asarray(batch.num_seqs))
    lens = np.diff(qs[: ns + 1])
    rec.append(
        dict(T=T, S=S, seqs=ns, real=int(lens.sum()), decode=int((lens == 1).sum()), ms=dt * 1e3)
    )
    return out


mr.ModelRunner._dispatch = traced


def sp(m):
    return SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)


eng.add_request([11, 12, 13, 14], sp(4))
while eng.has_unfinished():
    eng.step()
rec.clear()
prof = sys.argv[4] if len(sys.argv) > 4 else "uniform-short"
rate = float(sys.argv[5]) if len(sys.argv) > 5 else None
reqs = make_workload(prof, n, seed=0, rate=rate)
t0 = time.perf_counter()
pend = sorted(reqs, key=lambda r: r.arrival_s)
host = [0.0]
while pend or eng.has_unfinished():
    now = time.perf_counter() - t0
    while pend and pend[0].arrival_s <= now:
        r = pend.pop(0)
        eng.add_request(r.prompt_ids, sp(r.max_tokens))
    if eng.has_unfinished():
        a = time.perf_counter()
        eng.step()
        host[0] += time.perf_counter() - a
    else:
        time.sleep(max(0, pend[0].arrival_s - now))
wall = time.perf_counter() - t0
out = sum(r.max_tokens for r in reqs)
print(f"engine.step total {host[0]:.2f} s")
print(
    f"wall {wall:.2f} s, output {out} tok, {out / wall:.1f} tok/s, steps {len(rec)}, step ms sum {sum(r['ms'] for r in rec):.0f}"
)
g = collections.defaultdict(lambda: [0, 0.0, 0, 0])
for r in rec:
    kind = "decode" if r["decode"] == r["seqs"] else ("prefill" if r["decode"] == 0 else "mixed")
    k = (kind, r["T"], r["S"])
    g[k][0] += 1
    g[k][1] += r["ms"]
    g[k][2] += r["real"]
    g[k][3] += r["seqs"]
for k in sorted(g):
    c, ms, real, seqs = g[k]
    print(
        f"{k[0]:8s} T={k[1]:4d} S={k[2]:3d}: {c:3d} steps, {ms:8.0f} ms total, {ms / c:6.1f} ms/step, real tok/step {real / c:6.1f}, seqs/step {seqs / c:5.1f}"
    )
