"""The `jaxserve` command: generate, convert, serve, client, bench, batch (and later subcommands).

Errors a user can fix (a missing model folder, an unsupported architecture, a prompt too long)
end with one line on stderr and exit status 2, never a traceback.

Each area adds its subcommands with `register(subparsers)`: generate.py (generate, convert),
serve.py (serve, client), bench.py (bench, batch), simulate.py (simulate), tune.py (tune).
Handlers import JAX, the engine and gRPC themselves, so `jaxserve --help` and `jaxserve client`
start without initializing JAX (simulate and tune never do).
"""

from __future__ import annotations

import argparse
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


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Flags that split the model over a device mesh (see docs/multihost.md)."""
    g = p.add_argument_group("devices")
    g.add_argument(
        "--tensor-parallel", type=int, default=1, metavar="N", help="split over N devices"
    )
    g.add_argument(
        "--mesh", default=None, metavar="DATAxMODEL", help="explicit mesh shape, e.g. 1x8"
    )
    g.add_argument(
        "--distributed",
        action="store_true",
        help="multi-host: call jax.distributed.initialize (cluster auto-detected unless the "
        "three flags below are given); process 0 serves, the others follow its steps",
    )
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)


def _joins_cluster(args: argparse.Namespace) -> bool:
    """Whether the parallel flags ask for a multi-host cluster (jax.distributed)."""
    explicit = (args.coordinator_address, args.num_processes, args.process_id)
    return args.distributed or any(v is not None for v in explicit)


def _parallel(args: argparse.Namespace) -> dict:
    """EngineConfig fields of the parallel flags; joins the cluster first if asked (before any
    device is touched, as jax.distributed requires)."""
    from jaxserve.models.sharding import parse_mesh_shape
    from jaxserve.runtime import multihost

    if _joins_cluster(args):
        multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    mesh_shape = parse_mesh_shape(args.mesh) if args.mesh else None
    return dict(tensor_parallel=args.tensor_parallel, mesh_shape=mesh_shape)


def _is_follower(args: argparse.Namespace) -> bool:
    """After `_parallel`: whether this process joined a cluster as other than process 0, so it
    runs process 0's steps instead of its own (on one host: False, without touching JAX)."""
    if not _joins_cluster(args):
        return False
    from jaxserve.runtime import multihost

    return not multihost.is_leader()


def _load(args: argparse.Namespace, spec: str | None = None, mesh=None):
    from checkpoints import ModelLoadError, load_model

    try:
        return load_model(spec if spec is not None else args.model, dtype=args.dtype, mesh=mesh)
    except ModelLoadError as e:
        raise UserError(str(e)) from e


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at the top: these modules import the helpers above.
    from jaxserve.cli import bench, generate, serve, simulate, tune

    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.register(sub)
    serve.register(sub)
    bench.register(sub)
    simulate.register(sub)
    tune.register(sub)
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
