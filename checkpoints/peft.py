"""LoRA adapters as Hugging Face PEFT saves them: `adapter_config.json` and
`adapter_model.safetensors` in one folder.

Read into a host `LoraAdapter` (jaxserve/models/lora.py) for one base model's shape: each
tensor `...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight` (A [r, in], B [out, r], as
torch's Linear keeps them) becomes layer i of the module's A [in, r] and B [r, out], with the
scaling PEFT applies (lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora; per-module r and
alpha from rank_pattern and alpha_pattern) folded into B. What jaxserve cannot serve is refused
with a sentence that names it: another base shape, a module other than the seven projections,
a rank over the engine's maximum, DoRA, trained biases, extra trained modules, a missing file.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from checkpoints.safetensors_io import iter_tensors
from jaxserve.models.config import ModelConfig
from jaxserve.models.lora import TARGET_MODULES, LoraAdapter, module_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (adapter name optional)
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)


class AdapterLoadError(ValueError):
    """The adapter cannot be served on this base model; the message says why."""


def load_peft_adapter(
    path: str | Path, name: str, config: ModelConfig, max_rank: int
) -> LoraAdapter:
    """The PEFT LoRA adapter in folder `path`, checked against base `config` and `max_rank`."""
    folder = Path(path)
    cfg_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for needed in (cfg_path, weights_path):
        if not needed.is_file():
            raise AdapterLoadError(
                f"Adapter {name!r}: {needed} does not exist; a PEFT LoRA adapter folder holds "
                f"{CONFIG_FILE} and {WEIGHTS_FILE} (save_pretrained's default)."
            )
    peft = json.loads(cfg_path.read_text())
    _check_config(name, peft)
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    shapes = module_shapes(config)
    for key, tensor in iter_tensors(weights_path):
        m = _KEY.match(key)
        if config.moe is not None and (m is None or m.group(2) not in shapes) and "lora_" in key:
            raise AdapterLoadError(
                f"Adapter {name!r} trains {key!r}, but the base model ({config.architecture}) is "
                f"a mixture of experts: LoRA on its experts and router is not supported, only "
                f"on the attention's {', '.join(shapes)}."
            )
        if m is None or m.group(2) not in TARGET_MODULES:
            raise AdapterLoadError(
                f"Adapter {name!r} trains {key!r}, which jaxserve cannot serve: LoRA is "
                f"supported on {', '.join(TARGET_MODULES)} of the decoder layers only."
            )
        layer, module, part = int(m.group(1)), m.group(2), m.group(3)
        found.setdefault((layer, module), {})[part] = np.asarray(tensor, np.float32)
    if not found:
        raise AdapterLoadError(f"Adapter {name!r}: {weights_path} holds no LoRA weights.")

    ranks: dict[str, int] = {}
    for (layer, module), parts in found.items():
        where = f"Adapter {name!r}, layer {layer} {module}"
        if set(parts) != {"A", "B"}:
            raise AdapterLoadError(f"{where} has lora_{''.join(parts)} but not both A and B.")
        if layer >= config.num_layers:
            raise AdapterLoadError(
                f"{where}: the base model has {config.num_layers} layers; the adapter was "
                f"trained for another base model."
            )
        a, b = parts["A"], parts["B"]  # [r, in], [out, r]
        n_in, n_out = shapes[module]
        r = a.shape[0]
        if a.shape != (r, n_in) or b.shape != (n_out, r):
            raise AdapterLoadError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                f"base model's {module} ({n_in} in, {n_out} out): the adapter was trained for "
                f"another base model."
            )
        if r > max_rank:
            raise AdapterLoadError(
                f"{where} has rank {r}, over the engine's max_lora_rank={max_rank}; start the "
                f"engine with --max-lora-rank {r} or more."
            )
        ranks[module] = max(ranks.get(module, 0), r)

    weights = {
        m: (
            np.zeros((config.num_layers, shapes[m][0], r), np.float32),
            np.zeros((config.num_layers, r, shapes[m][1]), np.float32),
        )
        for m, r in ranks.items()
    }
    for (layer, module), parts in found.items():
        a, b = parts["A"], parts["B"]
        r = a.shape[0]
        full_name = f"model.layers.{layer}.{_block(module)}.{module}"
        scale = _scaling(peft, full_name, r)
        weights[module][0][layer, :, :r] = a.T
        weights[module][1][layer, :r, :] = b.T * scale
    return LoraAdapter(name=name, rank=max(ranks.values()), weights=weights, source=str(folder))


def _block(module: str) -> str:
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def _pattern_value(patterns: dict | None, module_name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that names `module_name` or a
    suffix of it (a regular expression, as PEFT matches it)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def _scaling(peft: dict, module_name: str, rank: int) -> float:
    """The factor PEFT multiplies x @ A @ B by for this module."""
    r = _pattern_value(peft.get("rank_pattern"), module_name, peft.get("r", rank))
    alpha = _pattern_value(peft.get("alpha_pattern"), module_name, peft.get("lora_alpha", r))
    if r != rank:
        raise AdapterLoadError(
            f"{module_name}'s weights have rank {rank} but the adapter config says r={r}."
        )
    return alpha / (math.sqrt(r) if peft.get("use_rslora") else r)


def _check_config(name: str, peft: dict) -> None:
    """Refuses adapter configs whose forward jaxserve does not compute."""
    refusals = [
        (peft.get("peft_type", "LORA") != "LORA", f"peft_type={peft.get('peft_type')!r}"),
        (bool(peft.get("use_dora")), "use_dora=true (DoRA)"),
        (peft.get("bias", "none") != "none", f"bias={peft.get('bias')!r} (trained biases)"),
        (bool(peft.get("lora_bias")), "lora_bias=true"),
        (bool(peft.get("modules_to_save")), f"modules_to_save={peft.get('modules_to_save')}"),
        (bool(peft.get("fan_in_fan_out")), "fan_in_fan_out=true (Conv1D base layers)"),
    ]
    for refused, what in refusals:
        if refused:
            raise AdapterLoadError(
                f"Adapter {name!r} has {what}, which jaxserve does not serve; plain LoRA on "
                f"{', '.join(TARGET_MODULES)} is supported."
            )
