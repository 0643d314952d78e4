"""The whole suite runs on the CPU: libtpu and the CUDA plugin, when installed for ahead-of-time
compiles, must never try a chip in a CPU run (libtpu's probe adds seconds to every process).
Subprocesses inherit it. The GPU machine's native kernel run (pallas_kernels/gpu_check.py sets
JAXSERVE_GPU_NATIVE) keeps its own platform."""

import os

if not os.environ.get("JAXSERVE_GPU_NATIVE"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
