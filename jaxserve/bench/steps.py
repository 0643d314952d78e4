"""`jaxserve bench --profile steps`: the engine's step speed at llama-batched-bench's points.

Scheduling benchmarks (suite.py) say how well requests share the machine; this one says how fast
one step is, so the two can be told apart. It measures what the engine really does, through its
public loop (add_request / step), with the engine's own chunking and buckets:

- prefill: one prompt of 128 / 512 / 2048 tokens (capped by the model's context) with
  max_tokens=1, timed from add_request until its token comes back; best of 3 after a warm-up,
  a fresh random prompt each time so no cached prefix helps (S_PP in llama-batched-bench);
- decode: the batch filled with B requests (B = 1 / 16 / 64 / 256), every one past its prefill,
  then `decode_steps` steady-state steps timed (S_TG).

Beside each point: achieved GFLOP/s (2 x matmul params x tokens + attention) and GB/s (weights
read once per step + KV read), and the machine's ceilings measured in the same run: an XLA f32
matmul of the model's shapes and an XLA gemv streaming a ~512 MB matrix. Numbers are
measurements of one run on one machine: compare ratios taken in the same run, never absolutes
across runs.

Then the step-cost model (jaxserve/scheduling/cost_model.py) for an engine of the spec's
`cost_seqs` rows
and step budget: decode-only batches of every token bucket at a few contexts, then a stream of
random prompts whose chunks share steps with decodes, every step timed as the engine loop runs
it; fitted per token bucket and written beside steps.json as cost_model.json.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine import calibration
from jaxserve.engine.build import build_engine
from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.models.kv_pool import kv_bytes_per_page
from jaxserve.runtime.builder import DEFAULT_MAX_MODEL_LEN
from jaxserve.sampling_params import SamplingParams

PROMPT_LENS = (128, 512, 2048)
BATCHES = (1, 16, 64, 256)
GEMV_BYTES = 512 * 2**20


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepsSpec:
    """What `run_steps` measures and where it writes."""

    model: str | None
    dtype: str | None
    seed: int = 0
    quantization: str = "none"  # EngineConfig.quantization: both engines quantize at load
    prompt_lens: tuple[int, ...] = PROMPT_LENS
    batches: tuple[int, ...] = BATCHES
    decode_context: int = 64  # prompt tokens of each decoding request
    decode_steps: int = 16  # steady-state steps timed per batch
    repeats: int = 3  # prefill: best of this many, after one warm-up
    max_num_batched_tokens: int = 512  # the engine's step budget (prefill chunk size)
    compile_cache: str | None = None
    command: str = ""
    # The cost model's engine: its rows, and the contexts its decode batches are timed at.
    cost_seqs: int = 64
    cost_contexts: tuple[int, ...] = (32, 128, 512)
    cost_model: bool = True  # False: the llama-batched-bench points alone


def run_steps(spec: StepsSpec, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measures every point and both ceilings; returns the report `jaxserve bench` saves."""
    from checkpoints import load_model

    model = load_model(spec.model, dtype=spec.dtype, seed=spec.seed)
    mc = model.config
    context = min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    prompt_lens = [min(p, context - 1) for p in spec.prompt_lens]
    # The budget must leave room for prefill beside a full batch of decodes, or filling the
    # largest batch starves its last prompts.
    budget = max(spec.max_num_batched_tokens, 2 * max(spec.batches))
    fill_steps = math.ceil(max(spec.batches) * spec.decode_context / (budget / 2)) + 1
    max_tokens = fill_steps + spec.decode_steps + 4  # never reached while a batch is timed
    decode_len = spec.decode_context + max_tokens
    max_model_len = min(context, max(max(prompt_lens) + 1, decode_len))
    page = EngineConfig().page_size
    num_pages = max(math.ceil(max_model_len / page), max(spec.batches) * -(-decode_len // page))
    engine = build_engine(
        EngineConfig(
            max_num_seqs=max(spec.batches),
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            num_pages=num_pages,
            # Buckets compile when first used (in each point's warm-up), not all at start-up.
            precompile=False,
            show_progress=False,
            compilation_cache_dir=spec.compile_cache,
            quantization=spec.quantization,
        ),
        model=model,
    )
    shape = _ModelShape.of(engine)
    rng = np.random.default_rng(spec.seed)
    prefill = []
    for p in prompt_lens:
        best = _time_prefill(engine, p, spec.repeats, rng)
        prefill.append(shape.prefill_point(p, best, budget))
        log(f"prefill {p} tokens: {p / best:.1f} tok/s")
    decode = []
    for b in spec.batches:
        step_s, ctx = _time_decode(engine, b, spec.decode_context, max_tokens, spec, rng)
        decode.append(shape.decode_point(b, step_s, ctx))
        log(f"decode batch {b}: {step_s * 1e3:.1f} ms/step")
    ceilings = measure_ceilings(mc, budget)
    del engine  # its KV pool, before the cost model's engine allocates one
    report = {
        "command": spec.command,
        "model": model.source,
        "dtype": str(jnp.dtype(model.dtype)),
        "quantization": spec.quantization,
        "platform": jax.devices()[0].platform,
        "max_num_batched_tokens": budget,
        "params": shape.params,
        "weight_bytes": shape.weight_bytes,
        "prefill": prefill,
        "decode": decode,
        "ceilings": ceilings,
    }
    if spec.cost_model:
        cm = measure_cost_model(model, spec, log)
        log(cm.describe())
        report["cost_model"] = cm.to_json()
    return report


# ---- the step-cost model ------------------------------------------------------------------


def measure_cost_model(model, spec: StepsSpec, log: Callable[[str], None] = print):
    """Times steps of every token bucket at a few contexts on an engine of `spec.cost_seqs` rows
    and the spec's budget (jaxserve/engine/calibration.py, the engine's own warm-up calibration at
    full length); returns the fitted `cost_model.CostModel`."""
    mc = model.config
    context = min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    calib = calibration.Calibration(
        contexts=tuple(sorted({min(c, context - 8) for c in spec.cost_contexts})),
        decode_tokens=8,
        seed=spec.seed,
    )
    seqs = spec.cost_seqs
    engine = build_engine(
        EngineConfig(
            max_num_seqs=seqs,
            max_num_batched_tokens=max(spec.max_num_batched_tokens, seqs),
            max_model_len=max(calib.contexts) + 4 * calib.decode_tokens,
            compilation_cache_dir=spec.compile_cache,
            show_progress=False,
            quantization=spec.quantization,
        ),
        model=model,
    )
    return calibration.calibrate(engine, calib, log)


def _request(engine: Engine, prompt_len: int, max_tokens: int, rng) -> str:
    """Adds a greedy request of fresh random ids (no cached prefix can serve it)."""
    ids = rng.integers(3, engine.model.config.vocab_size, size=prompt_len).tolist()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.add_request(ids, params)


def _time_prefill(engine: Engine, prompt_len: int, repeats: int, rng) -> float:
    """Best seconds from add_request to the first token of one prompt, after one warm-up."""
    times = []
    for _ in range(1 + repeats):
        start = time.perf_counter()
        _request(engine, prompt_len, 1, rng)
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def _time_decode(engine: Engine, batch: int, context: int, max_tokens: int, spec, rng):
    """Seconds per steady-state decode step with `batch` requests, and their mean context."""
    ids = [_request(engine, context, max_tokens, rng) for _ in range(batch)]
    generated = dict.fromkeys(ids, 0)

    def step():
        for out in engine.step():
            generated[out.request_id] += len(out.new_token_ids)

    while min(generated.values()) < 1:  # every request past its prefill
        step()
    for _ in range(2):  # this batch's bucket compiles here, not in the timed steps
        step()
    before = sum(generated.values())
    start = time.perf_counter()
    for _ in range(spec.decode_steps):
        step()
    elapsed = time.perf_counter() - start
    if any(n >= max_tokens for n in generated.values()):
        raise RuntimeError(f"A request of batch {batch} finished while its decode was timed.")
    mean_ctx = context + (before + sum(generated.values())) / (2 * batch)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return elapsed / spec.decode_steps, mean_ctx


@dataclasses.dataclass(frozen=True)
class _ModelShape:
    """What one token costs in this model: matmul params, attention work, KV bytes."""

    params: int  # every parameter, the embedding table once
    weight_bytes: int  # read once per step
    layer_params: int  # matmul params of the decoder layers (excluding the embedding lookup)
    head_params: int  # the LM head, applied to one row per sequence
    attn_flops_per_pair: int  # per (query, key) pair over all layers: QK^T and PV
    kv_bytes_per_token: int

    @staticmethod
    def of(engine: Engine) -> _ModelShape:
        mc = engine.model.config
        leaves = jax.tree.leaves(engine.model.params)
        params = sum(int(np.size(x)) for x in leaves)
        weight_bytes = sum(int(np.size(x)) * jnp.dtype(x.dtype).itemsize for x in leaves)
        head = mc.hidden_size * mc.vocab_size
        embed = 0 if mc.tie_word_embeddings else head
        return _ModelShape(
            params=params,
            weight_bytes=weight_bytes,
            layer_params=params - head - embed,
            head_params=head,
            attn_flops_per_pair=4 * mc.num_layers * mc.num_heads * mc.head_dim,
            kv_bytes_per_token=kv_bytes_per_page(mc, 1, engine.model.dtype),
        )

    def prefill_point(self, tokens: int, seconds: float, budget: int) -> dict[str, Any]:
        steps = math.ceil(tokens / budget)
        flops = 2 * self.layer_params * tokens + 2 * self.head_params
        flops += self.attn_flops_per_pair * tokens * (tokens + 1) // 2
        # Each step reads the weights once and the KV written by the steps before it.
        kv_read = sum(min(budget * i, tokens) for i in range(steps)) * self.kv_bytes_per_token
        moved = self.weight_bytes * steps + kv_read
        return {
            "tokens": tokens,
            "steps": steps,
            "seconds": seconds,
            "tok_per_s": tokens / seconds,
            "gflop_per_s": flops / seconds / 1e9,
            "gb_per_s": moved / seconds / 1e9,
        }

    def decode_point(self, batch: int, step_s: float, context: float) -> dict[str, Any]:
        flops = batch * (2 * (self.layer_params + self.head_params))
        flops += self.attn_flops_per_pair * batch * context
        moved = self.weight_bytes + batch * context * self.kv_bytes_per_token
        return {
            "batch": batch,
            "context": context,
            "ms_per_step": step_s * 1e3,
            "tok_per_s": batch / step_s,
            "gflop_per_s": flops / step_s / 1e9,
            "gb_per_s": moved / step_s / 1e9,
        }


def _best_seconds(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def measure_ceilings(mc, tokens: int, gemv_bytes: int = GEMV_BYTES) -> dict[str, Any]:
    """The machine's f32 matmul rate on the model's shapes and its streaming bandwidth."""
    key = jax.random.key(0)
    matmul = {}
    for name, cols in (("mlp", mc.intermediate_size), ("lm_head", mc.vocab_size)):
        x = jax.random.normal(key, (tokens, mc.hidden_size), jnp.float32)
        w = jax.random.normal(key, (mc.hidden_size, cols), jnp.float32)
        seconds = _best_seconds(jax.jit(jnp.matmul), x, w)
        matmul[name] = 2 * tokens * mc.hidden_size * cols / seconds / 1e9
    cols = 4096
    rows = max(1, gemv_bytes // (4 * cols))
    w = jnp.ones((rows, cols), jnp.float32)
    v = jnp.ones((cols,), jnp.float32)
    gemv_s = _best_seconds(jax.jit(jnp.matmul), w, v)
    return {
        "matmul_gflop_per_s": max(matmul.values()),
        "matmul_shapes": {k: round(v, 1) for k, v in matmul.items()},
        "matmul_tokens": tokens,
        "gemv_gb_per_s": rows * cols * 4 / gemv_s / 1e9,
        "gemv_bytes": rows * cols * 4,
    }


def format_steps(report: dict[str, Any]) -> str:
    """The table printed to stdout: prefill and decode points beside the ceilings."""
    c = report["ceilings"]
    lines = [
        f"model {report['model']} ({report['dtype']}, {report['params'] / 1e6:.1f}M params, "
        f"{report['weight_bytes'] / 2**20:.0f} MiB, quantization "
        f"{report.get('quantization', 'none')}), "
        f"step budget {report['max_num_batched_tokens']} tokens",
        f"ceilings: matmul {c['matmul_gflop_per_s']:.1f} GFLOP/s, "
        f"gemv {c['gemv_gb_per_s']:.1f} GB/s",
        "",
        "| prefill tokens | steps | s | tok/s (S_PP) | GFLOP/s | GB/s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for p in report["prefill"]:
        lines.append(
            f"| {p['tokens']} | {p['steps']} | {p['seconds']:.3f} | {p['tok_per_s']:.1f} | "
            f"{p['gflop_per_s']:.1f} | {p['gb_per_s']:.1f} |"
        )
    lines += [
        "",
        "| decode batch | context | ms/step | tok/s (S_TG) | GFLOP/s | GB/s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for d in report["decode"]:
        lines.append(
            f"| {d['batch']} | {d['context']:.0f} | {d['ms_per_step']:.2f} | "
            f"{d['tok_per_s']:.1f} | {d['gflop_per_s']:.1f} | {d['gb_per_s']:.1f} |"
        )
    return "\n".join(lines)
