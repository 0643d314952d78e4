"""The least work one step of a bucket must do on one device, and the step time it allows.

`jaxserve compile` predicts each bucket's step time from the compiled program's cost analysis and
the chip's published peaks (jaxserve/runtime/aot.py). That analysis alone predicted steps faster
than the chip can move the weights (issue 47, item 5): XLA prices a scanned layer loop's body
once, not once per layer, and the compile-only GPU client gives no analysis at all. So every
prediction is held to a floor counted here from the model's shapes:

- bytes: every weight the step's matmuls read (the LM head's whole table; of an untied input
  embedding only the rows gathered), the KV the step writes and the KV its attention reads back,
  and the f32 logits it writes;
- FLOPs: 2 per weight per token for the decoder's matmuls, 2 per head weight per sampled row,
  and attention's Q K^T and P V over the causal pairs.

A mixture of experts reads the router and the experts its tokens route to, taken as the
expected number of distinct experts T tokens reach when each picks its k uniformly
(E (1 - (1 - k / E)^T): k for one token, nearly all E for a prefill), and each token runs k
experts' matmuls. Its experts are split over the model axis where their count divides by it
(sharding.py, expert parallelism), else every device reads and runs them all. Where the
grouped matmul is XLA's ragged_dot on a GPU (`dense_experts`), XLA:GPU runs it as a dense masked
dot (pallas_kernels/grouped_matmul/xla.py): every token passes every local expert and every
local expert is read, and the floor counts that work, which is what the compiled program does.

Quantized decoder weights (`weight_itemsize` 1: int8 or e4m3, jaxserve/models/quant.py) are
read at their own size, and so is an 8-bit KV pool (`kv_itemsize` 1, --kv-cache-dtype); the
embedding and the head keep the model dtype's `itemsize` (the weights' per-column float32
scales and the pool's exponent lanes are not counted: the floor only ever errs low).

Both are per device under tensor parallelism, split as jaxserve/models/sharding.py splits the
model: the fused qkv projection and the KV over the KV-head split, everything else over the
whole model axis, attention's heads replicated where the KV heads cannot be split. The bucket
is taken as full (its tokens spread evenly over its sequences, every sequence sampled) and each
sequence with `context` earlier tokens in the pool (0 by default: the least a step of that
bucket reads). Nothing else is counted (norms, biases, rotary, sampling, a kernel's launch), so
the floor is below what any real step does; the prediction is max(floor, the cost analysis with
a scanned loop's other layers added).
"""

from __future__ import annotations

import dataclasses

from jaxserve.models.config import ModelConfig
from jaxserve.models.sharding import kv_split


@dataclasses.dataclass(frozen=True)
class StepWork:
    """FLOPs and HBM bytes of one step on one device."""

    flops: float
    bytes: float

    def seconds(self, peaks: tuple[float, float]) -> float:
        """The roofline: max(FLOPs / peak FLOP/s, bytes / bandwidth) for peaks (FLOP/s, B/s)."""
        flops_per_s, bytes_per_s = peaks
        return max(self.flops / flops_per_s, self.bytes / bytes_per_s)


def experts_touched(model: ModelConfig, num_tokens: int) -> float:
    """The distinct experts `num_tokens` tokens route to, expected when each picks its top k
    uniformly: k for one token, approaching all of them as the tokens grow."""
    e, k = model.moe.num_experts, model.moe.top_k
    return e * (1.0 - (1.0 - k / e) ** num_tokens)


def _expert_split(model: ModelConfig, tensor_parallel: int) -> int:
    """Over how many devices the experts are split: all of them, or 1 where their count does
    not divide by the model axis (sharding.ShardingPlan.experts_split)."""
    return tensor_parallel if model.moe.num_experts % tensor_parallel == 0 else 1


def _attention_weights(model: ModelConfig, tensor_parallel: int) -> float:
    """q/k/v (split with the KV heads, sharding.kv_split) and o (over the model axis)."""
    c, tp = model, tensor_parallel
    qkv = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return qkv / kv_split(tp, c.num_kv_heads) + c.num_heads * c.head_dim * c.hidden_size / tp


def layer_weights(
    model: ModelConfig,
    tensor_parallel: int = 1,
    num_tokens: int = 1,
    dense_experts: bool = False,
) -> float:
    """Matmul weights (elements) of one decoder layer a step of `num_tokens` tokens reads on
    one device: q/k/v split with the KV heads (sharding.kv_split), o, gate/up and down over the
    whole model axis; for a mixture of experts the router and the experts the tokens reach
    (`experts_touched`; all of them with `dense_experts`), split with the experts."""
    c, tp = model, tensor_parallel
    attention = _attention_weights(c, tp)
    if c.moe is None:
        return attention + 3 * c.hidden_size * c.intermediate_size / tp
    expert = 3 * c.hidden_size * c.moe.intermediate_size
    touched = c.moe.num_experts if dense_experts else experts_touched(c, num_tokens)
    touched /= _expert_split(c, tp)
    return attention + c.hidden_size * c.moe.num_experts + touched * expert


def layer_matmul_flops(
    model: ModelConfig, num_tokens: int, tensor_parallel: int = 1, dense_experts: bool = False
) -> float:
    """The decoder layer's matmul FLOPs on one device for `num_tokens` tokens: 2 per weight per
    token, a mixture of experts' tokens passing the router and k experts each (every expert
    with `dense_experts`)."""
    c, tp = model, tensor_parallel
    if c.moe is None:
        return 2 * num_tokens * layer_weights(c, tp)
    expert = 3 * c.hidden_size * c.moe.intermediate_size
    per_token = (
        _attention_weights(c, tp)
        + c.hidden_size * c.moe.num_experts
        + (c.moe.num_experts if dense_experts else c.moe.top_k) * expert / _expert_split(c, tp)
    )
    return 2 * num_tokens * per_token


def _query_heads(model: ModelConfig, tensor_parallel: int) -> float:
    """Query heads one device attends with: split with the model axis, or all of them where
    the KV heads neither divide nor are divided by it (sharding.py: replicated attention)."""
    nkv, tp = model.num_kv_heads, tensor_parallel
    if nkv % tp and tp % nkv:
        return float(model.num_heads)
    return model.num_heads / tp


def layer_floor(
    model: ModelConfig,
    num_tokens: int,
    num_seqs: int,
    itemsize: int,
    *,
    tensor_parallel: int = 1,
    context: int = 0,
    dense_experts: bool = False,
    weight_itemsize: float | None = None,
    kv_itemsize: float | None = None,
    window: int | None = None,
) -> StepWork:
    """One decoder layer's share of `step_floor`: its weights (of `weight_itemsize` bytes,
    None: `itemsize`), its KV written and read (`kv_itemsize` bytes an element, 1 for an 8-bit
    pool; None: `itemsize`), its matmuls and its attention, on one device. A sliding-`window`
    layer reads at most the last window - 1 earlier keys and attends each query to at most
    `window` keys (Mistral, Gemma's local layers)."""
    c, tp = model, tensor_parallel
    if num_tokens < num_seqs or num_seqs < 1 or context < 0:
        raise ValueError(
            f"A step floor needs num_tokens >= num_seqs >= 1 and context >= 0, got "
            f"{num_tokens=}, {num_seqs=}, {context=}."
        )
    weights = layer_weights(c, tp, num_tokens, dense_experts)
    kv_size = itemsize if kv_itemsize is None else kv_itemsize
    kv_per_token = 2 * c.num_kv_heads * c.head_dim * kv_size / kv_split(tp, c.num_kv_heads)
    q = num_tokens / num_seqs  # each sequence's new tokens (even: the fewest causal pairs)
    pairs = num_seqs * (q * context + q * (q + 1) / 2)
    if window is not None:  # keys older than the window are neither read nor attended
        context = min(context, window - 1)
        pairs = min(num_seqs * (q * context + q * (q + 1) / 2), num_tokens * window)
    # Written: the step's tokens; read back by attention: each sequence's context and its own.
    kv_bytes = kv_per_token * (num_tokens + num_tokens + num_seqs * context)
    attention = 4 * _query_heads(c, tp) * c.head_dim * pairs  # Q K^T and P V, 2 FLOPs a MAC
    return StepWork(
        flops=layer_matmul_flops(c, num_tokens, tp, dense_experts) + attention,
        bytes=weights * (itemsize if weight_itemsize is None else weight_itemsize) + kv_bytes,
    )


def step_floor(
    model: ModelConfig,
    num_tokens: int,
    num_seqs: int,
    itemsize: int,
    *,
    tensor_parallel: int = 1,
    context: int = 0,
    dense_experts: bool = False,
    weight_itemsize: float | None = None,
    kv_itemsize: float | None = None,
) -> StepWork:
    """The least one device does in a full step of `num_tokens` tokens over `num_seqs`
    sequences with `context` earlier tokens each (weights of `itemsize` bytes, the decoder's
    matmul weights of `weight_itemsize` where quantized): see the module docstring for what
    is counted."""
    c, tp = model, tensor_parallel
    # Each layer with its own window (Gemma's local and global layers; Mistral's one window),
    # computed once per distinct window.
    windows = [c.layer_window(i) for i in range(c.num_layers)]
    per_window = {
        w: layer_floor(
            c,
            num_tokens,
            num_seqs,
            itemsize,
            tensor_parallel=tp,
            context=context,
            dense_experts=dense_experts,
            weight_itemsize=weight_itemsize,
            kv_itemsize=kv_itemsize,
            window=w,
        )
        for w in set(windows)
    }
    layer_flops = sum(per_window[w].flops for w in windows)
    layer_bytes = sum(per_window[w].bytes for w in windows)
    table = c.vocab_size * c.hidden_size / tp  # split by vocabulary rows
    head_bytes = table * itemsize  # the LM head reads all of it, tied or not
    if not c.tie_word_embeddings:  # the input embedding: only the step's rows are gathered
        head_bytes += min(num_tokens, c.vocab_size) * c.hidden_size * itemsize / tp
    logits_bytes = num_seqs * c.vocab_size * 4 / tp  # f32, split by vocabulary
    return StepWork(
        flops=layer_flops + 2 * num_seqs * table,
        bytes=layer_bytes + head_bytes + logits_bytes,
    )


def predict(
    floor: StepWork,
    peaks: tuple[float, float],
    analysed: StepWork | None = None,
    *,
    missing_layers: int = 0,
    layer: StepWork | None = None,
) -> float:
    """The predicted step time (s): the roofline of the compiled cost analysis (`analysed`,
    None where the compiler gives none), with `missing_layers` more copies of `layer` added
    where the analysis priced a scanned loop's body once, and never below `floor`'s."""
    predicted = floor.seconds(peaks)
    if analysed is not None:
        extra = layer if layer is not None and missing_layers else StepWork(0.0, 0.0)
        whole = StepWork(
            flops=analysed.flops + missing_layers * extra.flops,
            bytes=analysed.bytes + missing_layers * extra.bytes,
        )
        predicted = max(predicted, whole.seconds(peaks))
    return predicted
