"""How far 8-bit weights move a model from its float self (issue 43; docs/benchmarks.md).

    PYTHONPATH=. python docs/history/quant_accuracy.py [--models stories260k,qwen3-tiny]
    PYTHONPATH=. python docs/history/quant_accuracy.py --schemes kv-int8,kv-fp8   # the KV cache

Per model and scheme (int8, fp8, int8-w8a8 for the weights; kv-int8, kv-fp8 for an 8-bit KV cache
of float weights, `--kv-cache-dtype`), through the engine (`LLM`, float32 compute, the
CPU), against the float32 model of the same weights:
- greedy agreement over 256 tokens: the tokens the quantized model generates from each prompt
  before its first difference from the float model's greedy output (of 256), and the share of
  the float model's 256 greedy tokens that are also the quantized model's top-1 token at the
  same position when it is fed the float model's text (teacher-forced, so one early
  difference does not count 200 times);
- the mean absolute per-token log-likelihood difference |log p_q(t) - log p_f(t)| in nats over
  a fixed text (the embedded model's tokenizer on the story below; random token ids for a
  random shape, which has no tokenizer), and the mean signed difference (its bias).

stories260k has real weights; a random shape (N(0, 0.02) weights) has logits so flat that
near-ties decide its greedy tokens, the hardest case for greedy agreement and a mild one for
log-likelihood.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.sampling_params import SamplingParams

SCHEMES = ("int8", "fp8", "int8-w8a8")
KV_SCHEMES = ("kv-int8", "kv-fp8")  # float weights, the KV cache in 8 bits (--kv-cache-dtype)
TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park with her friends. One day, she saw a big red ball under a tree. She ran to the ball "
    'and picked it up. Her mom said, "Lily, you must share the ball with your friends." Lily '
    "was sad, but she gave the ball to her friend Tom. Tom was happy and they played together "
    "all day. At the end of the day, Lily felt good because she was kind to her friend. The "
    "sun went down and the sky was pink and orange. Lily and her mom walked home and ate soup "
    "for dinner. Then Lily went to bed and dreamed about the park, the ball and her friends."
)
PROMPTS = ("Once upon a time", "The little dog", "Tom had a red ball", "One day, Sam")
NUM_TOKENS = 256
ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    min_token_bucket=4,
    seq_bucket_factor=4,
    max_model_len=512,
    show_progress=False,
    enable_prefix_caching=False,
    dtype="float32",
)


def _engine(model: str | None, scheme: str, loaded=None) -> LLM:
    """An engine of `model` (or the `loaded` weights) for `scheme`: a weight scheme, a "kv-"
    scheme (float weights, that KV cache dtype), or "none"."""
    if scheme.startswith("kv-"):
        config = EngineConfig(model=model, kv_cache_dtype=scheme.removeprefix("kv-"), **ENGINE)
    else:
        config = EngineConfig(model=model, quantization=scheme, **ENGINE)
    return LLM(config, model=loaded)


def _prompts(llm: LLM, rng) -> tuple[list[list[int]], list[int]]:
    """Prompt ids and the fixed text's ids for the model behind `llm`."""
    tok = llm.engine.tokenizer
    vocab = llm.engine.model.config.vocab_size
    if tok is None:  # a random shape: ids drawn once, the same for every scheme
        prompts = [list(rng.integers(3, vocab, 6)) for _ in PROMPTS]
        return [[int(t) for t in p] for p in prompts], [int(t) for t in rng.integers(3, vocab, 240)]
    return [tok.encode(p) for p in PROMPTS], tok.encode(TEXT)


def measure(model: str | None, schemes=SCHEMES) -> dict:
    rng = np.random.default_rng(0)
    float_llm = _engine(model, "none")
    prompts, text = _prompts(float_llm, rng)
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    ref_out = [o.token_ids for o in float_llm.generate(prompts, greedy)]
    ref_text = float_llm.score([text[:1]], [text[1:]])[0]
    float_model = float_llm.engine.model
    rows = {}
    for scheme in schemes:
        llm = _engine(model, scheme, float_model)  # the same float weights, quantized at load
        outs = [o.token_ids for o in llm.generate(prompts, greedy)]
        prefix = [
            next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), NUM_TOKENS)
            for o, r in zip(outs, ref_out, strict=True)
        ]
        # Teacher-forced top-1 over the float model's continuation.
        forced = llm.generate(
            [p + r for p, r in zip(prompts, ref_out, strict=True)],
            SamplingParams(max_tokens=1, temperature=0.0),
            prompt_logprobs=1,
        )
        agree = [
            np.mean(
                [lp.top[0][0] == t for lp, t in zip(f.prompt_logprobs[len(p) :], r, strict=True)]
            )
            for f, p, r in zip(forced, prompts, ref_out, strict=True)
        ]
        lp = np.asarray(llm.score([text[:1]], [text[1:]])[0])
        diff = lp - np.asarray(ref_text)
        rows[scheme] = dict(
            identical_prefix=prefix,
            teacher_forced_top1=float(np.mean(agree)),
            mean_abs_nll_diff=float(np.mean(np.abs(diff))),
            mean_nll_diff=float(np.mean(-diff)),
            compiles_after_warmup=llm.engine.metrics.stats.compiles_after_warmup,
        )
        print(model or "stories260k", scheme, json.dumps(rows[scheme]), flush=True)
    return dict(
        model=model or "stories260k",
        text_tokens=len(text),
        float_nll=float(-np.mean(ref_text)),
        schemes=rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="stories260k,qwen3-tiny")
    parser.add_argument(
        "--schemes", default=",".join(SCHEMES), help=f"of {SCHEMES + KV_SCHEMES}, comma-separated"
    )
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    schemes = tuple(args.schemes.split(","))
    results = [
        measure(None if name == "stories260k" else name, schemes) for name in args.models.split(",")
    ]
    for r in results:
        print(f"\n{r['model']}: float NLL {r['float_nll']:.3f} nats/token over {r['text_tokens']}")
        print(
            "| scheme | identical greedy prefix (of 256, per prompt) | teacher-forced top-1 "
            "| mean abs NLL diff (nats/token) | mean NLL diff |"
        )
        print("|---|---|---|---|---|")
        for name, row in r["schemes"].items():
            print(
                f"| {name} | {', '.join(map(str, row['identical_prefix']))} "
                f"| {row['teacher_forced_top1']:.1%} | {row['mean_abs_nll_diff']:.4f} "
                f"| {row['mean_nll_diff']:+.4f} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
