"""LoRA adapters against transformers + peft: the same adapter files, PeftModel's forward.

Random adapters (non-zero B: `init_lora_weights=False`) on every target module of the tiny
Llama and Qwen3 shapes are saved with peft's `save_pretrained` and loaded by
`checkpoints.peft.load_peft_adapter`. One ragged step then runs three sequences side by side,
each with another adapter slot (none, adapter 1, adapter 2, of different ranks padded to the
engine's maximum, one rsLoRA), so a token that read another row's adapter shows; logits must
match PeftModel's within 1e-4 in float32, and a greedy loop must pick peft's generate tokens.
The second half checks the loader's refusals, each with a sentence that names the problem.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoints
from checkpoints.peft import AdapterLoadError, load_peft_adapter
from jaxserve.models.loaded import layer_loop_of
from jaxserve.models.lora import TARGET_MODULES, empty_slots, set_slot, slot_weights
from tests.models.helpers import (
    PagedSession,
    build_hf_model,
    make_adapter,
    save_hf,
    torch_one_thread,
)
from tests.torch_reference import require_peft, require_torch

torch = require_torch()
peft = require_peft()

ATOL = 1e-4
MAX_RANK = 8
PROMPTS = ([5, 9, 3, 77, 12], list(range(20, 31)), [100, 1, 2, 3, 4, 5, 6, 8, 90])
GREEDY_TOKENS = 12


@pytest.fixture(scope="module", params=("llama", "qwen3"))
def setup(request, tmp_path_factory):
    """(peft models by slot, our model, our slot arrays) for one family."""
    family = request.param
    root = tmp_path_factory.mktemp(f"lora-{family}")
    hf = build_hf_model(family)
    loaded = checkpoints.load_model(save_hf(hf, root / "base"), dtype=jnp.float32)
    refs = {}
    loop = layer_loop_of(loaded.params)  # the slots are laid out as the params
    slots = empty_slots(loaded.config, 2, MAX_RANK, jnp.float32, loop)
    for slot, (r, alpha, rslora) in ((1, (4, 8.0, False)), (2, (8, 4.0, True))):
        path = root / f"adapter{slot}"
        # A fresh base each time: get_peft_model wraps the model it is given in place.
        refs[slot] = make_adapter(
            build_hf_model(family), path, seed=slot, r=r, alpha=alpha, rslora=rslora
        )
        adapter = load_peft_adapter(path, f"a{slot}", loaded.config, MAX_RANK)
        assert adapter.rank == r and adapter.target_modules == TARGET_MODULES
        weights = slot_weights(adapter, loaded.config, MAX_RANK, np.float32, loop)
        slots = jax.jit(set_slot, donate_argnums=0)(slots, jnp.int32(slot - 1), weights)
    refs[0] = hf
    return refs, loaded, slots


def peft_logits(model, ids):
    with torch_one_thread():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def test_logits_match_peft_per_row_adapter(setup):
    refs, loaded, slots = setup
    session = PagedSession(loaded, lora=slots)
    lora_of = (0, 1, 2)
    ids = [session.add_seq(lora_slot=s) for s in lora_of]
    logits = session.step(list(zip(ids, PROMPTS, strict=True)))
    for slot, ours, prompt in zip(lora_of, logits, PROMPTS, strict=True):
        ref = peft_logits(refs[slot], prompt)
        err = float(np.max(np.abs(ours - ref)))
        assert err <= ATOL, f"slot {slot}: max abs logit error {err:.3g} > {ATOL}"
    # The adapters change the logits: a test where they added nothing would pass above too.
    assert np.max(np.abs(logits[1] - peft_logits(refs[0], PROMPTS[1]))) > 0.1


def test_greedy_tokens_match_peft_generate(setup):
    refs, loaded, slots = setup
    session = PagedSession(loaded, lora=slots)
    lora_of = (2, 0, 1)
    ids = [session.add_seq(lora_slot=s) for s in lora_of]
    logits = session.step(list(zip(ids, PROMPTS, strict=True)))
    out = [[int(lg[-1].argmax())] for lg in logits]
    for _ in range(GREEDY_TOKENS - 1):
        logits = session.step([(i, [o[-1]]) for i, o in zip(ids, out, strict=True)])
        for o, lg in zip(out, logits, strict=True):
            o.append(int(lg[-1].argmax()))
    for slot, prompt, ours in zip(lora_of, PROMPTS, out, strict=True):
        ids_t = torch.tensor([prompt])
        with torch_one_thread():
            ref = refs[slot].generate(
                input_ids=ids_t,
                attention_mask=torch.ones_like(ids_t),
                do_sample=False,
                max_new_tokens=GREEDY_TOKENS,
            )
        assert ours == ref[0, len(prompt) :].tolist(), f"slot {slot}"


# ---- refusals -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory):
    """(adapter folder, base config) of a rank-4 adapter on the tiny Llama."""
    root = tmp_path_factory.mktemp("lora-errors")
    base = build_hf_model("llama")
    loaded = checkpoints.load_model(save_hf(base, root / "base"), dtype=jnp.float32)
    make_adapter(base, root / "a", seed=3, r=4, alpha=8.0)
    return root / "a", loaded.config


def test_rank_over_the_maximum_is_refused(llama_adapter):
    path, config = llama_adapter
    with pytest.raises(AdapterLoadError, match="rank 4, over the engine's max_lora_rank=2"):
        load_peft_adapter(path, "a", config, max_rank=2)


def test_another_base_shape_is_refused(llama_adapter):
    path, config = llama_adapter
    with pytest.raises(AdapterLoadError, match="trained for another base model"):
        load_peft_adapter(path, "a", config.replace(hidden_size=64), max_rank=8)
    with pytest.raises(AdapterLoadError, match="has 1 layers"):
        load_peft_adapter(path, "a", config.replace(num_layers=1), max_rank=8)


def test_missing_file_is_refused(llama_adapter, tmp_path):
    _, config = llama_adapter
    with pytest.raises(AdapterLoadError, match=r"adapter_config\.json does not exist"):
        load_peft_adapter(tmp_path, "a", config, max_rank=8)


def test_unsupported_target_module_and_dora_are_refused(tmp_path):
    base = build_hf_model("llama")
    config = checkpoints.load_model(save_hf(base, tmp_path / "base"), dtype=jnp.float32).config
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    peft.get_peft_model(base, lora).save_pretrained(tmp_path / "head")
    with pytest.raises(AdapterLoadError, match=r"lm_head.*cannot serve"):
        load_peft_adapter(tmp_path / "head", "head", config, max_rank=8)
    cfg_path = tmp_path / "head" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterLoadError, match="use_dora=true"):
        load_peft_adapter(tmp_path / "head", "head", config, max_rank=8)
