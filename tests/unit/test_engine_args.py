"""One map between EngineConfig and every command line (jaxserve/engine_args.py): the same
engine flags, help and defaults on every command, and each flag sets its field."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from jaxserve.bench import accelerator_check
from jaxserve.bench.suite import build_configs
from jaxserve.cli import build_parser
from jaxserve.engine_args import (
    ENGINE_FLAGS,
    NOT_FLAGS,
    add_engine_args,
    check_table,
    engine_argv,
    engine_config_from_args,
    engine_values,
    field_docs,
    show,
)
from jaxserve.engine_config import EngineConfig

FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]
FLAG_FIELDS = {f.field for f in ENGINE_FLAGS}
# The positionals each command needs before its flags parse.
COMMANDS = {
    "serve": [],
    "generate": ["Once upon a time"],
    "batch": ["in.jsonl", "out.jsonl"],
    "bench": [],
    "simulate": [],
    "tune": [],
    "accelerator_check": [],
}
# A value for every flag, none of them EngineConfig's default, valid together.
SAMPLE = dict(
    model="llama-tiny",
    dtype="bfloat16",
    quantization="int8-w8a8",
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=512,
    page_size=32,
    num_pages=100,
    kv_cache_dtype="fp8",
    kv_layout="uniform",
    kv_cache_memory_gb=2.5,
    kv_cache_memory_fraction=0.5,
    tensor_parallel=2,
    mesh_shape=(1, 2),
    enable_chunked_prefill=False,
    async_scheduling=False,
    enable_prefix_caching=False,
    host_kv_gb=2.5,
    preemption="swap",
    policy="priority",
    priority_aging_s=None,
    batching="dynamic",
    batch_size=4,
    dynamic_timeout_s=0.2,
    max_waiting_requests=7,
    attention_backend="xla",
    min_token_bucket=8,
    token_bucket_factor=4,
    token_bucket_step=32,
    seq_bucket_factor=4,
    precompile=False,
    compilation_cache_dir=None,
    ttft_slo_s=2.0,
    tpot_slo_s=0.05,
    slo_scheduling=True,
    cost_model="cost.json",
    calibrate_cost_model=False,
    shed_late=True,
    grammar_compile_timeout_s=2.5,
    speculative="ngram",
    num_speculative_tokens=6,
    prompt_lookup_min=1,
    prompt_lookup_max=4,
    lora=("sql=/adapters/sql", "chat=/adapters/chat"),  # repeated: one --lora each
    max_loras=2,
    max_lora_rank=32,
    kv_events_endpoint="tcp://127.0.0.1:5557",
    kv_events_replay_endpoint="tcp://127.0.0.1:5558",
    kv_events_topic="kv@pod@model",
    kv_events_format="array",
)


def _parser(command: str) -> argparse.ArgumentParser:
    if command == "accelerator_check":
        return accelerator_check.build_parser()
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


def _parse(command: str, *argv: str) -> argparse.Namespace:
    return _parser(command).parse_args([*COMMANDS[command], *argv])


def _engine_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest in FLAG_FIELDS}


def test_every_field_has_a_flag_or_a_reason_why_not():
    assert check_table(FIELDS) == []
    assert check_table([*FIELDS, "new_knob"]) == [
        "new_knob has neither a flag nor a NOT_FLAGS entry"
    ]
    assert check_table([f for f in FIELDS if f != "seed"]) == ["seed is no field"]
    assert all(len(reason) > 20 for reason in NOT_FLAGS.values())
    # The help is the field's docstring: a flag without one would have none.
    assert all(len(field_docs().get(f, "")) > 10 for f in FLAG_FIELDS)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "serve"])
def test_every_command_shows_serves_engine_flags_and_help(command):
    def shown(parser):
        actions = _engine_actions(parser)
        return {d: (sorted(a.option_strings), a.help) for d, a in actions.items()}

    serve = shown(_parser("serve"))
    assert set(serve) == FLAG_FIELDS
    assert shown(_parser(command)) == serve


def test_each_help_ends_with_engine_configs_default():
    defaults = EngineConfig()
    for dest, action in _engine_actions(_parser("serve")).items():
        flag = next(f for f in ENGINE_FLAGS if f.field == dest)
        help_text = action.help.replace("%%", "%")
        assert help_text.endswith(f"(default: {show(flag, getattr(defaults, dest))})"), dest
        assert flag.name in action.option_strings
    text = " ".join(_parser("serve").format_help().split())
    assert "Slots: rows of the decode batch. (default: 32)" in text
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in text


@pytest.mark.parametrize("command", COMMANDS)
def test_no_flags_is_engine_configs_defaults(command):
    args = _parse(command)
    assert engine_values(args) == {}
    assert engine_config_from_args(args) == EngineConfig()


@pytest.mark.parametrize("command", COMMANDS)
def test_each_flag_sets_its_field(command):
    assert set(SAMPLE) == FLAG_FIELDS
    defaults = EngineConfig()
    assert [f for f, v in SAMPLE.items() if getattr(defaults, f) == v] == []
    config = engine_config_from_args(_parse(command, *engine_argv(SAMPLE)))
    assert config == EngineConfig(**SAMPLE)


def test_older_spellings_still_work():
    args = _parse(
        "serve",
        *("--no-chunked-prefill", "--no-prefix-caching", "--mesh", "1x4"),
        *("--ttft-slo", "0.5", "--tpot-slo", "0.1", "--priority-aging-s", "none"),
    )
    assert engine_values(args) == dict(
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        mesh_shape=(1, 4),
        ttft_slo_s=0.5,
        tpot_slo_s=0.1,
        priority_aging_s=None,
    )


def test_defaults_fill_unset_flags_and_overrides_win():
    args = _parse("serve", "--max-num-seqs", "8")
    config = engine_config_from_args(args, {"max_num_seqs": 4, "policy": "priority"})
    assert (config.max_num_seqs, config.policy) == (8, "priority")
    assert engine_config_from_args(args, max_num_seqs=2).max_num_seqs == 2


def test_bad_values_are_argparse_errors(capsys):
    for argv in (["--max-num-seqs", "many"], ["--policy", "fifo"], ["--mesh-shape", "2"]):
        with pytest.raises(SystemExit):
            _parse("serve", *argv)
    assert "'many' is not an integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("bench", "--chunked-prefill", "maybe")
    assert "values must be on or off, not 'maybe'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("bench", "--tensor-parallel", "1,2")  # held fixed: one mesh for every engine


def test_bench_compares_the_flags_given_as_lists():
    args = _parse(
        "bench", "--max-num-seqs", "8,16", "--chunked-prefill", "on,off", "--policy", "priority"
    )
    assert engine_values(args) == dict(
        max_num_seqs=[8, 16], enable_chunked_prefill=[True, False], policy=["priority"]
    )
    with pytest.raises(ValueError, match="--max-num-seqs takes one value here, not 2: 8,16"):
        engine_config_from_args(args)
    configs = build_configs(args, 128)
    assert [label for label, _ in configs] == [
        "seqs=8 chunked=on",
        "seqs=8 chunked=off",
        "seqs=16 chunked=on",
        "seqs=16 chunked=off",
    ]
    assert {(c.policy, c.max_model_len) for _, c in configs} == {("priority", 128)}
    # A bool flag alone, or its --no- form, is one value.
    assert engine_values(_parse("bench", "--no-prefix-caching", "--shed-late")) == dict(
        enable_prefix_caching=[False], shed_late=[True]
    )


def test_a_plain_parser_gets_the_group():
    parser = argparse.ArgumentParser()
    group = add_engine_args(parser, note="Here: nothing else.")
    assert group.title == "engine" and group.description.endswith("Here: nothing else.")
    assert engine_config_from_args(parser.parse_args(["--page-size", "8"])).page_size == 8
    with pytest.raises(ValueError, match="names no engine flag"):
        add_engine_args(argparse.ArgumentParser(), lists=["seed"])
