# ruff: noqa: E402, E501 (a probe, kept as it ran)
"""One bucket's step of the engine, timed and profiled: what found issue 41's step costs.

Behind docs/benchmarks.md, "2026-12-04: the step's profile". Builds the engine for MODEL, packs one
step of T tokens (decode: T rows at contexts 100-200; prefill: T // PER prompts of PER tokens, 64
by default), times it (median of 10) and prints XLA:CPU's thunks summed by kind over 5 profiled
steps (`jax.profiler`); they overlap on the two threads, so they add up to more than the step.

    python docs/history/step_profile.py ~/.cache/peers/models/small 64 decode
    python docs/history/step_profile.py ~/.cache/peers/models/small 256 prefill 64
    FILTER='^copy' python ...   # each thunk whose name matches, largest first
    LINES='ffi_call' python ... # one step's matching thunks on each thread's timeline
    BYTARGET=1 python ...       # the ffi_call thunks summed by custom-call target and shape
    REAL=49 python ... 64 decode  # 49 sequences in the 64-token bucket (the rest padding)
"""

import collections
import glob
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.models.step_batch import SeqChunk, pack_chunks, to_words
from jaxserve.runtime.sampling import SamplingBatch

model, T, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
engine = Engine(
    EngineConfig(
        model=model, show_progress=False, max_num_seqs=64, max_model_len=1024, precompile=False
    )
)
runner, rc = engine.runner, engine.runner.config
rng = np.random.default_rng(0)
chunks, page = [], 0
if kind == "decode":
    for _i in range(int(os.environ.get("REAL", T))):
        ctx = int(rng.integers(100, 200))
        n = -(-(ctx + 1) // rc.page_size)
        chunks.append(SeqChunk([5], ctx, list(range(page, page + n))))
        page += n
else:
    per = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    for _i in range(T // per):
        n = -(-per // rc.page_size)
        chunks.append(SeqChunk(list(range(10, 10 + per)), 0, list(range(page, page + n))))
        page += n
S = rc.seq_bucket_for(T)
batch = pack_chunks(
    chunks,
    page_size=rc.page_size,
    num_tokens=T,
    num_seqs=S,
    pages_per_seq=rc.pages_per_seq,
    num_pages=rc.num_pages,
)
samp = SamplingBatch.empty(S)


def step():
    return runner.execute(batch, samp).token_ids


jax.block_until_ready(step())
ts = []
for _ in range(10):
    t = time.perf_counter()
    jax.block_until_ready(step())
    ts.append(time.perf_counter() - t)
print(f"{kind} T={T} S={S}: step {statistics.median(ts) * 1e3:.1f} ms (median of 10)")
from jax.profiler import ProfileData

N = 5
with tempfile.TemporaryDirectory() as folder:
    jax.profiler.start_trace(folder)
    for _ in range(N):
        jax.block_until_ready(step())
    jax.profiler.stop_trace()
    data = ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
    total = collections.Counter()
    bykind = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if "XLA" not in line.name and "Eigen" not in line.name:
                continue
            for ev in line.events:
                if ev.name.startswith("ThunkExecutor"):
                    continue
                total[ev.name] += ev.duration_ns
                bykind[re.sub(r"[._]\d+$", "", ev.name)] += ev.duration_ns
print(f"thunks summed {sum(total.values()) / 1e6 / N:.1f} ms a step")
for name, ns in bykind.most_common(25):
    print(f"  {ns / 1e6 / N:8.2f} ms  {name}")
if os.environ.get("FILTER"):
    for name, ns in total.most_common(400):
        if re.search(os.environ["FILTER"], name):
            print(f"  F {ns / 1e6 / N:8.2f} ms  {name}")
if os.environ.get("TOP"):
    for name, ns in total.most_common(int(os.environ["TOP"])):
        print(f"  {ns / 1e6 / N:8.2f} ms  {name}")
if os.environ.get("LINES"):
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        jax.block_until_ready(step())
        jax.profiler.stop_trace()
        data = ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
        for plane in data.planes:
            for line in plane.lines:
                evs = [e for e in line.events if not e.name.startswith("ThunkExecutor")]
                if not evs:
                    continue
                tot = sum(e.duration_ns for e in evs)
                print(f"line {plane.name}/{line.name}: {len(evs)} events, {tot / 1e6:.2f} ms")
                pat = os.environ["LINES"]
                t0 = min(e.start_ns for e in evs)
                for e in evs:
                    if re.search(pat, e.name):
                        print(
                            f"    {(e.start_ns - t0) / 1e6:8.3f} +{e.duration_ns / 1e6:7.3f}  {e.name}"
                        )
if os.environ.get("BYTARGET"):  # ffi_call thunks summed by their custom_call_target and shapes
    words = to_words((batch, samp))
    mask = runner.all_allowed(S)
    hlo = (
        runner._step.lower(
            runner.step_params,
            runner.kv,
            words.words,
            runner.penalties,
            runner.last_tokens,
            mask,
            words.layout,
            runner.lora,
        )
        .compile()
        .as_text()
    )
    target = {}
    for m in re.finditer(
        r"(ffi_call[.\d]*) = (\S+) custom-call\(([^)]*)\).*?custom_call_target=\"(\w+)\"", hlo
    ):
        target[m.group(1)] = f"{m.group(4)} -> {m.group(2)[:40]}"
    sums = collections.Counter()
    for name, ns in total.items():
        if name.startswith("ffi_call"):
            sums[target.get(name, "?")] += ns
    for name, ns in sums.most_common(20):
        print(f"  T {ns / 1e6 / N:8.2f} ms  {name}")
