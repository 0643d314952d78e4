"""Runs a Python module with its main thread on core 0 and every other thread on core 1.

Behind docs/benchmarks.md, "Structured output" (13th session). On the CPU backend XLA's
worker threads compute the step on the same cores the engine thread plans the next step on,
so host work (a grammar row's mask, a verification's plan) takes compute from the step
itself. On an accelerator it does not: the host plans while the device computes. Pinning the
engine (the main thread of the benches) to one core and XLA's threads to the other makes
the CPU behave like a host beside a one-core device, which separates what host work costs
the step from what it costs on a shared CPU. It needs two cores; a thread that starts later
is pinned within 0.2 s. Run from the repository root:

    JAX_PLATFORMS=cpu PYTHONPATH=. python docs/history/pinned_host.py \\
        jaxserve.bench.structured --tpot --rows 32 --repeats 31 --max-tokens 64
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import threading
import time

HOST_CORE, DEVICE_CORE = 0, 1


def pin_forever(main_tid: int) -> None:
    """Every 0.2 s: the main thread to HOST_CORE, every other thread of the process (XLA's,
    the grammar compiler's, this one) to DEVICE_CORE."""
    while True:
        for name in os.listdir("/proc/self/task"):
            tid = int(name)
            with contextlib.suppress(OSError):  # the thread may have ended meanwhile
                os.sched_setaffinity(tid, {HOST_CORE if tid == main_tid else DEVICE_CORE})
        time.sleep(0.2)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: pinned_host.py MODULE [ARGS...]")
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("pinned_host.py needs two cores; this process may use one.")
    os.sched_setaffinity(0, {HOST_CORE})  # threads started from here on inherit it
    threading.Thread(target=pin_forever, args=(threading.get_native_id(),), daemon=True).start()
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
