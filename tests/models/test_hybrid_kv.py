"""The device side of the hybrid KV pool (kv_pool.KVLayout): a Gemma step over a pool of
[k, pages, ...] whose groups read their own page tables gives the uniform pool's logits.

The tiny random Gemma 2 and Gemma 3 of test_gemma_parity (window 6, pages of 4) run three
prompts chunked across the window's edge, batched, then decode steps, twice: over a uniform
pool, and over a hybrid one where every group maps each logical page to its own page IDs (a
shuffle) and a local group's entries for pages wholly outside its window point at pages of
other sequences, their contents overwritten with large finite garbage before every step (as the
host allocator frees and reuses them). Logits must agree within 1e-5 on every path the CPU
has: the jnp loops, the fused C++ call (Gemma 3; checked in the lowered step), the reference
backend and the Pallas TPU and Triton kernels in interpret mode (the prefill), and a precompiled
ModelRunner fed by an InputBatch. Also: kv_layout on the named shapes, and a uniform step
compiled exactly as before.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoints
from checkpoints.config_json import layer_loop_of
from jaxserve.models import llama
from jaxserve.models.kv_pool import KVLayout, KVPages, init_kv_pages, kv_bytes_per_page, kv_layout
from jaxserve.models.step_batch import SeqChunk, pack_chunks, to_words
from jaxserve.runtime.input_batch import InputBatch
from jaxserve.runtime.model_runner import ModelRunner, RunnerConfig, step_words
from jaxserve.runtime.sampling import PenaltyState, SamplingBatch, mask_words
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduling.request import Request
from jaxserve.scheduling.types import ScheduledSeq
from pallas_kernels.ragged_paged_attention import cpu_ffi
from tests.models.test_gemma_parity import PROMPTS, pair  # noqa: F401 - the fixture

ATOL = 1e-5
PAGE, PAGES_PER_SEQ, NUM_PAGES = 4, 12, 160
BUCKET = dict(num_tokens=32, num_seqs=4, page_size=PAGE, pages_per_seq=PAGES_PER_SEQ)
CHUNK = 5
GARBAGE = 1e3  # the scale of the reused pages' contents: large, finite


@functools.partial(jax.jit, static_argnames=("config", "backend", "layout", "path"))
def _step(config, backend, layout, path, params, kv, batch):
    """Logits f32[T, V] and the new pool of one step (`path` only keys the jit cache: the
    tests switch the fused call off by patching cpu_ffi between traces)."""
    del path
    model = checkpoints.model_for(
        config,
        jnp.float32,
        attention_backend=backend,
        layer_loop=layer_loop_of(params),
        kv_layout=layout,
    )
    hidden, kv = model.apply({"params": params}, kv, batch)
    return model.apply({"params": params}, hidden, method="logits"), kv


class _Pool:
    """One pool and the page tables of each (group, sequence): uniform (one group, pages in
    order) or hybrid (`layout`: every group's pages drawn from one shuffled ID space)."""

    def __init__(self, config, layout: KVLayout | None, rng: np.random.Generator):
        self.layout = layout
        self.groups = 1 if layout is None else layout.num_groups
        self.windows = (None,) if layout is None else layout.windows
        self.trashed = 0  # dead pages overwritten with garbage so far
        kv = init_kv_pages(config, num_pages=NUM_PAGES, page_size=PAGE, layout=layout)
        ids = rng.permutation(np.arange(1, NUM_PAGES)) if layout else np.arange(1, NUM_PAGES)
        per = PAGES_PER_SEQ
        # tables[g][s]: sequence s's pages in group g, disjoint from every other (g, s)'s.
        self.tables = [
            [list(ids[(g * len(PROMPTS) + s) * per : (g * len(PROMPTS) + s + 1) * per])
             for s in range(len(PROMPTS))]
            for g in range(self.groups)
        ]  # fmt: skip
        noise = rng.standard_normal(kv.kv.shape).astype(np.float32) * GARBAGE
        self.kv = KVPages(kv=jnp.asarray(noise if layout else np.zeros_like(noise)))

    def chunk(self, s: int, tokens, start: int) -> SeqChunk:
        """Sequence s's chunk; in a hybrid pool a local group's pages wholly before the window of
        the chunk's first token (so of every later one) point at another sequence's pages."""
        n = -(-(start + len(tokens)) // PAGE)
        tables = []
        for g in range(self.groups):
            table = list(self.tables[g][s][:n])
            window = self.windows[g]
            if window is not None:
                other = self.tables[0][(s + 1) % len(PROMPTS)]
                for j in range(n):
                    if (j + 1) * PAGE <= start - window:  # its last position is out of reach
                        table[j] = other[j]
            tables.append(table)
        return SeqChunk(list(tokens), start, tables[0], group_tables=tuple(tables[1:]))

    def dead_pages(self, s: int, start: int) -> list[int]:
        """Local groups' own pages of sequence s wholly out of the window at `start`: freed, so
        another sequence may have written anything into them."""
        return [
            self.tables[g][s][j]
            for g in range(1, self.groups)
            if self.windows[g] is not None
            for j in range(PAGES_PER_SEQ)
            if (j + 1) * PAGE <= start - self.windows[g]
        ]

    def trash(self, pages: list[int], rng: np.random.Generator) -> None:
        if self.layout is None or not pages:
            return
        self.trashed += len(pages)
        kv = np.array(self.kv.kv)
        kv[:, pages] = rng.standard_normal(kv[:, pages].shape) * GARBAGE
        self.kv = KVPages(kv=jnp.asarray(kv))


OPCODE = r"^\s*(?:ROOT\s+)?\S+\s*=\s*.*?\s([a-z][\w\-]*)\("


def _run(loaded, layout, backend, path, rng, prefill_only=False):
    """Chunked prefill of PROMPTS (batched, chunks of CHUNK, straddling the window) then three
    batched decode steps; the logits of every step's tokens, concatenated, and the pool."""
    c = loaded.config
    pool = _Pool(c, layout, rng)
    done = [0] * len(PROMPTS)
    seqs = [list(p) for p in PROMPTS]
    out = []

    def step(chunks_of):
        chunks = [pool.chunk(s, tokens, start) for s, tokens, start in chunks_of]
        pool.trash([p for s, _, start in chunks_of for p in pool.dead_pages(s, start)], rng)
        batch = pack_chunks(chunks, **BUCKET, num_pages=NUM_PAGES, num_groups=pool.groups)
        logits, pool.kv = _step(c, backend, layout, path, loaded.params, pool.kv, batch)
        total = sum(len(t) for _, t, _ in chunks_of)
        out.append(np.asarray(logits)[:total])

    while any(d < len(p) for d, p in zip(done, PROMPTS, strict=True)):
        todo = [s for s in range(len(PROMPTS)) if done[s] < len(PROMPTS[s])]
        step([(s, PROMPTS[s][done[s] : done[s] + CHUNK], done[s]) for s in todo])
        for s in todo:
            done[s] = min(done[s] + CHUNK, len(PROMPTS[s]))
    for k in range(0 if prefill_only else 3):  # decode steps of made-up tokens, all batched
        tokens = [(11 + 7 * k + 3 * s) % c.vocab_size for s in range(len(seqs))]
        step([(s, [tokens[s]], len(seqs[s])) for s in range(len(seqs))])
        for s in range(len(seqs)):
            seqs[s].append(tokens[s])
    return np.concatenate(out), pool


def _compare(loaded, backend, path="default", prefill_only=False):
    layout = kv_layout(loaded.config, hybrid=True)
    assert layout.num_groups > 1
    uniform, _ = _run(loaded, None, backend, path, np.random.default_rng(0), prefill_only)
    hybrid, pool = _run(loaded, layout, backend, path, np.random.default_rng(1), prefill_only)
    assert pool.kv.kv.shape[0] == layout.group_size < loaded.config.num_layers
    assert np.isfinite(uniform).all() and pool.trashed > 0
    err = float(np.max(np.abs(hybrid - uniform)))
    print(f"\n{loaded.config.architecture} {backend} {path}: max |diff| {err:.3g}")
    assert err <= ATOL, f"{backend} ({path}): hybrid logits differ from uniform by {err:.3g}"


def test_xla_jnp_path(pair, monkeypatch):  # noqa: F811
    """The jnp loops (the native calls switched off), every layer at its slot and table."""
    _, loaded = pair
    monkeypatch.setattr(cpu_ffi, "ragged_available", lambda head_dim: False)
    _compare(loaded, "xla", path="jnp")


def test_fused_cpu_path(pair):  # noqa: F811
    """Gemma 3's fused C++ call (RoPE, write, attention) gets each layer's slot and table;
    Gemma 2 (soft caps) never lowers to it, and its default path is the jnp one."""
    _, loaded = pair
    c = loaded.config
    if c.attn_logit_softcap is None:
        if not cpu_ffi.ragged_available(c.head_dim):
            pytest.skip("the fused CPU call is not built here (no AVX-512 or no compiler)")
        layout = kv_layout(c, hybrid=True)
        pool = _Pool(c, layout, np.random.default_rng(0))
        chunks = [pool.chunk(s, PROMPTS[s][:CHUNK], 0) for s in range(len(PROMPTS))]
        batch = pack_chunks(chunks, **BUCKET, num_pages=NUM_PAGES, num_groups=pool.groups)
        text = _step.lower(c, "xla", layout, "fused", loaded.params, pool.kv, batch).as_text()
        assert text.count("jaxserve_rope_write_attention") == c.num_layers
    _compare(loaded, "xla", path="fused")


def test_reference_backend(pair):  # noqa: F811
    _, loaded = pair
    _compare(loaded, "reference")


@pytest.mark.parametrize("backend", ["pallas_tpu_interpret", "pallas_gpu_interpret"])
def test_pallas_kernels_interpreted(pair, backend):  # noqa: F811
    """The TPU and Triton kernels in interpret mode take one table a call: each layer's group's
    (the chunked prefill only: interpreting is slow)."""
    _, loaded = pair
    _compare(loaded, backend, prefill_only=True)


def test_the_scan_refuses_a_hybrid_layout(pair):  # noqa: F811
    """resolve_layer_loop unrolls a Gemma whatever is asked, so the check is called directly."""
    _, loaded = pair
    c = loaded.config
    with pytest.raises(ValueError, match="needs the unrolled layer loop"):
        llama._checked_layout(kv_layout(c, hybrid=True), c, "scan")
    assert llama._checked_layout(KVLayout.uniform(c.num_layers), c, "scan") is None


def test_kv_layout_of_the_named_shapes():
    g3 = kv_layout(checkpoints.NAMED_SHAPES["gemma3-1b"], hybrid=True)
    assert (g3.group_size, g3.num_groups) == (4, 7)
    assert g3.windows == (None,) + (512,) * 6
    assert [g3.layer_group[i] for i in (5, 11, 17, 23)] == [0] * 4
    assert [g3.layer_slot[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    assert g3.layer_group[:5] == (1, 1, 1, 1, 2) and g3.layer_group[24:] == (6, 6)
    g2 = kv_layout(checkpoints.NAMED_SHAPES["gemma2-2b"], hybrid=True)
    assert (g2.group_size, g2.num_groups, g2.windows) == (13, 2, (None, 4096))
    assert g2.layer_group == (1, 0) * 13 and g2.layer_slot[:4] == (0, 0, 1, 1)
    for name in ("gemma3-1b", "gemma2-2b", "llama-tiny"):
        config = checkpoints.NAMED_SHAPES[name]
        assert kv_layout(config, hybrid=False) == KVLayout.uniform(config.num_layers)
    uniform = KVLayout.uniform(30)
    assert kv_layout(checkpoints.NAMED_SHAPES["smollm2-135m"], hybrid=True) == uniform
    assert uniform.is_uniform and uniform.num_groups == 1 and uniform.group_size == 30
    c = checkpoints.NAMED_SHAPES["gemma3-1b"]
    assert kv_bytes_per_page(c, 16, jnp.bfloat16, layout=g3) * 26 == (
        kv_bytes_per_page(c, 16, jnp.bfloat16) * 4
    )


def test_kv_layout_refuses_bad_input():
    with pytest.raises(ValueError, match="Group 0 must be a full-attention group"):
        KVLayout(1, (6, None), (0, 1), (0, 0))
    with pytest.raises(ValueError, match="its own"):
        KVLayout(2, (None,), (0, 0), (0, 0))
    with pytest.raises(ValueError, match="slot per layer"):
        KVLayout(2, (None,), (0, 0), (0,))


def test_a_uniform_step_compiles_as_before():
    """The zero-row group fields of a uniform batch add no op to the compiled step: it is the
    step of a batch without them (what every step was before hybrid pools)."""
    loaded = checkpoints.load_model("llama-tiny", dtype=jnp.float32)
    c = loaded.config
    module = checkpoints.model_for(c, jnp.float32, layer_loop=layer_loop_of(loaded.params))
    kv = init_kv_pages(c, num_pages=16, page_size=4)
    chunks = [SeqChunk([1, 2, 3], 0, [1])]
    shape = dict(num_tokens=8, num_seqs=2, page_size=4, pages_per_seq=4, num_pages=16)
    batch = pack_chunks(chunks, **shape)
    before = dataclasses.replace(batch, group_tables=None, group_slots=None)
    pen, last = PenaltyState.zeros(2, c.vocab_size), jnp.zeros(2, jnp.int32)
    mask = jnp.full((2, mask_words(c.vocab_size)), -1, jnp.int32)
    texts = []
    for b in (batch, before):
        words = to_words((b, SamplingBatch.empty(2)))
        step = jax.jit(functools.partial(step_words, module), static_argnums=(6,))
        lowered = step.lower(loaded.params, kv, words.words, pen, last, mask, words.layout)
        text = re.sub(r", metadata=\{[^}]*\}", "", lowered.compile().as_text())
        # The ops by opcode: instruction names carry process-wide counters (a suite's earlier
        # compiles renumber them), the opcodes and their counts do not.
        texts.append(collections.Counter(re.findall(OPCODE, text, re.M)))
    assert texts[0] == texts[1] and sum(texts[0].values()) > 10


def _runner_tokens(loaded, layout: KVLayout | None) -> tuple[tuple, list[list[int]]]:
    """Greedy tokens of two prompts through a precompiled ModelRunner of `layout` packed by an
    InputBatch (prefill, then decode steps that feed the sampled tokens back), and its pool's
    shape."""
    rc = RunnerConfig(
        num_pages=NUM_PAGES,
        page_size=PAGE,
        max_model_len=PAGES_PER_SEQ * PAGE,
        token_buckets=(8, 64),
        seq_buckets=(2,),
        attention_backend="xla",
        kv_layout=layout,
    )
    runner = ModelRunner(loaded, rc)
    runner.precompile(progress=False)  # its own batches (padding, warm-ups) carry the groups
    inputs = InputBatch(
        max_seqs=2,
        pages_per_seq=rc.pages_per_seq,
        page_size=PAGE,
        num_pages=NUM_PAGES,
        token_buckets=rc.token_buckets,
        seq_bucket_for=rc.seq_bucket_for,
        num_groups=rc.num_groups,
    )
    pool = _Pool(loaded.config, layout, np.random.default_rng(2))
    reqs = [
        Request(
            request_id=f"r{s}",
            prompt_token_ids=list(PROMPTS[s]),
            sampling_params=SamplingParams(max_tokens=4, seed=s),
            arrival_time=0.0,
        )
        for s in range(2)
    ]
    seqs = [list(PROMPTS[s]) for s in range(2)]
    out: list[list[int]] = [[], []]
    for _ in range(4):
        # The live lists of the whole request, as the KV manager keeps them (ScheduledSeq).
        plan = []
        for s, req in enumerate(reqs):
            start = len(seqs[s]) - 1 if out[s] else 0  # the prompt, then the last token
            new = seqs[s][start:]
            chunk = pool.chunk(s, new, start)
            plan.append(
                ScheduledSeq(
                    req, req.request_id, s, new, start, chunk.page_table, True, 0,
                    tuple(chunk.group_tables),
                )
            )  # fmt: skip
        step = inputs.pack(plan)
        tokens = np.asarray(runner.execute(step.batch, step.sampling, step.words).token_ids)
        for s in range(2):
            out[s].append(int(tokens[s]))
            seqs[s].append(int(tokens[s]))
    assert runner.num_compiles == len(rc.buckets())  # serving met precompile's shapes
    return runner.kv.kv.shape, out


def test_the_runner_serves_a_hybrid_pool(pair):  # noqa: F811
    """RunnerConfig.kv_layout: the runner's pool is [k, ...], the input batch packs the groups'
    tables into the words, and greedy tokens match the uniform runner's."""
    _, loaded = pair
    layout = kv_layout(loaded.config, hybrid=True)
    shape, hybrid = _runner_tokens(loaded, layout)
    uniform_shape, uniform = _runner_tokens(loaded, None)
    assert shape[0] == layout.group_size and uniform_shape[0] == loaded.config.num_layers
    assert hybrid == uniform
