"""The `jaxserve` command: generate, convert (and the subcommands later issues add).

Errors a user can fix (a missing model folder, an unsupported architecture, a prompt too long)
end with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence

# Quiet JAX/absl start-up chatter before they are imported.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class UserError(Exception):
    """A problem with the command line or its inputs, reported as one line."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="model folder (Hugging Face or converted) or named random shape; "
        "default: the embedded stories260k",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="parameter dtype (default: float32 on CPU, bfloat16 on accelerators)",
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from jaxserve.engine import Engine
    from jaxserve.engine_config import EngineConfig
    from jaxserve.sampling_params import SamplingParams

    # Checked before the model loads, so a bad flag fails at once.
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    model = _load(args)
    if model.tokenizer is None:
        raise UserError(f"Model {model.source} has random weights and no tokenizer to read text.")
    engine = Engine(
        EngineConfig(
            max_num_seqs=1, max_num_batched_tokens=256, precompile=False, show_progress=False
        ),
        model=model,
    )
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

    model = _load(args, spec=args.hf_dir)
    try:
        out = save_orbax(model, args.out_dir)
    except FileExistsError as e:
        raise UserError(str(e)) from e
    print(f"Wrote {model.config.architecture} model from {model.source} to {out}.")
    return 0


def _load(args: argparse.Namespace, spec: str | None = None):
    from checkpoints import ModelLoadError, load_model

    try:
        return load_model(spec if spec is not None else args.model, dtype=args.dtype)
    except ModelLoadError as e:
        raise UserError(str(e)) from e


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    _add_model_args(gen)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_cmd_generate)

    conv = sub.add_parser("convert", help="convert a Hugging Face folder to an orbax checkpoint")
    conv.add_argument("hf_dir")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    conv.set_defaults(func=_cmd_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except (UserError, ValueError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
