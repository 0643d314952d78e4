"""Model definitions. The Llama family covers Llama 2/3, Mistral, Qwen2, Qwen3 and SmolLM."""

from __future__ import annotations

from jaxserve.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
