"""Multi-LoRA through the engine: many adapters in one continuous batch, each row its own.

The tiny transformers Llama of tests/models/helpers.py, served by jaxserve from its saved folder,
with random peft adapters (every target module, ranks 2-8, non-zero B) from `save_pretrained`.
- A batch that mixes the base model and 4 adapters gives every request what it gets served
  alone (greedy and seeded), and an adapter's greedy tokens through the engine are peft's.
- A prompt cached under one adapter is computed again under another (and under a new adapter
  that reuses an old one's name), and is served from the cache under the same one.
- 8 adapters with 2 device slots: all requests complete with their own outputs, adapters swap
  through the slots, and nothing compiles after warm-up.
"""

from __future__ import annotations

import json

import pytest

from jaxserve.engine.core import Engine
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.jobs.batch_job import run_batch
from jaxserve.sampling_params import SamplingParams
from tests.models.helpers import build_hf_model, make_adapter, save_hf, torch_one_thread
from tests.torch_reference import require_peft, require_torch

# The adapters are made with peft on a transformers model: the whole module needs torch.
torch = require_torch()
require_peft()

SHAPES = dict(
    max_num_seqs=8,
    max_num_batched_tokens=32,
    min_token_bucket=32,  # one bucket: each engine compiles its step once
    seq_bucket_factor=4,
    page_size=8,
    max_model_len=96,
    max_lora_rank=8,
    show_progress=False,
    dtype="float32",
)
PROMPTS = ([5, 9, 3, 77, 12], list(range(20, 41)), [100, 1, 2, 3, 4, 5, 6, 8, 90, 17, 64])
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(base folder, 8 adapter folders, their peft models) of the tiny Llama."""
    root = tmp_path_factory.mktemp("lora-engine")
    base = save_hf(build_hf_model("llama"), root / "base")
    folders, peft_models = [], []
    for i in range(8):
        folder = root / f"adapter{i}"
        model = make_adapter(
            build_hf_model("llama"), folder, seed=10 + i, r=2 + i % 7, alpha=4.0 + i
        )
        folders.append(folder)
        peft_models.append(model)
    return base, folders, peft_models


@pytest.fixture(scope="module")
def four(saved) -> Engine:
    """4 adapters from the command line's NAME=PATH, 4 slots."""
    base, folders, _ = saved
    lora = tuple(f"a{i}={folders[i]}" for i in range(4))
    return Engine(EngineConfig(model=str(base), lora=lora, max_loras=4, **SHAPES))


def alone(llm: LLM, prompt, params, lora) -> list[int]:
    (out,) = llm.generate([prompt], params, lora=lora)
    return out.token_ids


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(four, saved):
    llm = LLM(engine=four)
    adapters = [None, "a0", "a1", "a2", "a3"]
    jobs = [
        (prompt, params, lora)
        for p, prompt in enumerate(PROMPTS)
        for a, lora in enumerate(adapters)
        for params in (GREEDY, seeded(100 * p + a))
    ]
    mixed = llm.generate([j[0] for j in jobs], [j[1] for j in jobs], lora=[j[2] for j in jobs])
    for (prompt, params, lora), out in zip(jobs, mixed, strict=True):
        assert out.token_ids == alone(llm, prompt, params, lora), (prompt, params, lora)
    greedy = {
        (j[0][0], j[2]): o.token_ids for j, o in zip(jobs, mixed, strict=True) if j[1] is GREEDY
    }
    # Each adapter changes what the model says: a test where they added nothing passes above.
    assert all(greedy[(PROMPTS[1][0], a)] != greedy[(PROMPTS[1][0], None)] for a in adapters[1:])
    # And what it says is peft's: adapter a2's greedy tokens, through the whole engine.
    _, _, peft_models = saved
    ids = torch.tensor([PROMPTS[2]])
    with torch_one_thread():
        ref = peft_models[2].generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8
        )
    assert greedy[(PROMPTS[2][0], "a2")] == ref[0, len(PROMPTS[2]) :].tolist()


def served(engine: Engine, prompt, lora) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens served from the prefix cache) of one request alone."""
    rid = engine.add_request(prompt, GREEDY, lora=lora)
    tokens, cached = [], None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    return tokens, cached


def test_a_prompt_cached_under_one_adapter_is_recomputed_under_another(four):
    prompt = list(range(60, 85))  # 25 tokens: 3 full pages of 8 may be cached
    first = served(four, prompt, "a1")
    other = served(four, prompt, "a3")
    base = served(four, prompt, None)
    again = served(four, prompt, "a1")
    assert first[1] == 0
    assert other[1] == 0 and base[1] == 0
    assert again == (first[0], 24)
    assert other[0] != first[0]


def test_beam_search_carries_the_adapter(four):
    llm = LLM(engine=four)
    prompt = PROMPTS[0]
    base = llm.beam_search([prompt], beam_width=2, max_tokens=4)[0]
    beams = llm.beam_search([prompt], beam_width=2, max_tokens=4, lora="a0")[0]
    # Width 1 is greedy decoding: the adapter's greedy tokens, not the base model's.
    (greedy,) = llm.beam_search([prompt], beam_width=1, max_tokens=4, lora="a0")
    assert greedy[0].token_ids == alone(llm, prompt, GREEDY, "a0")[:4]
    assert [b.token_ids for b in beams] != [b.token_ids for b in base]


def test_eight_adapters_share_two_slots_without_a_compile(saved, four):
    base, folders, _ = saved
    engine = Engine(EngineConfig(model=str(base), max_loras=2, **SHAPES))
    for i, folder in enumerate(folders):
        engine.add_lora(f"b{i}", folder)  # at run time: registered in host memory
    # Each adapter served alone on the 4-slot engine is the reference (its first four)...
    four_llm = LLM(engine=four)
    expected = {}
    for i in range(4):
        for p, prompt in enumerate(PROMPTS[:2]):
            expected[(i, p)] = alone(four_llm, prompt, GREEDY, f"a{i}")
    # ... and, for the other four, the same engine with one request at a time.
    llm = LLM(engine=engine)
    for i in range(4, 8):
        for p, prompt in enumerate(PROMPTS[:2]):
            expected[(i, p)] = alone(llm, prompt, GREEDY, f"b{i}")
    warm = engine.metrics.stats.compiles_after_warmup
    loads = engine.scheduler.lora_slots.num_loads
    ids = {}
    for i in range(8):
        for p, prompt in enumerate(PROMPTS[:2]):
            ids[engine.add_request(prompt, GREEDY, lora=f"b{i}")] = (i, p)
    tokens = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        engine.scheduler.check_invariants()
        assert engine.scheduler.num_running <= 8
    for rid, key in ids.items():
        assert tokens[rid] == expected[key], key
    # 8 adapters through 2 slots: at least the 6 not in a slot at the start were loaded.
    assert engine.scheduler.lora_slots.num_loads - loads >= 6
    assert engine.metrics.stats.compiles_after_warmup == warm == 0
    # Unloaded, then a new adapter under the old name: its own weights, its own cache.
    engine.remove_lora("b5")
    with pytest.raises(ValueError, match="'b5' is not loaded"):
        engine.add_request(PROMPTS[0], GREEDY, lora="b5")
    engine.add_lora("b5", folders[6])
    # Cached under b6 just now: 2 full pages of 8 and 4 of the 5 tokens of the partial page
    # (forked; the last is computed for its logits)...
    assert served(engine, PROMPTS[1], "b6")[1] == 20
    assert served(engine, PROMPTS[1], "b5") == (expected[(6, 1)], 0)  # ...not under new b5
    engine.step()
    assert engine.metrics.stats.compiles_after_warmup == 0


def test_bad_adapters_are_refused_with_a_sentence(four, tmp_path):
    with pytest.raises(ValueError, match=r"adapter_config\.json does not exist"):
        four.add_lora("missing", tmp_path)
    with pytest.raises(ValueError, match="'a0' is loaded already"):
        four.add_lora("a0", tmp_path)
    with pytest.raises(ValueError, match="'nope' is not loaded; loaded adapters: 'a0'"):
        four.add_request([1, 2, 3], GREEDY, lora="nope")
    no_slots = dict(SHAPES, precompile=False)
    engine = Engine(EngineConfig(model=four.model.source, **no_slots), model=four.model)
    with pytest.raises(ValueError, match="no adapter slots"):
        engine.add_lora("x", tmp_path)
    assert engine.runner.lora is None  # no adapter arrays: the step is the plain one


def test_a_batch_job_line_names_its_adapter(four, tmp_path):
    lines = [
        {"id": "base", "prompt_token_ids": PROMPTS[1]},
        {"id": "a2", "prompt_token_ids": PROMPTS[1], "lora": "a2"},
        {"id": "a3", "prompt_token_ids": PROMPTS[1], "lora": "a3"},
        {"id": "bad", "prompt_token_ids": PROMPTS[1], "lora": "nope"},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({**line, "max_tokens": 8}) + "\n" for line in lines))
    defaults = SamplingParams(temperature=0.0, ignore_eos=True)
    summary = run_batch(four, src, dst, defaults=defaults, include_token_ids=True, progress=False)
    out = {r["id"]: r["token_ids"] for r in map(json.loads, dst.read_text().splitlines())}
    ((lineno, reason),) = summary.bad_lines
    assert lineno == 4 and "'nope' is not loaded" in reason and "bad" not in out
    llm = LLM(engine=four)
    for rid, lora in (("base", None), ("a2", "a2"), ("a3", "a3")):
        assert out[rid] == alone(llm, PROMPTS[1], GREEDY, lora), rid
