"""The prefix cache on the real engine: a request served from cached pages gives the tokens (and,
within float tolerance, the logprobs) it gets without the cache, greedy and seeded alike.

Every engine here reuses the stories260k weights and the small bucket ladders of conftest.py, so
their steps come from the persistent compilation cache after the first.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig
from jaxserve.runtime import compiles
from jaxserve.sampling_params import SamplingParams
from tests.engine.conftest import SMALL

PAGE = 16  # EngineConfig's page_size
VOCAB = 512  # stories260k


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _params(seeded: bool, max_tokens: int = 8) -> SamplingParams:
    if seeded:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1234, logprobs=0)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)


def _serve(engine: Engine, batches: list[list[tuple[str, list[int], SamplingParams]]]) -> dict:
    """Runs each batch to completion in turn; returns {id: (tokens, logprobs, cached tokens)}."""
    got: dict[str, tuple[list[int], list[float], int]] = {}
    for batch in batches:
        for rid, prompt, params in batch:
            engine.add_request(prompt, params, request_id=rid)
            got[rid] = ([], [], 0)
        while engine.has_unfinished():
            for out in engine.step():
                tokens, logprobs, _ = got[out.request_id]
                tokens += out.new_token_ids
                logprobs += [lp.logprob for lp in out.logprobs or []]
                got[out.request_id] = (tokens, logprobs, out.num_cached_tokens)
    return got


def _assert_same(cached: dict, uncached: dict) -> None:
    for rid, (tokens, logprobs, _) in uncached.items():
        assert cached[rid][0] == tokens, rid
        np.testing.assert_allclose(cached[rid][1], logprobs, atol=2e-4, err_msg=rid)


@pytest.fixture(scope="module")
def uncached(stories_engine) -> Engine:
    # Only the reference outputs are read from it (no compile count): it compiles what it steps.
    config = EngineConfig(**SMALL, enable_prefix_caching=False, precompile=False)
    return Engine(config, model=stories_engine.model)


@pytest.fixture(scope="module")
def cached(stories_engine) -> Engine:
    """An engine of this module alone: its cache holds only what these tests put there (each
    test's prompts are drawn from its own seed, so they share nothing with the others')."""
    return Engine(EngineConfig(**SMALL), model=stories_engine.model)


def test_prompts_sharing_0_1_several_or_all_full_pages_give_the_uncached_outputs(cached, uncached):
    rng = random.Random(0)
    system = _ids(rng, 4 * PAGE)  # 4 full pages
    warm_prompt = system + _ids(rng, 6)
    shares = {  # prompt, and the tokens its cache hit must cover
        "none": (_ids(rng, 40), 0),
        "one": (system[:PAGE] + _ids(rng, 20), PAGE),
        "several": (system[: 3 * PAGE] + _ids(rng, 9), 3 * PAGE),
        # The same prompt again: every full page, and 5 of the 6 tokens of warm's partial page,
        # forked (copied: the 6th is computed for its logits).
        "all": (warm_prompt, 4 * PAGE + 5),
        "whole-pages": (system, 3 * PAGE),  # ends on a page: its last one is computed again
    }
    queries = [
        (f"{name}-{'seeded' if seeded else 'greedy'}", prompt, _params(seeded))
        for name, (prompt, _) in shares.items()
        for seeded in (False, True)
    ]
    batches = [[("warm", warm_prompt, _params(False))], queries]
    want = _serve(uncached, batches)  # compiles what it steps (precompile=False)
    serving = compiles.serving()
    got = _serve(cached, batches)
    _assert_same(got, want)
    for rid, (_, _, num_cached) in got.items():
        name, kind = rid.rsplit("-", 1) if rid != "warm" else ("warm", "")
        expect = 0 if rid == "warm" else shares[name][1]
        if kind == "seeded":
            # Added just after the greedy query of the same prompt: it waits for that one's
            # pages (computed once, PrefixSharing.waits) and takes every full page and the
            # forked partial page, all but its last prompt token, which it computes; a prompt
            # that ends on a page has no partial page, and computes that whole last page.
            n = len(shares[name][0])
            expect = n - 1 if n % PAGE else (n - 1) // PAGE * PAGE
        assert num_cached == expect, rid
    assert all(num_cached == 0 for _, _, num_cached in want.values())
    # Hits move positions, not shapes: nothing in the process compiled while `cached` served.
    assert compiles.serving() == serving, f"compiled after warm-up: {compiles.recent()}"


def test_chunked_prefills_reuse_the_pages_a_running_request_just_computed(cached, uncached):
    # 150-token prompts on a 64-token budget: three chunks each. The second request arrives with
    # the first and finds the pages of the first's earlier chunks cached as it waits.
    rng = random.Random(1)
    long = _ids(rng, 150)
    batch = [
        ("first", long, _params(False, 12)),
        ("second", long[:140] + _ids(rng, 7), _params(True, 12)),
        ("third", long[:100] + _ids(rng, 30), _params(False, 12)),
    ]
    got, want = _serve(cached, [batch]), _serve(uncached, [batch])
    _assert_same(got, want)
    # second was admitted once first had computed 8 pages; third shares 6 full pages.
    assert (got["first"][2], got["second"][2], got["third"][2]) == (0, 8 * PAGE, 6 * PAGE)


def test_preemption_under_the_cache_keeps_the_outputs(stories_engine, uncached):
    """Pages for ~2.5 of 4 long requests that share a prefix: preempted requests resume from
    cached pages, and every output equals the uncached engine's."""
    short_of_pages = Engine(
        EngineConfig(
            num_pages=10,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            min_token_bucket=8,
            seq_bucket_factor=4,
            show_progress=False,
        ),
        model=stories_engine.model,
    )
    rng = random.Random(2)
    shared = _ids(rng, 2 * PAGE)
    batch = [
        (
            f"r{i}",
            shared + _ids(rng, 3 + i),
            SamplingParams(
                max_tokens=60, temperature=i % 2, seed=7 + i, logprobs=0, ignore_eos=True
            ),
        )
        for i in range(4)
    ]
    got, want = _serve(short_of_pages, [batch]), _serve(uncached, [batch])
    _assert_same(got, want)
    stats = short_of_pages.metrics.stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert short_of_pages.scheduler.num_pages_used == 0
    short_of_pages.scheduler.check_invariants()


def test_prefix_cache_metrics_in_the_stats_and_prometheus(cached):
    rng = random.Random(3)
    system = _ids(rng, 2 * PAGE)
    prompts = [system + _ids(rng, 4) for _ in range(3)]
    s, registry = cached.metrics.stats, cached.metrics.registry
    names = ("queries", "hits", "evictions")
    stats_before = [getattr(s, f"prefix_cache_{n}") for n in names]
    prom_before = [registry.get_sample_value(f"jaxserve_prefix_cache_{n}_total") for n in names]
    _serve(cached, [[("a", prompts[0], _params(False, 2))]])
    _serve(cached, [[(f"b{i}", p, _params(False, 2)) for i, p in enumerate(prompts[1:])]])
    stats_delta = [
        getattr(s, f"prefix_cache_{n}") - b for n, b in zip(names, stats_before, strict=True)
    ]
    prom_delta = [
        registry.get_sample_value(f"jaxserve_prefix_cache_{n}_total") - b
        for n, b in zip(names, prom_before, strict=True)
    ]
    assert stats_delta == prom_delta == [3 * 36, 2 * 32, 0]  # b0, b1 hit the 2 system pages
    assert s.prefix_cache_hit_rate == s.prefix_cache_hits / s.prefix_cache_queries
    rate = registry.get_sample_value("jaxserve_prefix_cache_hit_rate")
    assert 0 < rate == pytest.approx(s.prefix_cache_hit_rate)
    assert s.kv_pages_cached >= 2 and s.kv_pages_used == 0
    assert registry.get_sample_value("jaxserve_kv_pages_cached") == s.kv_pages_cached


def test_the_grpc_usage_carries_the_cached_prompt_tokens(cached):
    from service.grpc import convert

    rng = random.Random(4)
    prompt = _ids(rng, 3 * PAGE + 5)
    finals = []
    for rid in ("grpc-a", "grpc-b"):
        cached.add_request(prompt, _params(False, 2), request_id=rid)
        while cached.has_unfinished():
            finals += [out for out in cached.step() if out.finished]
    usage = [convert.response(out).usage for out in finals]
    assert [(u.prompt_tokens, u.cached_prompt_tokens) for u in usage] == [
        (3 * PAGE + 5, 0),
        (3 * PAGE + 5, 3 * PAGE + 4),  # 3 full pages, 4 of the partial page's 5 tokens forked
    ]


def test_samples_of_one_prompt_sent_together_compute_it_once(cached, uncached):
    # Four seeded samples of one 40-token prompt, added at once (as n=4 is served): the first
    # computes the prompt, the others wait for its 2 full pages and its partial page, take the
    # pages from the cache (the partial one copied) and compute only the last prompt token.
    prompt = _ids(random.Random(7), 40)
    batch = [
        (f"n{i}", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=50 + i, logprobs=0))
        for i in range(4)
    ]
    before = cached.metrics.stats.prompt_tokens
    got, want = _serve(cached, [batch]), _serve(uncached, [batch])
    _assert_same(got, want)
    assert [got[f"n{i}"][2] for i in range(4)] == [0, 39, 39, 39]
    # Each request's sampling step counts its last prompt token as generated, not prompt.
    assert cached.metrics.stats.prompt_tokens - before == 39


@pytest.fixture(scope="module")
def wide(stories_engine) -> Engine:
    """A budget of 1,024 tokens: four 200-token prompts fit one step, so nothing but the
    scheduler's wait for pages being computed keeps them from each computing their own."""
    # precompile=False: these tests step 2-3 of its 12 buckets and count no compiles.
    config = EngineConfig(
        **{**SMALL, "max_num_batched_tokens": 1024, "token_bucket_factor": 4}, precompile=False
    )
    return Engine(config, model=stories_engine.model)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_n4_on_a_200_token_prompt_holds_its_full_pages_once(wide, async_scheduling):
    # Issue 13's acceptance: n=4 uses the prompt's pages once. 200 tokens = 12 full pages + 8.
    # Shared, the four samples hold 12 pages together plus a private last page each; had each
    # computed its own prompt they would hold 4 x 13 pages.
    object.__setattr__(wide.config, "async_scheduling", async_scheduling)  # idle: safe to flip
    prompt = _ids(random.Random(11 + async_scheduling), 200)
    for i in range(4):
        wide.add_request(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=90 + i))
    peak = 0
    while wide.has_unfinished():
        wide.step()
        peak = max(peak, wide.metrics.stats.kv_pages_used)
    assert 13 <= peak <= 12 + 4, peak
