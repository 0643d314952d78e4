"""The `jaxserve` command: generate, convert, serve, client, bench, batch (and later subcommands).

Errors a user can fix (a missing model folder, an unsupported architecture, a prompt too long)
end with one line on stderr and exit status 2, never a traceback.

Each area adds its subcommands with `register(subparsers)`: generate.py (generate, convert),
serve.py (serve, client), bench.py (bench, batch), simulate.py (simulate), tune.py (tune),
compile.py (compile); what they share is in common.py, and every command that builds an engine
takes the same engine flags (jaxserve/engine_args.py). Handlers import JAX, the engine and gRPC
themselves, so `jaxserve --help` and `jaxserve client` start without initializing JAX (simulate
and tune never do).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Sequence

# Quiet JAX/absl start-up chatter before they are imported.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from jaxserve.cli import bench, generate, serve, simulate, tune
from jaxserve.cli import compile as compile_command
from jaxserve.cli.common import UserError
from jaxserve.engine_args import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    # Every subcommand's help wraps lines between flags' names, not inside them.
    subparser = functools.partial(argparse.ArgumentParser, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=subparser)
    generate.register(sub)
    serve.register(sub)
    bench.register(sub)
    simulate.register(sub)
    tune.register(sub)
    compile_command.register(sub)
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
