"""`jaxserve generate` (one prompt, streamed to stdout) and `jaxserve convert` (HF -> orbax)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxserve.cli.common import UserError, add_multihost_args, join_cluster, load, load_for
from jaxserve.engine_args import add_engine_args, engine_argv, engine_config_from_args

# One prompt: its buckets compile as they are first used rather than all of them at start-up.
GENERATE_DEFAULTS = dict(precompile=False)


def register(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    add_engine_args(gen, note=f"Here, unless given: {' '.join(engine_argv(GENERATE_DEFAULTS))}.")
    add_multihost_args(gen)
    gen.set_defaults(func=_cmd_generate)

    conv = sub.add_parser("convert", help="convert a Hugging Face folder to an orbax checkpoint")
    conv.add_argument("hf_dir")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    conv.set_defaults(func=_cmd_convert)


def _cmd_generate(args: argparse.Namespace) -> int:
    from jaxserve.engine.build import build_engine
    from jaxserve.runtime import multihost
    from jaxserve.sampling_params import SamplingParams

    # Checked before the model loads, so a bad flag fails at once.
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    config = engine_config_from_args(args, GENERATE_DEFAULTS, show_progress=False)
    join_cluster(args)  # before the model loads: a cluster must be joined first
    model = load_for(config)
    if model.tokenizer is None:
        raise UserError(f"Model {model.source} has random weights and no tokenizer to read text.")
    engine = build_engine(config, model=model)
    if engine.runner.lockstep is not None and not multihost.is_leader():
        engine.runner.follow()  # multi-host: the other processes run process 0's steps
        return 0
    try:
        return _generate(engine, args, params)
    finally:
        engine.runner.stop_followers()  # lets them return (a no-op on one host)


def _generate(engine, args: argparse.Namespace, params) -> int:
    prompt_ids = engine.encode(args.prompt)
    context = engine.max_model_len
    if len(prompt_ids) >= context:
        raise UserError(
            f"The prompt has {len(prompt_ids)} tokens but the model's context is {context} tokens."
        )
    # The reply may use what the prompt leaves of the context.
    max_tokens = min(args.max_tokens, context - len(prompt_ids))
    engine.add_request(prompt_ids, dataclasses.replace(params, max_tokens=max_tokens))
    sys.stdout.write(args.prompt)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from checkpoints import save_orbax

    model = load(args.hf_dir, dtype=args.dtype)
    try:
        out = save_orbax(model, args.out_dir)
    except FileExistsError as e:
        raise UserError(str(e)) from e
    print(f"Wrote {model.config.architecture} model from {model.source} to {out}.")
    return 0
