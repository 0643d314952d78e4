"""What the subcommands share: the error a user can fix, the multi-host flags, model loading.

Below every subcommand module and jaxserve/cli/__init__.py (which imports them all), so that
none of them imports the package that imports it.
"""

from __future__ import annotations

import argparse

# The goodput targets of bench, simulate and tune where --ttft-slo-s / --tpot-slo-s are not given
# (an engine has none by default, but goodput is measured against some).
GOODPUT_TARGETS = dict(ttft_slo_s=1.0, tpot_slo_s=0.1)


class UserError(Exception):
    """A problem with the command line or its inputs, reported as one line."""


def add_multihost_args(p: argparse.ArgumentParser) -> None:
    """Flags that join a multi-host cluster (docs/multihost.md). Not engine flags: they say how
    this process starts, not what the engine is, and the engine never reads them."""
    g = p.add_argument_group("multi-host")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="multi-host: call jax.distributed.initialize (cluster auto-detected unless the "
        "three flags below are given); process 0 serves, the others follow its steps",
    )
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)


def joins_cluster(args: argparse.Namespace) -> bool:
    """Whether the multi-host flags ask for a cluster (jax.distributed)."""
    explicit = (args.coordinator_address, args.num_processes, args.process_id)
    return args.distributed or any(v is not None for v in explicit)


def join_cluster(args: argparse.Namespace) -> None:
    """Joins the cluster if asked; before any device is touched, as jax.distributed requires."""
    if joins_cluster(args):
        from jaxserve.runtime import multihost

        multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)


def is_follower(args: argparse.Namespace) -> bool:
    """After `join_cluster`: whether this process joined a cluster as other than process 0, so
    it runs process 0's steps instead of its own (on one host: False, without touching JAX)."""
    if not joins_cluster(args):
        return False
    from jaxserve.runtime import multihost

    return not multihost.is_leader()


def load(spec: str | None, *, dtype: str | None = None, seed: int = 0, mesh=None):
    """checkpoints.load_model, its errors as UserError."""
    from checkpoints import ModelLoadError, load_model

    try:
        return load_model(spec, dtype=dtype, seed=seed, mesh=mesh)
    except ModelLoadError as e:
        raise UserError(str(e)) from e


def load_for(config):
    """The model of an EngineConfig, loaded into its device mesh."""
    from jaxserve.models.sharding import make_mesh

    mesh = make_mesh(config.tensor_parallel, config.mesh_shape)
    return load(config.model, dtype=config.dtype, seed=config.seed, mesh=mesh)
