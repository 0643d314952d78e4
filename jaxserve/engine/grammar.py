"""Grammars for structured output: compiled off the engine thread, cached, one matcher a request.

The grammar engine is llguidance (docs/architecture.md, "Structured output", has the
measurement against xgrammar). This module is the engine's only contact with it:

- `GrammarCompiler` turns a `StructuredOutput` into a ready llguidance matcher for the model's
  tokenizer, on its own worker threads, and caches the result by the constraint (equal schemas
  compile once). A compile that takes longer than `timeout_s` fails the request with a
  ValueError naming the bound, never the engine: the AsyncEngine awaits the compile on the
  caller's event loop before the request reaches the engine thread (`compile_async`), and the
  synchronous `Engine.add_request` waits for it on the caller's thread (`matcher`).
  llguidance's own parser limits stop pathological grammars inside the worker too.
- `RequestGrammar` is one request's matcher. It follows the request's output tokens
  (`sync`): it consumes the ones it has not seen, and rolls back any it saw that are gone, so
  it is right after a preemption or a recompute whatever happened in between. `fill` writes
  the row of the step's token bitmask (i32[S, ceil(V / 32)], the layout the step unpacks in
  runtime/sampling.apply_token_mask), with EOS allowed only where the grammar is complete.

Concurrency: `GrammarCompiler` is called from any thread (a lock guards its cache); compiles
run on its pool; a `RequestGrammar` is used by the engine thread alone.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import Sequence

import numpy as np

from jaxserve.structured_output import StructuredOutput

DEFAULT_COMPILE_TIMEOUT_S = 10.0
_CACHE_SIZE = 512  # compiled grammars kept (least recently used dropped first)


class GrammarCompiler:
    """Compiles constraints for one tokenizer on worker threads; caches them by constraint."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        max_workers: int = 2,
    ):
        """tokenizer: the model's Hugging Face tokenizer (None: no structured output);
        vocab_size: the model's (the bitmask's width, which may exceed the tokenizer's)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers, thread_name_prefix="jaxserve-grammar"
        )
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[StructuredOutput, concurrent.futures.Future] = (
            collections.OrderedDict()
        )
        # llguidance's description of the tokenizer, built once on a worker when the first
        # constraint arrives. Not bounded by timeout_s: it is the model's, not the constraint's,
        # which llguidance documents as ~1 s (16 s here for a synthetic BPE of 49,152 ids).
        self._ll_tokenizer: concurrent.futures.Future | None = None

    def submit(self, spec: StructuredOutput) -> concurrent.futures.Future:
        """The compile of `spec` (started now unless cached): a Future of its template matcher."""
        if self.tokenizer is None:
            raise ValueError(
                "This model has no tokenizer, so structured output cannot be enforced; load a "
                "model with one."
            )
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._pool.submit(self._describe_tokenizer)
            future = self._cache.get(spec)
            if future is None:
                future = self._cache[spec] = self._pool.submit(self._compile, spec)
                if len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec)
        return future

    def matcher(self, spec: StructuredOutput) -> RequestGrammar:
        """A new request's matcher for `spec`, waiting up to the bound for its compile."""
        future = self.submit(spec)
        self._ll_tokenizer.exception()  # the first constraint waits for it, unbounded
        try:
            template = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timeout(spec) from None
        return RequestGrammar(template, self.vocab_size)

    async def compile_async(self, spec: StructuredOutput) -> None:
        """Waits, without blocking the event loop, for `spec` to be compiled (so the engine
        thread later finds it in the cache); raises ValueError if it fails or runs too long."""
        future = self.submit(spec)
        # The tokenizer's description first, unbounded (once per process); then the bound.
        await asyncio.wait([asyncio.wrap_future(self._ll_tokenizer)])
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except TimeoutError:
            raise self._timeout(spec) from None

    def _timeout(self, spec: StructuredOutput) -> ValueError:
        return ValueError(
            f"The {spec.kind} constraint did not compile within {self.timeout_s} s "
            "(EngineConfig.grammar_compile_timeout_s); simplify it."
        )

    def _compile(self, spec: StructuredOutput):
        """On a worker: the matcher of `spec` in its initial state, its first mask computed
        (llguidance builds its lexer lazily; the engine thread should not pay for that)."""
        import llguidance
        import llguidance.numpy as llnp

        ll_tokenizer = self._ll_tokenizer.result()  # raises its ValueError for every compile
        matcher = llguidance.LLMatcher(ll_tokenizer, spec.engine_grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(
                f"The {spec.kind} constraint cannot be enforced: {matcher.get_error().strip()}"
            )
        llnp.fill_next_token_bitmask(matcher, llnp.allocate_token_bitmask(1, self.vocab_size))
        if matcher.is_error():
            raise ValueError(
                f"The {spec.kind} constraint cannot be enforced: {matcher.get_error().strip()}"
            )
        return matcher

    def _describe_tokenizer(self):
        """On a worker: llguidance's view of the tokenizer (ValueError if it has none)."""
        import llguidance.hf

        try:
            return llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
            )
        except Exception as e:  # llguidance raises ValueError and others for what it cannot read
            raise ValueError(
                "This model's tokenizer cannot be described to the grammar engine "
                f"(llguidance), so structured output cannot be enforced: {e}"
            ) from e

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's grammar state, kept in step with its output tokens (engine thread only)."""

    def __init__(self, template, vocab_size: int):
        self._matcher = template.deep_copy()
        self.vocab_size = vocab_size
        self._seen: list[int] = []  # the output tokens consumed, in order
        self.error: str | None = None  # why a token was refused (the request then ends)

    def sync(self, outputs: Sequence[int]) -> bool:
        """Brings the matcher to `outputs` (the request's output tokens); False if refused."""
        seen = self._seen
        common = len(seen)
        if len(outputs) < common or (common and outputs[common - 1] != seen[-1]):
            # Outputs that are not an extension of what was consumed: back to where they agree.
            common = next(
                (i for i, (a, b) in enumerate(zip(seen, outputs, strict=False)) if a != b),
                min(len(seen), len(outputs)),
            )
            self._matcher.rollback(len(seen) - common)
            del seen[common:]
        for token in outputs[common:]:
            if not self._matcher.consume_token(token):
                self.error = self._matcher.get_error().strip() or f"token {token} was refused"
                return False
            seen.append(token)
        return True

    def fill(self, mask: np.ndarray, row: int, address: int | None = None) -> None:
        """Row `row` of mask (i32[S, ceil(V / 32)], C-contiguous): the tokens allowed next.

        address: `mask.ctypes.data`, when the caller fills several rows of one mask (reading
        it costs about as much as a row's mask at a small vocabulary).
        """
        if address is None:
            if mask.dtype != np.int32 or mask.ndim != 2 or not mask.flags["C_CONTIGUOUS"]:
                raise ValueError(
                    f"A token mask is a C-contiguous int32 [rows, words] array, not "
                    f"{mask.dtype}{list(mask.shape)}."
                )
            address = mask.ctypes.data
        row_bytes = mask.shape[1] * 4
        self._matcher.unsafe_compute_mask_ptr(address + row * row_bytes, row_bytes)

    def is_accepting(self) -> bool:
        """Whether the output so far is complete (EOS is allowed now)."""
        return self._matcher.is_accepting()
