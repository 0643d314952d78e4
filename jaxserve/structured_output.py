"""`StructuredOutput`: a constraint on what a request may generate, checked when it is made.

One of: a JSON schema, any JSON object, a regular expression, a choice among strings, or a
context-free grammar in Lark syntax (what llguidance, our grammar engine, takes; docs/
architecture.md, "Structured output"). Each becomes one llguidance grammar string
(`engine_grammar()`), which the engine compiles against its tokenizer (jaxserve/engine/grammar.py).

Validated here, at construction, without a tokenizer: a schema that is not JSON or uses a
keyword the engine cannot enforce, a regex that does not parse, a grammar with an unknown rule
all raise ValueError naming the problem, so every front end refuses them as bad input (HTTP
400, gRPC INVALID_ARGUMENT) before they reach the engine. Frozen and hashable (a schema is kept
as its canonical JSON text), so it is the key of the engine's compiled-grammar cache.
"""

from __future__ import annotations

import dataclasses
import functools
import json

MAX_CHOICES = 1024
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar of at most 1 MiB of text


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutput:
    """Exactly one constraint (vLLM's `structured_outputs` names, OpenAI's meanings)."""

    json: str | None = None  # a JSON schema (a dict is accepted and kept as canonical JSON)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None  # the whole output fullmatches it
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark grammar whose `start` rule the output matches

    def __post_init__(self):
        if isinstance(self.json, dict | list | bool):  # bool: `true` is the JSON schema "any"
            object.__setattr__(self, "json", _canonical(self.json))
        elif isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"The JSON schema is not valid JSON: {e}.") from None
            object.__setattr__(self, "json", _canonical(parsed))
        elif self.json is not None:
            raise ValueError(f"json={self.json!r} must be a JSON schema (a dict or JSON text).")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"choice={self.choice!r} must be a list of strings.")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not 0 < len(self.choice) <= MAX_CHOICES or not all(self.choice):
                raise ValueError(
                    f"choice has {len(self.choice)} entries; it needs 1 to {MAX_CHOICES} "
                    "non-empty strings."
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}={value!r} must be a non-empty string.")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object={self.json_object!r} must be True or False.")
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                f"A structured output takes exactly one of json, json_object, regex, choice, "
                f"grammar; got {given or 'none'}."
            )
        size = len(self.grammar_text())
        if size > MAX_SPEC_CHARS:
            raise ValueError(
                f"The {self.kind} constraint is {size} characters; at most {MAX_SPEC_CHARS} "
                "allowed."
            )
        _check(self.engine_grammar(), self.kind)

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex", "choice" or "grammar"."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k))

    def grammar_text(self) -> str:
        """The user's constraint as text (for sizes and messages)."""
        if self.choice is not None:
            return "\n".join(self.choice)
        return self.json or self.regex or self.grammar or ""

    def engine_grammar(self) -> str:
        """The llguidance grammar (a string) this constraint compiles to."""
        return _grammar_of(self.kind, self.grammar_text() if self.kind != "choice" else self.choice)

    @staticmethod
    def from_dict(spec: dict) -> StructuredOutput:
        """vLLM's `structured_outputs` object ({"json": ..., "regex": ..., "choice": [...],
        "grammar": ..., "json_object": true}); unknown keys are refused by name."""
        if not isinstance(spec, dict):
            raise ValueError(f"structured_outputs={spec!r} must be an object.")
        known = {f.name for f in dataclasses.fields(StructuredOutput)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown keys {unknown}; it takes one of {sorted(known)}."
            )
        return StructuredOutput(**{k: v for k, v in spec.items() if v is not None})


def _canonical(schema) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# JSON in the one compact form (no whitespace between tokens): a model cannot wander off into
# whitespace, and outputs are what json.dumps(..., separators=(",", ":")) writes.
_JSON_OPTIONS = {"whitespace_flexible": False}


@functools.lru_cache(maxsize=256)
def _grammar_of(kind: str, text) -> str:
    from llguidance import LLMatcher

    if kind == "json":
        return LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    if kind == "choice":  # Lark string literals are JSON strings
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in text)
        return LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    return LLMatcher.grammar_from_lark(text)


@functools.lru_cache(maxsize=256)
def _check(grammar: str, kind: str) -> None:
    """Raises ValueError with llguidance's own words when `grammar` cannot be enforced."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(kind, kind)
        raise ValueError(f"The {what} cannot be used as a constraint: {error.strip()}")
