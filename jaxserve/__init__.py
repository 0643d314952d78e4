"""jaxserve: an LLM serving engine on JAX with continuous batching and paged KV caches.

`from jaxserve import LLM, SamplingParams` works as in vLLM. Both are loaded on first use
(PEP 562), so that `import jaxserve.scheduling.scheduler` and the other jax-free modules stay
jax-free.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncEngine", "EngineConfig", "SamplingParams", "StructuredOutput"]

_LAZY = {
    "LLM": "jaxserve.engine.llm",
    "AsyncEngine": "jaxserve.engine.async_engine",
    "EngineConfig": "jaxserve.engine_config",
    "SamplingParams": "jaxserve.sampling_params",
    "StructuredOutput": "jaxserve.structured_output",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
