"""Request bodies as JSON, parsed in bounded time slices: a body never holds the event loop, or
the GIL, for long, whatever its shape.

Why not `json.loads` in a thread: CPython's C parser holds the GIL for the whole body, and so
does pydantic's validation, so a 10 MB body of small values (a logit_bias of 870k ids, 330k chat
messages, millions of token ids) held every other thread, the event loop with its streams
included, for 0.25-1.5 s wherever it ran. Here a body whose structure is small (few brackets
and commas: text, short lists) still goes to the C parser, which is then fast; any other is
parsed by `loads`, a Python loop over the values that hands the GIL on at the interpreter's
switch interval (5 ms) and calls C only for pieces of bounded cost (one string, a run of at
most `_RUN` integers). It also bounds what a body may hold:

- nesting: at most `MAX_DEPTH` levels (the API's bodies nest 4); 100,000 `[` is a 400, not a
  RecursionError;
- values: at most `max_values` (numbers, strings, arrays, objects), which the caller sets from
  the model (every prompt of a call as token ids, and room for the other fields), so a body
  that could never be served is refused after that many values, not after all of them.

`find_lone_surrogate` names a string holding a lone surrogate (the valid JSON escape
`"\\ud800"`), which is not Unicode text and which no tokenizer accepts.

Plain functions over bytes and strings, safe on any thread.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from json.decoder import scanstring
from typing import Any

from service.validation import InvalidRequest, short

MAX_DEPTH = 32  # nesting levels of arrays and objects
# A body with at most this many brackets and commas holds at most this many values: C parses
# it in well under a millisecond a thousand, so it skips the paced parser.
C_PARSER_VALUES = 4096
_RUN = 4096  # integers parsed by one C call inside an array: a bounded slice of GIL time
_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"(-?(?:0|[1-9][0-9]*))(\.[0-9]+)?([eE][-+]?[0-9]+)?")
# Up to _RUN integers of at most 18 digits, each followed by a comma (the last of an array is
# not, so it takes the general path).
_INT = r"-?(?:0|[1-9][0-9]{0,17})[ \t\n\r]*,[ \t\n\r]*"
_INT_RUN = re.compile(f"(?:{_INT}){{1,{_RUN}}}")
_CONSTANTS = {"true": True, "false": False, "null": None}
_NON_FINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def decode(raw: bytes, max_values: int) -> Any:
    """The JSON value of a request body; InvalidRequest (a 400) when it is not JSON, nests
    deeper than MAX_DEPTH or holds more than `max_values` values."""
    brackets = raw.count(b"[") + raw.count(b"{")
    try:
        if brackets <= MAX_DEPTH and brackets + raw.count(b",") < C_PARSER_VALUES:
            return json.loads(raw)  # small in structure: bounded time, however many bytes
        return loads(raw.decode("utf-8"), max_values)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidRequest(f"The request body is not valid JSON: {e}.") from None


def loads(text: str, max_values: int) -> Any:
    """`json.loads(text)` (NaN and Infinity too, a repeated key keeps its last value), parsed
    by a loop without recursion that counts values and levels as it goes."""
    stack: list[list | dict] = []  # the open arrays and objects, outermost first
    keys: list[str] = []  # the key each open object is waiting to fill
    count = 0
    idx = _WS.match(text, 0).end()
    while True:
        # A value starts at idx.
        c = text[idx : idx + 1]
        if c == '"':
            value, idx = scanstring(text, idx + 1)
        elif c in ("[", "{"):
            if len(stack) >= MAX_DEPTH:
                raise InvalidRequest(
                    f"The request body nests arrays and objects more than {MAX_DEPTH} levels "
                    f"deep (at character {idx}); the API's bodies need 4."
                )
            count += 1
            idx = _WS.match(text, idx + 1).end()
            if c == "[":
                value = []
                if text.startswith("]", idx):
                    idx += 1
                else:
                    stack.append(value)
                    continue
            else:
                value = {}
                if text.startswith("}", idx):
                    idx += 1
                else:
                    stack.append(value)
                    idx = _key(text, idx, keys)
                    continue
        elif c and c in "-0123456789":
            parent = stack[-1] if stack else None
            if type(parent) is list and (run := _INT_RUN.match(text, idx)) is not None:
                ints = json.loads("[" + text[idx : run.end()].rstrip(" \t\n\r,") + "]")
                parent.extend(ints)
                count += len(ints)
                _check_count(count, max_values)
                idx = run.end()
                continue
            value, idx = _number(text, idx)
        else:
            value, idx = _constant(text, idx)
        count += 1
        _check_count(count, max_values)
        # The value is whole: it fills its container, which may then be whole in turn.
        while True:
            idx = _WS.match(text, idx).end()
            if not stack:
                if idx != len(text):
                    raise json.JSONDecodeError("Extra data", text, idx)
                return value
            parent = stack[-1]
            if type(parent) is list:
                parent.append(value)
                closer = "]"
            else:
                parent[keys.pop()] = value
                closer = "}"
            c = text[idx : idx + 1]
            if c == ",":
                idx = _WS.match(text, idx + 1).end()
                if closer == "}":
                    idx = _key(text, idx, keys)
                break
            if c != closer:
                raise json.JSONDecodeError("Expecting ',' delimiter", text, idx)
            idx += 1
            value = stack.pop()


def _key(text: str, idx: int, keys: list[str]) -> int:
    """Reads `"key":` at idx onto `keys`; returns where its value starts."""
    if not text.startswith('"', idx):
        raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, idx)
    key, idx = scanstring(text, idx + 1)
    idx = _WS.match(text, idx).end()
    if not text.startswith(":", idx):
        raise json.JSONDecodeError("Expecting ':' delimiter", text, idx)
    keys.append(key)
    return _WS.match(text, idx + 1).end()


def _number(text: str, idx: int) -> tuple[Any, int]:
    m = _NUMBER.match(text, idx)
    if m is None:
        return _constant(text, idx)  # "-Infinity"
    integer, fraction, exponent = m.groups()
    if fraction or exponent:
        return float(integer + (fraction or "") + (exponent or "")), m.end()
    return int(integer), m.end()


def _constant(text: str, idx: int) -> tuple[Any, int]:
    for table in (_CONSTANTS, _NON_FINITE):
        for word, value in table.items():
            if text.startswith(word, idx):
                return value, idx + len(word)
    raise json.JSONDecodeError("Expecting value", text, idx)


def _check_count(count: int, max_values: int) -> None:
    if count > max_values:
        raise InvalidRequest(
            f"The request body holds more than {max_values} values (numbers, strings, arrays "
            "and objects), more than any request this server can run needs."
        )


def find_lone_surrogate(raw: bytes, data: Any) -> None:
    """Raises InvalidRequest naming the first string (or key) of `data` that holds a lone
    surrogate. A body's bytes are UTF-8, which cannot carry one, so only a `\\uD8xx`-`\\uDFxx`
    escape makes one: a body without such an escape costs a search of its bytes."""
    if _SURROGATE_ESCAPE.search(raw) is None:
        return
    for path, text in _strings(data, ""):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            where = path or "the request body"
            raise InvalidRequest(
                f"{where}={short(text)} holds a lone surrogate (U+{ord(text[e.start]):04X} at "
                f"character {e.start}), which is not Unicode text: a \\uD800-\\uDFFF escape "
                "must be one of a pair.",
                path.partition("[")[0].partition(".")[0] or None,
            ) from None


def _strings(data: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, string) of every string and key in data, paths as messages name fields
    ("messages[0].content"); data nests at most MAX_DEPTH levels, so recursion is safe."""
    if isinstance(data, str):
        yield path, data
    elif isinstance(data, list):
        for i, item in enumerate(data):
            yield from _strings(item, f"{path}[{i}]")
    elif isinstance(data, dict):
        for key, item in data.items():
            inner = f"{path}.{key}" if path else key
            yield inner, key
            yield from _strings(item, inner)
