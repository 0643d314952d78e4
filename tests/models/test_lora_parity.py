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
from jaxserve.models.lora import (
    TARGET_MODULES,
    empty_slots,
    lora_delta,
    set_slot,
    slot_weights,
)
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


def test_the_gather_kernel_matches_peft_and_the_dense_kernel(setup, monkeypatch):
    """The step with the `gather` update ($JAXSERVE_LORA_KERNEL, read when the step traces):
    the same rows as the first test, logits within ATOL of PeftModel's. A step of its own
    (jitted afresh), since the shared one is cached with the default kernel."""
    from tests.models import helpers

    refs, loaded, slots = setup
    monkeypatch.setenv("JAXSERVE_LORA_KERNEL", "gather")
    fresh = jax.jit(
        helpers.paged_step.__wrapped__,
        static_argnames=("config", "dtype"),
        donate_argnames=("kv",),
    )
    monkeypatch.setattr(helpers, "paged_step", fresh)
    session = PagedSession(loaded, lora=slots)
    lora_of = (1, 0, 2)
    ids = [session.add_seq(lora_slot=s) for s in lora_of]
    logits = session.step(list(zip(ids, PROMPTS, strict=True)))
    for slot, ours, prompt in zip(lora_of, logits, PROMPTS, strict=True):
        err = float(np.max(np.abs(ours - peft_logits(refs[slot], prompt))))
        assert err <= ATOL, f"gather, slot {slot}: max abs logit error {err:.3g} > {ATOL}"


def test_both_kernels_compute_each_token_s_own_update(setup):
    """`lora_delta` of every module and layer, each kernel, against x @ A[slot] @ B[slot] in
    numpy per token (slot 0: nothing), tokens of the three slots interleaved."""
    _, loaded, slots = setup
    rng = np.random.default_rng(5)
    token_slots = np.array([2, 0, 1, 1, 2, 0, 2], np.int32)
    for module in TARGET_MODULES:
        for layer in range(loaded.config.num_layers):
            # This layer's arrays as the layer loop reads them: stacked (scan) or its own.
            tree = slots["layers"] if "layers" in slots else slots[f"layers_{layer}"]
            a, b = np.asarray(tree[module]["a"]), np.asarray(tree[module]["b"])
            if a.ndim == 4:
                a, b = a[layer], b[layer]  # [in, M, R], [M, R, out]
            x = rng.normal(size=(len(token_slots), a.shape[0])).astype(np.float32)
            want = np.stack(
                [
                    x[t] @ a[:, s - 1] @ b[s - 1] if s else np.zeros(b.shape[-1], np.float32)
                    for t, s in enumerate(token_slots)
                ]
            )
            for kernel in ("dense", "gather"):
                got = lora_delta(
                    tree, module, jnp.int32(layer), jnp.asarray(x), jnp.asarray(token_slots), kernel
                )
                np.testing.assert_allclose(
                    np.asarray(got), want, atol=1e-4, rtol=1e-4, err_msg=f"{kernel} {module}"
                )


def test_rank_and_alpha_patterns_load_as_peft_applies_them(tmp_path):
    """PEFT's per-module overrides: rank_pattern and alpha_pattern keyed by a module's name or
    a suffix of it (one key for a module in every layer, one for a single layer's). Each
    module's B carries peft's own scaling for it (the `scaling` of its LoRA layer), and the
    logits are PeftModel's."""
    base = build_hf_model("llama")
    loaded = checkpoints.load_model(save_hf(base, tmp_path / "base"), dtype=jnp.float32)
    ref = make_adapter(
        build_hf_model("llama"),
        tmp_path / "patterned",
        seed=11,
        r=2,
        alpha=4.0,
        rank_pattern={"q_proj": 6, "layers.1.mlp.down_proj": 8},
        alpha_pattern={"v_proj": 24.0, "model.layers.0.self_attn.o_proj": 1.0},
    )
    adapter = load_peft_adapter(tmp_path / "patterned", "p", loaded.config, MAX_RANK)
    assert adapter.rank == 8
    layers = ref.base_model.model.model.layers
    scales = {}
    for i, layer in enumerate(layers):
        for module in TARGET_MODULES:
            lora = getattr(layer.self_attn if module[0] in "qkvo" else layer.mlp, module)
            r = lora.r["default"]
            a, b = adapter.weights[module]
            want_b = lora.lora_B["default"].weight.detach().numpy().T * lora.scaling["default"]
            np.testing.assert_allclose(b[i, :r], want_b, rtol=1e-6, err_msg=f"{i} {module}")
            assert not b[i, r:].any()  # a rank under the module's widest is zero-padded
            want_a = lora.lora_A["default"].weight.detach().numpy().T
            np.testing.assert_array_equal(a[i, :, :r], want_a)
            scales[i, module] = (r, lora.scaling["default"])
    # The patterns did take effect (peft's own view): ranks 6 and 8, alphas 24 and 1.
    assert scales[0, "q_proj"] == scales[1, "q_proj"] == (6, 4.0 / 6)
    assert scales[1, "down_proj"] == (8, 4.0 / 8) and scales[0, "down_proj"] == (2, 2.0)
    assert scales[0, "v_proj"] == scales[1, "v_proj"] == (2, 12.0)
    assert scales[0, "o_proj"] == (2, 0.5) and scales[1, "o_proj"] == (2, 2.0)
    loop = layer_loop_of(loaded.params)
    slots = empty_slots(loaded.config, 1, MAX_RANK, jnp.float32, loop)
    weights = slot_weights(adapter, loaded.config, MAX_RANK, np.float32, loop)
    slots = jax.jit(set_slot, donate_argnums=0)(slots, jnp.int32(0), weights)
    session = PagedSession(loaded, lora=slots)
    seq = session.add_seq(lora_slot=1)
    (ours,) = session.step([(seq, PROMPTS[1])])
    err = float(np.max(np.abs(ours - peft_logits(ref, PROMPTS[1]))))
    assert err <= ATOL, f"max abs logit error {err:.3g} > {ATOL}"


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
