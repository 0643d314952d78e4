"""One map between `EngineConfig` and the command line (after vLLM's `EngineArgs`).

Every field of EngineConfig is a flag named after it (`max_num_seqs`: `--max-num-seqs`), its
help the field's docstring and EngineConfig's default, or is listed in NOT_FLAGS with the
reason. Every command that builds an engine (serve, generate, batch, bench, simulate, tune and
`python -m jaxserve.bench.accelerator_check`) adds the same flags with `add_engine_args` and
reads them back with `engine_config_from_args`. The flags default to SUPPRESS: a flag not given
leaves its field to EngineConfig, or to a default the command states in its help.

`jaxserve bench` compares configurations: there, the flags it names in `lists` take
comma-separated values, and it builds one engine per combination (jaxserve/bench/suite.py).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import re
import textwrap
from collections.abc import Callable, Collection, Mapping
from typing import Any

from jaxserve.engine_config import KV_LAYOUTS, EngineConfig
from jaxserve.quantization import KV_CACHE_DTYPES, QUANTIZATIONS
from jaxserve.scheduling.kv_events import KV_EVENTS_FORMATS
from jaxserve.scheduling.types import BATCHING_MODES, POLICIES, PREEMPTION_MODES


def _parse_mesh(text: str) -> tuple[int, int]:
    from jaxserve.models.sharding import parse_mesh_shape  # imports JAX: only for --mesh-shape

    return parse_mesh_shape(text)


def _show_mesh(shape) -> str:
    return "x".join(str(n) for n in shape)


def _speculative(text: str) -> str | None:
    """ngram, or none / off (no speculation)."""
    word = text.strip().lower()
    if word in ("none", "off", ""):
        return None
    if word != "ngram":
        raise ValueError(f"--speculative takes ngram or none, not {text!r}")
    return word


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one EngineConfig field is spelled on the command line; its help is the field's
    docstring, so that the meaning is written once, beside the field."""

    field: str
    aliases: tuple[str, ...] = ()  # spellings users and docs knew before (kept working)
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # None: the field's type (int, float, str, bool)
    show: Callable[[Any], str] = str  # a value as the flag takes it
    repeat: bool = False  # given once per value (--lora a=x --lora b=y): the field is a tuple

    @property
    def name(self) -> str:
        return "--" + self.field.replace("_", "-")

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("model", metavar="PATH|NAME"),
    Flag("dtype", choices=("float32", "bfloat16")),
    Flag("quantization", choices=QUANTIZATIONS),
    Flag("max_num_seqs", metavar="N"),
    Flag("max_num_batched_tokens", metavar="N"),
    Flag("max_model_len", metavar="N"),
    Flag("page_size", metavar="N"),
    Flag("num_pages", metavar="N"),
    Flag("kv_cache_dtype", choices=KV_CACHE_DTYPES),
    Flag("kv_layout", choices=KV_LAYOUTS),
    Flag("kv_cache_memory_gb", metavar="GB"),
    Flag("kv_cache_memory_fraction", metavar="F"),
    Flag("tensor_parallel", metavar="N"),
    # `--mesh` was the only spelling before, in docs/multihost.md and users' launch scripts.
    Flag("mesh_shape", ("--mesh",), "DATAxMODEL", parse=_parse_mesh, show=_show_mesh),
    # `--no-chunked-prefill` and `--no-prefix-caching` were serve's, `--chunked-prefill on,off`
    # and `--prefix-caching on,off` the bench's: README, docs and scripts use them.
    Flag("enable_chunked_prefill", ("--chunked-prefill",)),
    Flag("async_scheduling"),
    Flag("enable_prefix_caching", ("--prefix-caching",)),
    Flag("host_kv_gb", metavar="GB"),
    Flag("preemption", choices=PREEMPTION_MODES),
    Flag("policy", choices=POLICIES),
    Flag("priority_aging_s", metavar="S"),
    Flag("batching", choices=BATCHING_MODES),
    Flag("batch_size", metavar="N"),
    Flag("dynamic_timeout_s", metavar="S"),
    Flag("max_waiting_requests", metavar="N"),
    # Not `choices`: the backends' list lives beside the kernels, which import JAX.
    Flag("attention_backend", metavar="NAME"),
    Flag("min_token_bucket", metavar="N"),
    Flag("token_bucket_factor", metavar="N"),
    Flag("token_bucket_step", metavar="N"),
    Flag("seq_bucket_factor", metavar="N"),
    Flag("precompile"),
    Flag("compilation_cache_dir", metavar="DIR"),
    # `--ttft-slo` / `--tpot-slo`: every command's spelling before, and the docs' and
    # `jaxserve tune`'s printed serve line.
    Flag("ttft_slo_s", ("--ttft-slo",), "S"),
    Flag("tpot_slo_s", ("--tpot-slo",), "S"),
    Flag("slo_scheduling"),
    Flag("cost_model", metavar="FILE"),
    Flag("calibrate_cost_model"),
    Flag("speculative", metavar="METHOD", parse=lambda text: _speculative(text)),
    Flag("num_speculative_tokens", metavar="K"),
    Flag("prompt_lookup_min", metavar="N"),
    Flag("prompt_lookup_max", metavar="N"),
    Flag("shed_late"),
    Flag("grammar_compile_timeout_s", metavar="S"),
    Flag("lora", metavar="NAME=PATH", parse=str, repeat=True),
    Flag("max_loras", metavar="N"),
    Flag("max_lora_rank", metavar="N"),
    Flag("kv_events_endpoint", metavar="ENDPOINT"),
    Flag("kv_events_replay_endpoint", metavar="ENDPOINT"),
    Flag("kv_events_topic", metavar="TOPIC"),
    Flag("kv_events_format", choices=KV_EVENTS_FORMATS),
)

NOT_FLAGS: dict[str, str] = {
    "seed": "each command's --seed says what it seeds (bench: traffic and weights, generate: "
    "sampling), and sets this one itself where it loads random weights",
    "show_progress": "a command's choice: serve logs JSON lines instead, batch has --no-progress "
    "for its own bar and the engine's",
}

DESCRIPTION = (
    "How the engine serves: EngineConfig's fields (jaxserve/engine_config.py), the same flags "
    "on every command. A flag not given keeps EngineConfig's default; None is 'none' (or '' "
    "for a name or path)."
)


def check_table(field_names: Collection[str]) -> list[str]:
    """What is wrong with the table for these EngineConfig fields: a field with neither a flag
    nor a NOT_FLAGS entry, an entry of no field, a field in both (empty: nothing)."""
    flags = [f.field for f in ENGINE_FLAGS]
    problems = [
        f"{n} has neither a flag nor a NOT_FLAGS entry"
        for n in field_names
        if n not in flags and n not in NOT_FLAGS
    ]
    problems += [f"{n} is in ENGINE_FLAGS and NOT_FLAGS" for n in flags if n in NOT_FLAGS]
    problems += [f"{n} is no field" for n in [*flags, *NOT_FLAGS] if n not in field_names]
    problems += [f"{n} has two flags" for n in sorted(set(flags)) if flags.count(n) > 1]
    return problems


@functools.cache
def field_docs() -> dict[str, str]:
    """Each EngineConfig field's docstring (the string after it in the class body), on one
    line: attribute docstrings are not kept at run time, so they are read from the source."""
    (cls,) = ast.parse(inspect.getsource(EngineConfig)).body
    docs, body = {}, cls.body
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
_KINDS = {"int": int, "float": float, "str": str, "bool": bool}


def _kind(field: str):
    """The field's type without `| None`: int, float, str, bool, or its annotation."""
    annotation = str(_FIELDS[field].type).removesuffix(" | None")
    return _KINDS.get(annotation, annotation)


def _optional(field: str) -> bool:
    return str(_FIELDS[field].type).endswith("| None")


def default_of(field: str):
    """EngineConfig's default of a field (a default_factory called now)."""
    return getattr(_defaults(), field)


@functools.cache
def _defaults() -> EngineConfig:
    return EngineConfig()


def show(flag: Flag, value) -> str:
    """A value as the flag's help and argv write it."""
    if value is None:
        return "None"
    return flag.show(value)


def help_of(flag: Flag) -> str:
    """The field's docstring, its fields named as flags, then EngineConfig's default (argparse
    formats help with %)."""
    doc = _FIELD_NAME.sub(lambda m: _FLAGS[m.group()].name, field_docs()[flag.field])
    doc = doc.replace("%", "%%")
    return f"{doc} (default: {show(flag, default_of(flag.field)).replace('%', '%%')})"


def _parser(flag: Flag) -> Callable[[str], Any]:
    """str -> the field's value, raising ArgumentTypeError with a sentence."""
    kind = _kind(flag.field)
    parse = flag.parse or kind
    if not callable(parse):
        raise TypeError(f"Flag {flag.name} needs parse=: {kind} is not int, float, str or bool.")

    def parse_value(text: str):
        # How a command line says None: "" for a path or name, "none" for a number.
        if _optional(flag.field) and text.strip().lower() in (
            "",
            "none" if kind is not str else "",
        ):
            return None
        try:
            return parse(text)
        except ValueError as e:
            what = {int: "an integer", float: "a number"}.get(kind)
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {what}" if what else str(e)
            ) from None

    return parse_value


def on_off(text: str) -> bool:
    """on or off (true/false, 1/0, yes/no) as a bool; ValueError otherwise."""
    word = text.strip().lower()
    if word in ("on", "true", "1", "yes"):
        return True
    if word in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"values must be on or off, not {text!r}")


def _list_parser(flag: Flag) -> Callable[[str], list]:
    parse = on_off if _kind(flag.field) is bool else _parser(flag)

    def parse_list(text: str) -> list:
        try:
            values = [parse(t) for t in text.split(",") if t.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r} lists no value")
        bad = [v for v in values if flag.choices and v not in flag.choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {flag.choices}")
        return values

    return parse_list


class _BoolListAction(argparse.Action):
    """A boolean flag in `lists`: `--flag` (on), `--no-flag` (off), `--flag on,off` (each)."""

    def __init__(self, option_strings, dest, **kwargs):
        names = [n for s in option_strings for n in (s, "--no-" + s.removeprefix("--"))]
        super().__init__(names, dest, nargs="?", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"{option_string} takes no value.")
            values = [False]
        setattr(namespace, self.dest, [True] if values is None else values)


class _AppendTuple(argparse.Action):
    """A repeatable flag: each use adds a value to a tuple (not a list, which would read as the
    bench's list of values to compare)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, (*getattr(namespace, self.dest, ()), values))


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, but a line never breaks inside a flag's name (--max-model-\\nlen)."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _format_action_invocation(self, action):
        if isinstance(action, _BoolListAction):  # `--no-flag` takes no value
            names = action.option_strings
            return ", ".join(
                n if n.startswith("--no-") else f"{n} [{action.metavar}]" for n in names
            )
        return super()._format_action_invocation(action)

    def _fill_text(self, text, width, indent):
        return textwrap.fill(
            " ".join(text.split()),
            width,
            initial_indent=indent,
            subsequent_indent=indent,
            break_on_hyphens=False,
        )


def add_engine_args(
    parser: argparse.ArgumentParser, *, lists: Collection[str] = (), note: str = ""
) -> argparse._ArgumentGroup:
    """Adds the group "engine": one flag per ENGINE_FLAGS entry. `lists`: fields whose flags
    take comma-separated values here (jaxserve bench). `note`: how this command differs (the
    defaults it sets itself), after the group's description."""
    unknown = set(lists) - {f.field for f in ENGINE_FLAGS}
    if unknown:
        raise ValueError(f"lists={sorted(unknown)} names no engine flag.")
    group = parser.add_argument_group("engine", f"{DESCRIPTION} {note}".strip())
    for flag in ENGINE_FLAGS:
        common = dict(dest=flag.field, default=argparse.SUPPRESS, help=help_of(flag))
        is_bool = _kind(flag.field) is bool
        if flag.field in lists:
            action = _BoolListAction if is_bool else "store"
            one = flag.metavar or ("{" + ",".join(flag.choices) + "}" if flag.choices else "X")
            metavar = "on,off" if is_bool else f"{one}[,...]"
            group.add_argument(
                *flag.names, action=action, type=_list_parser(flag), metavar=metavar, **common
            )
        elif is_bool:
            group.add_argument(*flag.names, action=argparse.BooleanOptionalAction, **common)
        elif flag.repeat:
            group.add_argument(
                *flag.names, action=_AppendTuple, type=_parser(flag), metavar=flag.metavar, **common
            )
        else:
            group.add_argument(
                *flag.names,
                type=_parser(flag),
                choices=flag.choices,
                metavar=flag.metavar,
                **common,
            )
    return group


def engine_values(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given on the command line, by field (a list for a field in `lists`)."""
    return {f.field: getattr(args, f.field) for f in ENGINE_FLAGS if hasattr(args, f.field)}


def engine_config_from_args(
    args: argparse.Namespace, defaults: Mapping[str, Any] | None = None, **overrides
) -> EngineConfig:
    """The EngineConfig of the flags given. A field whose flag was not given takes `defaults`'
    value (the command's own default, which its help states), else EngineConfig's; `overrides`
    win over the flags (fields the command fixes). A listed flag (jaxserve bench) must hold one
    value here, unless overridden."""
    values = dict(defaults or {})
    for field, value in engine_values(args).items():
        if isinstance(value, list) and field not in overrides:
            if len(value) != 1:
                flag = _FLAGS[field]
                raise ValueError(
                    f"{flag.name} takes one value here, not {len(value)}: "
                    f"{','.join(show(flag, v) for v in value)}."
                )
            value = value[0]
        values[field] = value
    values.update(overrides)
    return EngineConfig(**values)


def engine_argv(values: Mapping[str, Any]) -> list[str]:
    """Fields as flags, e.g. to start a `jaxserve serve` or a stage process with the engine
    flags of this one: engine_config_from_args(parse(engine_argv(v))) has the fields of v."""
    argv = []
    for field, value in values.items():
        flag = _FLAGS[field]
        if flag.repeat and isinstance(value, tuple):
            argv += [f"{flag.name}={show(flag, v)}" for v in value]
        elif _kind(field) is bool and not isinstance(value, list):
            if value is not None:
                argv.append(flag.name if value else f"--no-{flag.name.removeprefix('--')}")
        elif isinstance(value, list):
            words = [
                ("on" if v else "off") if isinstance(v, bool) else show(flag, v) for v in value
            ]
            argv.append(f"{flag.name}={','.join(words)}")
        elif value is None and _kind(field) is str:
            argv.append(f"{flag.name}=")
        else:
            argv.append(f"{flag.name}={show(flag, value)}")
    return argv


_FLAGS = {f.field: f for f in ENGINE_FLAGS}
# A field's name in a docstring (one with "_": "model" is also a word), not part of a dotted or
# file name (cost_model.py).
_FIELD_NAME = re.compile(rf"(?<![\w./])({'|'.join(f for f in _FLAGS if '_' in f)})(?!\w|\.\w)")
