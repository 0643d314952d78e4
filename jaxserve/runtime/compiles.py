"""Every XLA compile in the process, counted from JAX's own compile events.

    compiles.install()                  # once; idempotent; raises if JAX reports no compiles
    with compiles.warming_up():         # an engine's start-up: its compiles are expected
        runner.precompile()
    mark = compiles.serving()           # compiles outside any warm-up so far
    ...                                 # serve
    compiles.serving() - mark           # must stay 0 (docs/architecture.md, Decision 3)

Why the process and not the step: a compile anywhere stalls whatever thread runs it, and one
on the engine thread stalls every stream. Counting traces of the jitted step (what the runner
did alone) missed the penalty initialiser, which compiled on the first request with penalties.
JAX reports each backend compile (or load from the persistent cache, which stalls too) as a
duration event; a listener counts them, whichever function compiled.

Warm-ups are set apart per thread (`warming_up`), so an engine built while another one serves
(the bench builds several in one process) is not counted as the serving one's compile.
"""

from __future__ import annotations

import collections
import contextlib
import threading

import jax
import numpy as np

# The event JAX 0.10 records around every backend compile (jax._src.dispatch.BACKEND_COMPILE_EVENT).
# Read from JAX where it still names it; the literal is the fallback if the constant moves.
_KNOWN_EVENTS = ("/jax/core/compile/backend_compile_duration",)

_lock = threading.Lock()
_local = threading.local()  # .depth: how many `warming_up` blocks this thread is inside
_installed = False
_events: frozenset[str] = frozenset()
_total = 0  # every compile since install
_serving = 0  # those outside any warm-up
_recent: collections.deque[tuple[str, str]] = collections.deque(maxlen=32)


def _event_names() -> frozenset[str]:
    """The backend-compile event's names: JAX's own constant where it has one, and the known."""
    names = set(_KNOWN_EVENTS)
    try:
        from jax._src import dispatch

        name = getattr(dispatch, "BACKEND_COMPILE_EVENT", None)
        if isinstance(name, str):
            names.add(name)
    except ImportError:  # a private module: the known names, checked by the probe below
        pass
    return frozenset(names)


def _on_duration(event: str, duration: float, **kwargs) -> None:
    global _total, _serving
    if event not in _events:
        return
    with _lock:
        _total += 1
        if not getattr(_local, "depth", 0):
            _serving += 1
            name = str(kwargs.get("fun_name", "?"))
            _recent.append((name, threading.current_thread().name))


def install() -> None:
    """Starts counting (once per process; later calls do nothing).

    Compiles a probe function to prove the listener hears JAX's compiles: a JAX that renamed
    the event would otherwise leave every count at 0 and the "no compiles after warm-up" tests
    passing for nothing. Raises RuntimeError naming the events it did hear instead.
    """
    global _installed, _events
    with _lock:
        if _installed:
            return
        _installed = True
        _events = _event_names()
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    heard: list[str] = []
    probing = [True]

    def hear(event: str, duration: float, **kwargs) -> None:
        if probing[0]:  # a JAX without unregister keeps calling it: a no-op after the probe
            heard.append(event)

    jax.monitoring.register_event_duration_secs_listener(hear)
    unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
    before = _total
    try:
        with warming_up():
            # A new function, so neither JAX's in-memory cache nor anything else has it.
            probe = jax.jit(lambda x: x * 3 + 1)
            jax.block_until_ready(probe(np.arange(3, dtype=np.int32)))
    finally:
        probing[0] = False
        if unregister is not None:
            unregister(hear)
    if _total == before:
        compile_like = sorted({e for e in heard if "compil" in e}) or sorted(set(heard))
        if unregister is not None:
            unregister(_on_duration)
        with _lock:
            _installed = False
        raise RuntimeError(
            f"JAX {jax.__version__} compiled a probe function without reporting any of the "
            f"compile events {sorted(_events)}; it reported {compile_like}. Add the name of its "
            "backend-compile event to _KNOWN_EVENTS in jaxserve/runtime/compiles.py, or the "
            "engine cannot count its compiles after warm-up."
        )


@contextlib.contextmanager
def warming_up():
    """Compiles on this thread inside the block are expected ones (an engine's start-up)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def total() -> int:
    """Every compile in the process since `install`, warm-ups included."""
    return _total


def serving() -> int:
    """Compiles in the process since `install` outside any `warming_up` block."""
    return _serving


def recent() -> list[tuple[str, str]]:
    """The last compiles outside warm-ups, as (function name, thread name), oldest first: what
    a test that finds compiles after warm-up prints."""
    with _lock:
        return list(_recent)
