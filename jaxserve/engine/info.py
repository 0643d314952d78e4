"""`EngineInfo`: what a front end may know about the engine it serves, as plain values.

The service (gRPC and HTTP) names the model, checks requests against the vocabulary and the
context, and reports the engine's limits. It reads all of that here, once, instead of reaching
through the engine's runner, model and configs, so those may change shape without the service
noticing, and a check can be tested with a hand-made `EngineInfo`. Every value is fixed once the
engine is built, so any thread may read it. Plain Python (no jax) like the scheduler's types.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxserve.engine.core import Engine


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineInfo:
    """The served model and the engine's limits, read once from a built `Engine`."""

    model: str  # where the weights came from (a folder or a hub id), for names and messages
    architecture: str  # the model config's family ("llama")
    dtype: str  # numpy's name of the weights' dtype ("float32", "bfloat16")
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_tokenizer: bool  # False: only token ids can be sent (a random-weight model)
    max_model_len: int  # prompt and output tokens of one request, together
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting_requests: int
    num_pages: int  # KV-cache pages in the pool, as the runner sized it
    page_size: int
    policy: str  # the scheduler's policy ("fcfs", "priority")
    max_loras: int = 0  # LoRA adapter slots on the device; 0: requests may name no adapter
    kv_bytes: int = 0  # the device KV pool's bytes (0: a runner without one)
    num_host_pages: int = 0  # pages of the host KV pool (--host-kv-gb; 0: none)
    host_kv_bytes: int = 0  # its bytes (mapped lazily: taken as pages are used)

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        """The description of a built engine (only here does anything look inside it)."""
        config, model, host = engine.config, engine.model, engine.kv_transfer
        return cls(
            model=str(model.source),
            architecture=model.config.architecture,
            dtype=str(np.dtype(model.dtype)),
            vocab_size=model.config.vocab_size,
            eos_token_ids=tuple(model.config.eos_token_ids),
            has_tokenizer=engine.tokenizer is not None,
            max_model_len=engine.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_waiting_requests=config.max_waiting_requests,
            num_pages=engine.runner.config.num_pages,
            page_size=config.page_size,
            policy=config.policy,
            max_loras=config.max_loras,
            kv_bytes=engine.kv_bytes,
            num_host_pages=0 if host is None else host.num_host_pages,
            host_kv_bytes=0 if host is None else host.host_bytes,
        )
