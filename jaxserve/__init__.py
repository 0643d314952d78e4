"""jaxserve: an LLM serving engine on JAX with continuous batching and paged KV caches."""

from __future__ import annotations

__version__ = "0.1.0"
