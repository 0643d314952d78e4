"""xgrammar against llguidance on our tokenizers: grammar compile time and per-token mask time.

The measurement behind docs/architecture.md's choice of grammar engine (section "Structured
output"). Run it where both are installed (`pip install xgrammar llguidance`):

    python -m jaxserve.bench.grammar_engines

For each tokenizer (the embedded stories260k, the byte-level BPE of a random shape) and each
constraint (a nested JSON schema, a regex), it times: building the engine's tokenizer
description once, compiling the grammar, and filling one row's bitmask per token along a
valid output (the work the engine thread does per constrained row per step). Medians of a few
repeats; a noisy machine makes only ratios between the two meaningful.
"""

from __future__ import annotations

import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
SAMPLE = {"name": "Lily", "age": 7, "role": "user", "tags": ["a", "bb"], "address": {"city": "X"}}
REGEX = r"[0-9]{3}-[0-9]{4} (yes|no)"
REGEX_SAMPLE = "555-1234 yes"


def _median_ms(fn, repeats: int = 5, setup=lambda: None) -> float:
    """Median wall time of fn(setup()) in ms; setup's own time is left out."""
    times = []
    for _ in range(repeats):
        arg = setup()
        start = time.perf_counter()
        fn(arg)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def token_path(tok, text: str) -> list[int]:
    """Token ids that spell exactly `text`: the tokenizer's own encoding, less the lone
    SentencePiece prefix space a Llama 2 style tokenizer (stories260k) puts first."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if ids and tok.convert_ids_to_tokens(ids[0]) == "\u2581":
        ids = ids[1:]
    return ids


def measure_llguidance(tok, vocab: int, text: str, kind: str) -> dict:
    """Tokenizer build, compile and per-token mask (ms) with llguidance."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy as llnp

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    tokenizer_ms = (time.perf_counter() - start) * 1e3
    if kind == "json":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
        )
    else:
        grammar = llguidance.LLMatcher.grammar_from_regex(REGEX)
    compile_ms = _median_ms(lambda _: llguidance.LLMatcher(lltok, grammar))
    ids = token_path(tok, text)
    mask = llnp.allocate_token_bitmask(1, vocab)

    def walk(m):
        for t in ids:
            llnp.fill_next_token_bitmask(m, mask, 0)
            assert m.consume_token(t), m.get_error()
        llnp.fill_next_token_bitmask(m, mask, 0)

    walk_ms = _median_ms(walk, setup=lambda: llguidance.LLMatcher(lltok, grammar))
    return dict(
        tokenizer_ms=tokenizer_ms, compile_ms=compile_ms, mask_us=walk_ms * 1e3 / (len(ids) + 1)
    )


def measure_xgrammar(tok, vocab: int, text: str, kind: str) -> dict:
    """Tokenizer build, compile and per-token mask (ms) with xgrammar."""
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    tokenizer_ms = (time.perf_counter() - start) * 1e3

    def compile_once():
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        if kind == "json":
            return compiler.compile_json_schema(
                json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
            )
        return compiler.compile_regex(REGEX)

    compile_ms = _median_ms(lambda _: compile_once())
    compiled = compile_once()
    ids = token_path(tok, text)
    mask = xgr.allocate_token_bitmask(1, vocab)

    def walk(m):
        for t in ids:
            m.fill_next_token_bitmask(mask, 0)
            assert m.accept_token(t)
        m.fill_next_token_bitmask(mask, 0)

    walk_ms = _median_ms(walk, setup=lambda: xgr.GrammarMatcher(compiled))
    return dict(
        tokenizer_ms=tokenizer_ms, compile_ms=compile_ms, mask_us=walk_ms * 1e3 / (len(ids) + 1)
    )


def main() -> None:
    from transformers import AutoTokenizer

    from checkpoints import DEFAULT_MODEL_DIR, NAMED_SHAPES
    from checkpoints.byte_bpe import byte_bpe_tokenizer

    qwen_vocab = NAMED_SHAPES["qwen3-tiny"].vocab_size
    tokenizers = {
        "stories260k (512, byte fallback)": (AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR), 512),
        f"byte-level BPE ({qwen_vocab}, qwen3-tiny)": (byte_bpe_tokenizer(qwen_vocab), qwen_vocab),
    }
    texts = {"json": json.dumps(SAMPLE, separators=(",", ":")), "regex": REGEX_SAMPLE}
    print("| tokenizer | constraint | engine | tokenizer ms | compile ms | mask us/token |")
    print("|---|---|---|---|---|---|")
    for name, (tok, vocab) in tokenizers.items():
        for kind, text in texts.items():
            for engine, fn in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
                r = fn(tok, vocab, text, kind)
                print(
                    f"| {name} | {kind} | {engine} | {r['tokenizer_ms']:.1f} | "
                    f"{r['compile_ms']:.2f} | {r['mask_us']:.1f} |"
                )


if __name__ == "__main__":
    main()
