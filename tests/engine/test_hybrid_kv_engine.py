"""The hybrid KV pool behind the engine (issue 46, item 3): a tiny random Gemma 2 and Gemma 3
(window 6, pages of 16) served with kv_layout="hybrid", where the local layers' pages go back to
the pool once they leave the window. Greedy tokens equal transformers' `generate` on prompts
many windows long, chunked across the window's edge, batched, under page pressure that
preempts, and with prefix-cache hits; the pool holds fewer bytes than the uniform one."""

from __future__ import annotations

import shutil

import pytest

from checkpoints import DEFAULT_MODEL_DIR
from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.runtime import compiles
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import SMALL, drain
from tests.engine.test_moe_engine import TOKENIZER_FILES, _hf_greedy
from tests.models.gemma_helpers import GEMMA_FAMILIES, build_gemma
from tests.models.helpers import save_hf

LONG = [
    "Once upon a time, " * 24,
    "The little dog ran to the park and saw a big red ball. " * 8,
    "Lily liked to play. " * 40,
    "Tom had a boat. It was blue. " * 18,
]


@pytest.fixture(scope="module", params=GEMMA_FAMILIES)
def folder(request, tmp_path_factory):
    """(transformers model, its folder with the embedded model's tokenizer beside it)."""
    hf = build_gemma(request.param, vocab_size=512, max_position_embeddings=1024)
    path = save_hf(hf, tmp_path_factory.mktemp(request.param))
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    return hf, path


@pytest.fixture(scope="module")
def hybrid(folder):
    hf, path = folder
    return hf, Engine(EngineConfig(model=str(path), kv_layout="hybrid", **SMALL))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_the_pool_is_grouped(hybrid):
    """The layout the engine resolved: k layers a page, the local groups windowed."""
    _, engine = hybrid
    layout = engine.runner.config.kv_layout
    assert layout.num_groups > 1 and layout.windows[0] is None
    assert set(layout.windows[1:]) == {6}
    assert engine.runner.kv.kv.shape[0] == layout.group_size
    assert engine.scheduler.kv.windows == layout.windows


def test_long_prompts_batched_match_transformers(hybrid):
    hf, engine = hybrid
    outs = LLM(engine=engine).generate(LONG, _greedy(20))
    for prompt, out in zip(LONG, outs, strict=True):
        assert len(out.prompt_token_ids) > SMALL["max_num_batched_tokens"]  # chunked
        assert out.token_ids == _hf_greedy(hf, out.prompt_token_ids, 20), prompt


def _run(engine, prompt: list[int], n: int) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens served from the cache) of one request run alone."""
    engine.add_request(prompt, _greedy(n))
    outs = drain(engine)
    return [t for o in outs for t in o.new_token_ids], outs[-1].num_cached_tokens


def test_prefix_hits_are_exact(hybrid):
    """The same long prompt again hits the cache (its window's local pages were kept as the
    window slid), and a prompt sharing its start hits the shared pages; both decode as
    transformers does."""
    hf, engine = hybrid
    prompt = engine.tokenizer(LONG[2])["input_ids"]
    first, _ = _run(engine, prompt, 12)  # cached by the test before, or not
    again, cached_again = _run(engine, prompt, 12)
    assert cached_again == 16 * ((len(prompt) - 1) // 16)  # every full page
    assert again == first == _hf_greedy(hf, prompt, 12)
    forked = prompt[:100] + engine.tokenizer("Then she went home.")["input_ids"][1:]
    tokens, cached_fork = _run(engine, forked, 12)
    assert cached_fork == 96
    assert tokens == _hf_greedy(hf, forked, 12)
    engine.scheduler.kv.check_invariants()


def test_fewer_pool_bytes_than_uniform(folder):
    """One 200-token prompt decoding: the hybrid pool holds its global layers' pages and only
    the window's of the local ones; the uniform pool every page of every layer."""
    _, path = folder
    held = {}
    for layout in ("hybrid", "uniform"):
        engine = Engine(EngineConfig(model=str(path), kv_layout=layout, **SMALL))
        prompt = engine.tokenizer(LONG[2] * 3)["input_ids"][:200]
        engine.add_request(prompt, _greedy(30))
        peak = 0
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, engine.scheduler.kv.num_used_pages)
        held[layout] = peak * engine.runner.kv.kv.shape[0]  # layer-pages: layers a page holds
    assert held["uniform"] == engine.model.config.num_layers * -(-229 // 16)
    assert held["hybrid"] < 0.75 * held["uniform"], held


def test_page_pressure_preempts_and_stays_exact(folder):
    """A pool of 44 pages (one long prompt holds up to 38) for four of them: requests are
    preempted and recomputed, their local pages released and taken again, and every output is
    still transformers'."""
    hf, path = folder
    engine = Engine(EngineConfig(model=str(path), kv_layout="hybrid", num_pages=44, **SMALL))
    outs = LLM(engine=engine).generate(LONG, _greedy(16))
    assert engine.scheduler.num_preemptions > 0
    for out in outs:
        assert out.token_ids == _hf_greedy(hf, out.prompt_token_ids, 16)


def test_never_compiles_after_warmup(hybrid):
    _, engine = hybrid
    before, serving = engine.runner.num_compiles, compiles.serving()
    for i in range(8):
        engine.add_request(LONG[i % 4], SamplingParams(max_tokens=3 + i, temperature=0.7))
        engine.step()
    drain(engine)
    assert engine.runner.num_compiles == before
    assert compiles.serving() == serving, f"compiled after warm-up: {compiles.recent()}"


def test_a_hit_whose_local_pages_were_evicted_is_cut_and_exact(folder):
    """A prompt, then others that evict the cache's oldest pages (the local ones, released
    first), then the prompt again: its hit stops where a local window is missing, and the
    tokens are still transformers' (a hit that read evicted local pages would not be)."""
    hf, path = folder
    engine = Engine(EngineConfig(model=str(path), kv_layout="hybrid", num_pages=56, **SMALL))
    prompt = engine.tokenizer(LONG[2])["input_ids"]
    _run(engine, prompt, 4)
    for text in (LONG[0], LONG[3]):
        _run(engine, engine.tokenizer(text)["input_ids"], 4)
    tokens, cached = _run(engine, prompt, 8)
    assert cached < 16 * ((len(prompt) - 1) // 16)  # cut: not every full page's window is left
    assert tokens == _hf_greedy(hf, prompt, 8)
    engine.scheduler.kv.check_invariants()


@pytest.mark.parametrize(
    ("shape", "asked", "host_kv_gb", "groups"),
    [
        ("gemma3-1b", "auto", None, 7),
        ("gemma2-2b", "auto", None, 2),
        ("gemma3-1b", "auto", 1.0, 1),  # a host pool asked for: uniform
        ("gemma3-1b", "uniform", None, 1),
        ("llama-tiny", "auto", None, 1),
    ],
)
def test_the_engine_picks_the_layout(shape, asked, host_kv_gb, groups):
    from checkpoints import NAMED_SHAPES
    from jaxserve.runtime.aot import resolve_kv_layout

    config = EngineConfig(model=shape, kv_layout=asked, host_kv_gb=host_kv_gb)
    layout = resolve_kv_layout(config, NAMED_SHAPES[shape])
    assert (1 if layout is None else layout.num_groups) == groups


def test_hybrid_on_a_uniform_model_is_refused():
    from checkpoints import NAMED_SHAPES
    from jaxserve.runtime.aot import resolve_kv_layout

    with pytest.raises(ValueError, match="needs layers of both full and windowed attention"):
        resolve_kv_layout(EngineConfig(kv_layout="hybrid"), NAMED_SHAPES["llama-tiny"])
