"""Shared pieces of the model tests: tiny transformers models and a paged session over them.

`build_hf_model(family)` makes a 2-layer random model with transformers, with every weight (norms
and biases included) redrawn so that a mis-mapped or dropped tensor changes the logits visibly.
`PagedSession` runs jaxserve's paged step over a shuffled page pool whose unused pages hold NaN,
so a wrong slot, page table or mask shows as a wrong or NaN logit. The reference is always
transformers' own PyTorch forward or `generate`, never a copy of our code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import transformers

from checkpoints import LoadedModel, model_for
from checkpoints.config_json import layer_loop_of
from jaxserve.models.config import ModelConfig
from jaxserve.models.kv_pool import KVPages, kv_lanes
from jaxserve.models.lora import TARGET_MODULES
from jaxserve.models.step_batch import SeqChunk, pack_chunks
from tests.torch_reference import require_torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Mixtures of experts: Qwen3-MoE without and with its top-k renormalised, Mixtral (which always
# renormalises) with a sliding window shorter than the prompts.
MOE_FAMILIES = ("qwen3_moe", "qwen3_moe_norm", "mixtral")
# One token, one sequence, room for 208 tokens: the bucket the stories260k tests decode with.
STORIES_BUCKET = dict(num_tokens=1, num_seqs=1, page_size=16, pages_per_seq=13, num_pages=32)

_COMMON = dict(
    vocab_size=128,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # explicit and != hidden_size // num_heads (12), so a derived head_dim fails
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    # No BOS/EOS: generate() must run the full length, like our loop, whatever it samples.
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# Each family's switches; between them they cover tied and untied heads, llama3 and linear RoPE
# scaling, q/k/v(/o) and MLP biases, a sliding window shorter than the prompts, Qwen3's q/k norm.
_FAMILY = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                # Small, so positions in the tests fall in the scaled and smoothed bands.
                original_max_position_embeddings=32,
            ),
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(
            sliding_window=6,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
            tie_word_embeddings=True,
        ),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=False),  # q/k/v biases are built into Qwen2
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            attention_bias=True,  # rare in released Qwen3s, but it biases o_proj too
            tie_word_embeddings=True,
        ),
    ),
}
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_FAMILY["qwen3_moe"] = (
    transformers.Qwen3MoeConfig,
    transformers.Qwen3MoeForCausalLM,
    dict(
        _MOE,
        num_experts=8,
        norm_topk_prob=False,
        rope_parameters=dict(rope_type="default", rope_theta=1e6),
        tie_word_embeddings=False,
    ),
)
_FAMILY["qwen3_moe_norm"] = (
    transformers.Qwen3MoeConfig,
    transformers.Qwen3MoeForCausalLM,
    {**_FAMILY["qwen3_moe"][2], "norm_topk_prob": True, "num_experts": 4},
)
_FAMILY["mixtral"] = (
    transformers.MixtralConfig,
    transformers.MixtralForCausalLM,
    dict(
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=32,  # Mixtral's experts' width
        sliding_window=6,
        tie_word_embeddings=False,
    ),
)


def build_hf_model(family: str, *, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A tiny float32 transformers model of `family` with every parameter randomly redrawn."""
    torch = require_torch()
    config_cls, model_cls, switches = _FAMILY[family]
    config = config_cls(**{**_COMMON, **switches, **overrides})
    config._attn_implementation = "eager"  # the plainest reference
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * noise)  # not all ones, so a dropped norm weight shows
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            elif name.endswith("embed_tokens.weight"):
                # Small embeddings and large layer weights keep greedy decoding from settling
                # into repeating one token, so the 32 greedy steps test positions and the cache.
                p.copy_(0.05 * noise)
            else:
                p.copy_(1.5 * noise * p.shape[-1] ** -0.5)
    return model


def save_hf(model: transformers.PreTrainedModel, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return Path(path)


def make_adapter(
    base, path, *, seed: int, r: int, alpha: float, rslora: bool = False, **lora_options
):
    """A random peft LoRA (B non-zero) of `base` on every target module, saved to `path`;
    `lora_options` go to peft's LoraConfig as they are (rank_pattern, alpha_pattern)."""
    import peft  # here: only the LoRA tests need it, and it takes a while to import

    torch = require_torch()

    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(TARGET_MODULES),
        init_lora_weights=False,
        use_rslora=rslora,
        **lora_options,
    )
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # large enough that every module's update moves the logits visibly
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape) * 0.6 * p.shape[-1] ** -0.5)
    model.save_pretrained(path)
    return model


@contextlib.contextmanager
def torch_one_thread() -> Iterator[None]:
    """Runs torch on one thread: on a shared 2-core machine, torch's second thread spin-waits
    for a core and makes these tiny forwards several times slower."""
    torch = require_torch()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(before)


def hf_logits(model: transformers.PreTrainedModel, ids: list[int]) -> np.ndarray:
    """transformers' float32 logits f32[len(ids), vocab] of one sequence."""
    torch = require_torch()
    with torch_one_thread():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """The `n` tokens `model.generate(do_sample=False)` appends to `prompt`."""
    torch = require_torch()
    ids = torch.tensor([prompt])
    with torch_one_thread():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n
        )
    return out[0, len(prompt) :].tolist()


@functools.partial(
    jax.jit, static_argnames=("config", "dtype", "plan", "quant"), donate_argnames=("kv",)
)
def paged_step(
    config: ModelConfig,
    dtype: str,
    params: dict,
    kv: KVPages,
    batch,
    lora=None,
    plan=None,
    quant=None,
):
    """One ragged step: logits of every token f32[T, vocab] and the updated pool. `lora`: the
    adapters' slot arrays (jaxserve.models.lora.empty_slots), read by each token's lora_slot;
    `plan`: the ShardingPlan the model is split by (None: one device); `quant`: the params'
    QuantScheme (a quantized model's, LoadedModel.quant)."""
    model = model_for(
        config, jnp.dtype(dtype), plan=plan, layer_loop=layer_loop_of(params), quant=quant
    )
    batch = dataclasses.replace(batch, lora=lora)
    hidden, kv = model.apply({"params": params}, kv, batch)
    return model.apply({"params": params}, hidden, method="logits"), kv


@dataclasses.dataclass
class _Seq:
    pages: list[int]
    lora_slot: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)  # all tokens run so far


class PagedSession:
    """Host bookkeeping of several sequences over one shuffled, NaN-initialised page pool.

    Every step is packed to the same (num_tokens, num_seqs) bucket, so a session compiles once.
    Page 0 is never handed out: unused page-table entries point at it and it stays NaN.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_tokens: int = 32,
        num_seqs: int = 4,
        page_size: int = 4,
        pages_per_seq: int = 12,
        num_pages: int = 64,
        seed: int = 0,
        lora: dict | None = None,
        plan=None,  # a ShardingPlan: the model split over its mesh (tensor parallel)
    ):
        c = loaded.config
        self.plan = plan
        self.lora = lora  # adapters' slot arrays; each sequence picks one in add_seq
        self.loaded = loaded
        self.bucket = dict(
            page_size=page_size,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            pages_per_seq=pages_per_seq,
            num_pages=num_pages,
        )
        lanes = kv_lanes(c) if plan is None else plan.kv_lanes
        shape = (c.num_layers, num_pages, page_size, lanes)
        # Params and pool committed to one device: orbax restores committed arrays and the HF
        # loader uncommitted ones, and jit compiles each kind apart; committing both shares one.
        nan = np.full(shape, np.nan, loaded.dtype)
        if plan is None:
            device = jax.devices()[0]
            self.params = jax.device_put(loaded.params, device)
            self.kv = KVPages(kv=jax.device_put(nan, device))
        else:
            self.params = plan.place(loaded.params)
            self.kv = KVPages(kv=jax.device_put(nan, plan.kv_pages))
        order = np.random.default_rng(seed).permutation(num_pages)
        self._free = [int(p) for p in order if p != 0]
        self._pages_per_seq = pages_per_seq
        self.seqs: list[_Seq] = []

    def add_seq(self, lora_slot: int = 0) -> int:
        """A new empty sequence owning `pages_per_seq` scattered pages, run with the adapter in
        slot `lora_slot` (0: none); returns its id."""
        n = self._pages_per_seq
        if len(self._free) < n:
            raise ValueError("The test pool is too small for another sequence.")
        pages, self._free = self._free[:n], self._free[n:]
        self.seqs.append(_Seq(pages=pages, lora_slot=lora_slot))
        return len(self.seqs) - 1

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[np.ndarray]:
        """Runs (seq id, new tokens) chunks in one ragged step; logits f32[len, vocab] of each."""
        seq_chunks = []
        for seq_id, tokens in chunks:
            seq = self.seqs[seq_id]
            seq_chunks.append(SeqChunk(list(tokens), len(seq.tokens), seq.pages, seq.lora_slot))
        batch = pack_chunks(seq_chunks, **self.bucket)
        logits, self.kv = paged_step(
            self.loaded.config,
            jnp.dtype(self.loaded.dtype).name,
            self.params,
            self.kv,
            batch,
            self.lora,
            self.plan,
            self.loaded.quant,
        )
        logits = np.asarray(logits)
        out = []
        for s, (seq_id, tokens) in enumerate(chunks):
            self.seqs[seq_id].tokens.extend(tokens)
            out.append(logits[batch.query_start[s] : batch.query_start[s + 1]])
        return out


def sequence_logits(loaded: LoadedModel, tokens: list[int], **bucket) -> np.ndarray:
    """Logits f32[len(tokens), vocab] of one sequence, run in chunks of the bucket's num_tokens."""
    session = PagedSession(loaded, **bucket)
    seq = session.add_seq()
    size = session.bucket["num_tokens"]
    chunks = [tokens[i : i + size] for i in range(0, len(tokens), size)]
    return np.concatenate([session.step([(seq, chunk)])[0] for chunk in chunks])


def paged_greedy(
    loaded: LoadedModel, prompts: list[list[int]], n: int, **bucket
) -> list[list[int]]:
    """Greedy continuation of every prompt: one ragged prefill step, then batched decode steps."""
    session = PagedSession(loaded, **bucket)  # bucket may hold a plan (PagedSession's)
    ids = [session.add_seq() for _ in prompts]
    logits = session.step(list(zip(ids, prompts, strict=True)))
    out = [[int(lg[-1].argmax())] for lg in logits]
    for _ in range(n - 1):
        logits = session.step([(i, [o[-1]]) for i, o in zip(ids, out, strict=True)])
        for o, lg in zip(out, logits, strict=True):
            o.append(int(lg[-1].argmax()))
    return out
