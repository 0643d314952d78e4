"""The process-wide compile counter (jaxserve/runtime/compiles.py): what it counts, what it
sets apart as warm-up, and that it refuses a JAX whose compile event it cannot hear."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from jaxserve.runtime import compiles


def _compile_something(k: int) -> None:
    """A function new to JAX (a fresh lambda), so it compiles rather than hits a cache."""
    jax.block_until_ready(jax.jit(lambda x: x * k + 11)(np.arange(4, dtype=np.int32)))


def test_counts_compiles_and_sets_warm_ups_apart():
    compiles.install()
    total, serving = compiles.total(), compiles.serving()
    _compile_something(3)
    assert (compiles.total(), compiles.serving()) == (total + 1, serving + 1)
    assert compiles.recent()[-1][1] == threading.current_thread().name
    with compiles.warming_up():
        _compile_something(4)
    assert (compiles.total(), compiles.serving()) == (total + 2, serving + 1)


def test_another_threads_warm_up_is_not_this_ones():
    """An engine built on one thread while another serves: only the serving thread's compiles
    are serving ones."""
    compiles.install()
    serving = compiles.serving()
    inside = threading.Event()
    release = threading.Event()

    def warm():
        with compiles.warming_up():
            inside.set()
            release.wait(30)
            _compile_something(5)

    thread = threading.Thread(target=warm)
    thread.start()
    assert inside.wait(30)
    _compile_something(6)  # this thread is not warming up, though the other one is
    release.set()
    thread.join(30)
    assert compiles.serving() == serving + 1


def test_a_jax_whose_compile_event_is_unknown_is_refused(monkeypatch):
    """A renamed event would leave every count at 0 and "no compiles" passing for nothing."""
    monkeypatch.setattr(compiles, "_installed", False)
    monkeypatch.setattr(compiles, "_events", compiles._events)  # restored by undo
    # JAX still reports its own event; the counter listens for a name it no longer uses.
    monkeypatch.setattr(compiles, "_event_names", lambda: frozenset({"/jax/renamed/compile"}))
    with pytest.raises(RuntimeError, match="backend_compile_duration"):
        compiles.install()
    assert not compiles._installed
    monkeypatch.undo()  # the real install again, listening to the real event
    compiles.install()
    serving = compiles.serving()
    _compile_something(8)
    assert compiles.serving() == serving + 1
