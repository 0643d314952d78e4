"""orbax-checkpoint save and restore of converted models (params + config + tokenizer).

Layout of a converted folder:
    jaxserve.json   format version, model config, dtype, source
    params/         the orbax checkpoint of the param tree
    tokenizer/      the tokenizer's `save_pretrained` files (absent for random-weight models)

Restoring with `shardings` places each array straight into its sharding (tensor parallelism)
instead of first building the whole model on one device.

Params are stored stacked ([num_layers, ...] under "layers") with fused q/k/v and gate/up
projections, whatever layer loop saved them. Folders of the first format (separate q/k/v and
gate/up) are refused with a message to convert the source again: a converted folder is a cache of
its source, and converting is faster and safer than a second fusing code path kept for them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from checkpoints.config_json import (
    LoadedModel,
    abstract_params,
    config_from_json,
    config_to_json,
    stack_layers,
)

FORMAT = "jaxserve-orbax-2"  # 2: fused qkv_proj and gate_up_proj
MARKER = "jaxserve.json"


def save_orbax(model: LoadedModel, out_dir: str | Path) -> Path:
    """Writes `model` to `out_dir` (which must not hold a checkpoint already)."""
    out = Path(out_dir).absolute()
    if (out / MARKER).exists() or (out / "params").exists():
        raise FileExistsError(f"{out} already holds a checkpoint; choose an empty folder.")
    out.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out / "params", stack_layers(model.params))
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(out / "tokenizer")
    meta = {
        "format": FORMAT,
        "config": config_to_json(model.config),
        "dtype": jnp.dtype(model.dtype).name,
        "source": model.source,
    }
    # Written last: a folder with the marker is a complete checkpoint.
    (out / MARKER).write_text(json.dumps(meta, indent=2))
    return out


def is_orbax_dir(path: Path) -> bool:
    return (path / MARKER).exists()


def restore_orbax(path: Path, *, dtype=None, shardings: Any = None, mesh=None) -> LoadedModel:
    """Restores a `save_orbax` folder (stacked params), optionally into `shardings` (a param-shaped
    tree) or into the shardings jaxserve.models.sharding decides for this model on `mesh`."""
    meta = json.loads((path / MARKER).read_text())
    if meta.get("format") == "jaxserve-orbax-1":
        raise ValueError(
            f"{path} was converted by an older jaxserve (format 'jaxserve-orbax-1', separate "
            f"q/k/v and gate/up weights; this one reads {FORMAT!r}). Convert its source again: "
            f"`jaxserve convert {meta.get('source', 'SOURCE')} NEW_FOLDER`."
        )
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path / MARKER} has format {meta.get('format')!r}, expected {FORMAT!r}.")
    config = config_from_json(meta["config"])
    dtype = jnp.dtype(dtype or meta["dtype"])
    target = abstract_params(config, dtype)
    if shardings is None and mesh is not None:
        from jaxserve.models.sharding import ShardingPlan

        shardings = ShardingPlan.create(mesh, config).params(target)
    if shardings is None:
        device = jax.devices()[0]
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), target)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, shardings
    )
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(path.absolute() / "params", target)
    tokenizer = None
    if (path / "tokenizer").exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer", local_files_only=True)
    return LoadedModel(
        config=config,
        params=params,
        tokenizer=tokenizer,
        dtype=dtype,
        source=meta.get("source", str(path)),
    )
