# ruff: noqa: E501 (a probe, kept as it ran)
"""Two jaxserve replicas on a loopback Ray cluster, the prefix-aware router against the power of
two choices, in one run: 8 shared system prompts x many users, streamed, a few at a time.
Prints each router's prefix-cache hit rate (cached prompt tokens / prompt tokens, from the
answers' usage) and TTFT p50/p90. Behind docs/ray_serve.md.

    python docs/history/ray_routing.py [users_per_prompt=16] [num_pages=128] [concurrency=4] [serve flags...]

The replicas' KV pools (--num-pages) hold about half the 8 prefixes each: where every replica
could cache all 8, routing would not matter after the first 8 requests of each.
"""

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import aiohttp

USERS = int(sys.argv[1]) if len(sys.argv) > 1 else 16
PAGES = int(sys.argv[2]) if len(sys.argv) > 2 else 128
CONC = int(sys.argv[3]) if len(sys.argv) > 3 else 4
EXTRA = sys.argv[4:]  # more `jaxserve serve` flags, e.g. --host-kv-gb 0
PORT = 8131
rng = random.Random(0)
WORDS = "the a little girl boy dog cat park tree sun happy sad big small ran jumped played saw found said friend mom dad ball toy red blue green house garden flower bird".split()


def sentence(r):
    return " ".join(r.choice(WORDS) for _ in range(r.randint(8, 14))).capitalize() + "."


SYSTEMS = [f"Story teller {i}. " + " ".join(sentence(rng) for _ in range(8)) for i in range(8)]
REQUESTS = [(s, f" Question {u}: {sentence(rng)}") for s in range(8) for u in range(USERS)]
rng.shuffle(REQUESTS)


async def one(session, sys_i, question, out):
    body = {
        "prompt": SYSTEMS[sys_i] + question,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, usage, replica = None, None, None
    async with session.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body) as resp:
        replica = resp.headers.get("x-jaxserve-replica")
        async for line in resp.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            if ttft is None and data.get("choices"):
                ttft = time.perf_counter() - t0
            if data.get("usage"):
                usage = data["usage"]
    out.append((sys_i, replica, ttft, usage))


async def workload():
    out, queue = [], list(REQUESTS)
    async with aiohttp.ClientSession() as session:

        async def worker():
            while queue:
                s, q = queue.pop()
                await one(session, s, q, out)

        await asyncio.gather(*(worker() for _ in range(CONC)))
    return out


def run(router):
    cmd = [
        sys.executable,
        "-m",
        "jaxserve.cli",
        "serve",
        "--ray-replicas",
        "2",
        "--ray-router",
        router,
        "--http-port",
        str(PORT),
        "--num-pages",
        str(PAGES),
        "--log-format",
        "text",
        *EXTRA,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    for line in proc.stdout:
        if "serving on" in line:
            break
    else:
        raise RuntimeError(f"the server exited: {proc.wait()}")
    t0 = time.perf_counter()
    out = asyncio.run(workload())
    wall = time.perf_counter() - t0
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    prompt = sum(u["prompt_tokens"] for *_, u in out)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for *_, u in out)
    ttfts = sorted(t for _, _, t, _ in out)
    spread = {}
    for s, r, *_ in out:
        spread.setdefault(s, set()).add(r)
    both = sum(len(v) > 1 for v in spread.values())
    print(
        f"{router:6s}: {len(out)} requests in {wall:.1f} s, prefix-cache hit rate {cached / prompt:.3f} "
        f"({cached}/{prompt} prompt tokens), TTFT p50 {statistics.median(ttfts) * 1e3:.0f} ms, "
        f"p90 {ttfts[int(0.9 * len(ttfts))] * 1e3:.0f} ms; system prompts served by both replicas: {both}/8",
        flush=True,
    )


print(
    f"8 system prompts of {min(map(len, SYSTEMS))}-{max(map(len, SYSTEMS))} characters x {USERS} users, "
    f"concurrency {CONC}, --num-pages {PAGES} per replica {' '.join(EXTRA)}",
    flush=True,
)
for router in ("prefix", "pow2"):
    run(router)
