"""New weights for a running engine, checked and placed where the old ones live.

A trainer hands the engine a params pytree (Engine.update_weights, docs/rl.md). The jitted step
takes the params as an argument with pinned shardings, so a tree of the same structure, shapes,
dtypes and shardings runs the compiled step as it is: nothing compiles. This module makes sure
of that: it refuses any other tree with a sentence naming the offending path, and puts each
leaf on the sharding of the leaf it replaces (jax.device_put), whatever device it came from.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.models.loaded import is_unstacked, stack_layers, unstack_layers


def _path(keys) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)


def match_layout(new: dict, current: dict) -> dict:
    """`new` in `current`'s layer layout: the trainer may hold the stacked layout checkpoints
    use while the engine runs the unrolled loop's (or the reverse): the same weights, another
    tree."""
    if is_unstacked(current) and not is_unstacked(new):
        return unstack_layers(new)
    if not is_unstacked(current) and is_unstacked(new):
        return stack_layers(new)
    return new


def place_like(new: dict, current: dict) -> dict:
    """`new` (a flax param tree, stacked or one subtree per layer) laid out, checked and placed
    as `current` (the engine's params on their shardings).

    Raises ValueError naming the first path whose presence, shape or dtype differs.
    """
    new = match_layout(new, current)
    want = dict(jax.tree_util.tree_flatten_with_path(current)[0])
    got = dict(jax.tree_util.tree_flatten_with_path(new)[0])
    missing = [_path(k) for k in want if k not in got]
    extra = [_path(k) for k in got if k not in want]
    if missing or extra:
        raise ValueError(
            f"The new params do not have the model's structure: missing {missing[:3]}, "
            f"unexpected {extra[:3]} (of {len(want)} weights expected)."
        )
    for key, old in want.items():
        leaf = got[key]
        shape, dtype = tuple(np.shape(leaf)), np.dtype(getattr(leaf, "dtype", None) or "O")
        if shape != tuple(old.shape) or dtype != np.dtype(old.dtype):
            raise ValueError(
                f"New weight {_path(key)} is {dtype.name}{list(shape)}; the model's is "
                f"{np.dtype(old.dtype).name}{list(old.shape)}."
            )
    placed = {k: jax.device_put(got[k], old.sharding) for k, old in want.items()}
    treedef = jax.tree_util.tree_structure(current)
    return jax.tree_util.tree_unflatten(treedef, [placed[k] for k in want])
