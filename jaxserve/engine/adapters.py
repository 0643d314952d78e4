"""`Adapters`: the LoRA adapters an engine serves, registered by name, in host memory.

Registering reads and checks the adapter (checkpoints/peft.py) and keeps its weights here; it
reaches the device only when a request needs it (the scheduler gives it a slot,
scheduling/lora_slots.py, and the engine writes it there). Each registration gets a fresh
identity (`salt`), which the prefix cache hashes with the tokens: pages computed under one
adapter, or under an earlier adapter of the same name, are never served to another.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from checkpoints.peft import load_peft_adapter
from jaxserve.models.config import ModelConfig
from jaxserve.models.lora import LoraAdapter


class Adapters:
    """Registered adapters by name, with the identity their cached pages are hashed under."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int):
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._adapters: dict[str, LoraAdapter] = {}
        self._salts: dict[str, str] = {}
        self._serial = itertools.count(1)

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._adapters)

    def items(self) -> list[tuple[str, LoraAdapter]]:
        """(name, adapter) of each, in registration order: one copy, safe from any thread."""
        return list(self._adapters.items())

    def get(self, name: str) -> LoraAdapter:
        return self._adapters[name]

    def salt(self, name: str) -> str:
        """What the prefix cache hashes a request of `name` under: unique per registration."""
        return self._salts[name]

    def check_name(self, name: str | None) -> None:
        """Raises ValueError unless `name` is None or a registered adapter."""
        if name is not None and name not in self._adapters:
            known = ", ".join(repr(n) for n in self._adapters) or "none"
            raise ValueError(f"LoRA adapter {name!r} is not loaded; loaded adapters: {known}.")

    def register(self, name: str, source: str | Path | LoraAdapter) -> LoraAdapter:
        """Registers an adapter under `name`: a PEFT folder, read and checked now, or one read
        already. Raises ValueError (checkpoints.peft.AdapterLoadError) when it cannot serve."""
        if not self.max_loras:
            raise ValueError(
                f"Adapter {name!r} cannot be loaded: this engine has no adapter slots "
                f"(max_loras=0); start it with --max-loras N."
            )
        if not isinstance(name, str) or not name or name.strip() != name:
            raise ValueError(f"Adapter name {name!r} must be a non-empty string without spaces.")
        if "," in name:  # the LoRA info metric lists adapters separated by commas
            raise ValueError(
                f"Adapter name {name!r} must not contain a comma: routers read the adapters in "
                "use as a comma-separated list (docs/routing.md)."
            )
        if name in self._adapters:
            raise ValueError(f"An adapter named {name!r} is loaded already; unload it first.")
        if isinstance(source, LoraAdapter):
            adapter = source
            if adapter.rank > self.max_rank:
                raise ValueError(
                    f"Adapter {name!r} has rank {adapter.rank}, over max_lora_rank={self.max_rank}."
                )
        else:
            adapter = load_peft_adapter(source, name, self.config, self.max_rank)
        self._adapters[name] = adapter
        self._salts[name] = f"lora:{name}#{next(self._serial)}"
        return adapter

    def unregister(self, name: str) -> None:
        """Forgets `name` (the caller checked that no request uses it)."""
        self.check_name(name)
        del self._adapters[name]
        del self._salts[name]
