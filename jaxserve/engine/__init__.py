"""The engine: the iteration loop, its asynchronous front, outputs, and the offline `LLM`.

`from jaxserve.engine import Engine` (and `AsyncEngine`, `LLM`) load their modules on first use,
so importing a jax-free module of this package does not import jax. `Engine` here is the engine
as its config asks (build.py: the core with the SLO policy the config names); `core.Engine` is
the loop alone, which takes its policy as an argument.
"""

from __future__ import annotations

_LAZY = {
    "Engine": "jaxserve.engine.build",
    "AsyncEngine": "jaxserve.engine.async_engine",
    "LLM": "jaxserve.engine.llm",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxserve.engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
