"""How much n-gram speculation could gain on a model and workload, whatever the scheduling.

Behind docs/benchmarks.md, "Speculative decoding" (13th session): what bounds the embedded
model's one-at-a-time TPOT gain. Each prompt is run greedily without speculation; then the
engine's own n-gram proposer (k = 4 and n-grams of 2-3 tokens, or `K` and `N_MIN`) is
replayed over the output as if every step verified whatever it proposes, accepting up to the
first mismatch. That counts the steps an oracle scheduler would need: every proposal verified,
the host free. Two bounds follow: with a verification as cheap as a decode, and with it at the
price measured here (one decode row in the 1-token bucket against a (k + 1)-token chunk in the
smallest bucket that holds it, each timed back to back, as pipelined steps run). Run from the
repository root:

    JAX_PLATFORMS=cpu PYTHONPATH=. python docs/history/speculative_bound.py
    JAX_PLATFORMS=cpu PYTHONPATH=. MODEL=~/.cache/peers/models/small TOKENS=64 \\
        python docs/history/speculative_bound.py
"""

from __future__ import annotations

import os
import statistics
import time

import jax

from jaxserve.bench.workload import random_prompt_ids, repetitive_workloads
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.models.step_batch import SeqChunk, pack_chunks
from jaxserve.runtime.buckets import pick_bucket
from jaxserve.runtime.sampling import SamplingBatch
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.speculation import NgramProposer

K = int(os.environ.get("K", "4"))
N_MIN = int(os.environ.get("N_MIN", "2"))
TOKENS = int(os.environ.get("TOKENS", "128"))
TEXTS = [  # stories said again: the embedded model's own kind of text (speculative_interleaved)
    "Lily and Tom went to the park to play on the swings. " * 3,
    "Tim saw a big tree. " * 3,
    "Anna had a doll named Anna. " * 3,
    "Mom made a cake. " * 3,
]


def oracle_steps(prompt: list[int], output: list[int]) -> tuple[int, int, int]:
    """(steps, steps with a proposal, proposals accepted) of `output` after `prompt` when every
    step verifies whatever the n-gram proposer offers."""
    proposer = NgramProposer(N_MIN, max(N_MIN, 3))
    history = prompt + output
    pos = steps = proposing = accepted = 0
    while pos < len(output):
        known = len(prompt) + pos
        proposal = proposer.propose(history[:known], K)
        n = 0
        while n < len(proposal) and known + n < len(history) and proposal[n] == history[known + n]:
            n += 1
        proposing += bool(proposal)
        accepted += n
        pos += n + 1
        steps += 1
    return steps, proposing, accepted


def verification_price(llm: LLM, context: int = 128) -> float:
    """A 5-token verification step over a one-row decode step, each timed back to back."""
    runner = llm.engine.runner
    rc = runner.config
    table = list(range(min(rc.pages_per_seq, rc.num_pages)))

    def step(chunk: SeqChunk, tokens: int):
        seqs = rc.seq_bucket_for(tokens)
        batch = pack_chunks(
            [chunk],
            page_size=rc.page_size,
            num_tokens=tokens,
            num_seqs=seqs,
            pages_per_seq=rc.pages_per_seq,
            num_pages=rc.num_pages,
        )
        sampling = SamplingBatch.empty(seqs)
        return lambda: runner.execute(batch, sampling).token_ids

    decode = step(SeqChunk([1], context - 1, table), 1)
    verify = step(SeqChunk([1] * (K + 1), context, table), pick_bucket(rc.token_buckets, K + 1))
    times = {decode: [], verify: []}
    for fn in times:
        jax.block_until_ready(fn())
    for _ in range(7):
        for fn, values in times.items():
            start = time.perf_counter()
            for _ in range(10):
                out = fn()
            jax.block_until_ready(out)
            values.append((time.perf_counter() - start) / 10)
    d, v = (statistics.median(times[fn]) for fn in (decode, verify))
    print(f"pipelined steps at context {context}: decode {d * 1e3:.2f} ms, ", end="")
    print(f"a {K + 1}-token verification {v * 1e3:.2f} ms")
    return v / d


def main() -> None:
    model = os.environ.get("MODEL")
    llm = LLM(EngineConfig(show_progress=False, **({"model": model} if model else {})))
    engine = llm.engine
    vocab = engine.model.config.vocab_size
    rep = repetitive_workloads(num_requests=8, prompt_len=48, max_tokens=TOKENS)[0]
    workloads = {
        "repetitive (bench profile)": [random_prompt_ids(s, vocab, 0) for s in rep.requests]
    }
    if engine.tokenizer is not None:
        workloads["stories said three times (text)"] = [engine.encode(t) for t in TEXTS]
    price = verification_price(llm)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    for name, prompts in workloads.items():
        tokens = steps = proposing = accepted = 0
        for done in llm.generate(prompts, params):
            s, p, a = oracle_steps(list(done.prompt_token_ids), list(done.token_ids))
            tokens += len(done.token_ids)
            steps, proposing, accepted = steps + s, proposing + p, accepted + a
        cost = steps + proposing * (price - 1)
        print(
            f"{name}: {tokens} tokens in {steps} oracle steps, {proposing} with a proposal "
            f"({accepted / max(proposing, 1):.2f} accepted each); TPOT bound {tokens / steps:.2f}x "
            f"with free verification, {tokens / cost:.2f}x at {price:.2f}x a decode"
        )


if __name__ == "__main__":
    main()
