"""`freeze_heap`: what serving processes call once warm, so no full collection walks the heap."""

from __future__ import annotations

import subprocess
import sys

# In its own interpreter: freezing this test process would keep every later test's dropped
# engines (their reference cycles) alive for good.
_PROBE = """
import gc, weakref
from jaxserve.engine.core import freeze_heap

class Node:
    pass

garbage = Node()
garbage.me = garbage  # a cycle: only the collector frees it
dead = weakref.ref(garbage)
del garbage
alive = Node()
alive.me = alive
freeze_heap()
assert dead() is None, "garbage was frozen instead of collected"
assert not any(o is alive for o in gc.get_objects()), "a live object is still walked"
made_later = Node()
made_later.me = made_later
assert any(o is made_later for o in gc.get_objects()), "objects made later must be collectable"
print("ok")
"""


def test_freeze_heap_collects_garbage_then_freezes_what_lives():
    run = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


_FIRST_ENGINE = """
import gc
from jaxserve.engine.core import Engine
from jaxserve.engine_config import EngineConfig

class Node:
    pass

def walked(obj):
    return any(o is obj for o in gc.get_objects())

before = Node()
before.me = before
Engine(EngineConfig(show_progress=False, precompile=False))
assert not walked(before), "the first engine must freeze what it finds"
between = Node()
between.me = between
Engine(EngineConfig(show_progress=False, precompile=False))
assert walked(between), "a later engine must not freeze again"
print("ok")
"""


def test_the_first_engine_of_a_process_freezes_the_heap_and_later_ones_do_not():
    run = subprocess.run(
        [sys.executable, "-c", _FIRST_ENGINE], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
