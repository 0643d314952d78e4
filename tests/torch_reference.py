"""PyTorch, the parity reference, is optional: tests that need it call `require_torch()`.

The test extra installs torch only on Python 3.11, where the build machines keep a CPU wheel of
torch 2.13.0; for Python 3.12 and later PyPI has only CUDA builds of torch for x86-64 Linux
(several GB with their nvidia-* wheels). Without torch, the tests that need it (transformers'
forward or `generate` as the reference, or a tiny model built with transformers to load) skip and
the rest run; CI runs them on its Python 3.11 side, where JAXSERVE_REQUIRE_TORCH=1 makes a
missing torch fail instead of skip (.ci/run).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

NO_TORCH = (
    "torch (the parity reference) is not installed: the test extra installs it on Python 3.11 "
    "only, where a CPU wheel exists (PyPI's torch for Python 3.12+ is a CUDA build of several GB)"
)


def have_torch() -> bool:
    """Whether torch is installed (always True with JAXSERVE_REQUIRE_TORCH=1, or it fails)."""
    if os.environ.get("JAXSERVE_REQUIRE_TORCH") == "1":
        import torch  # noqa: F401

        return True
    return importlib.util.find_spec("torch") is not None


def require_torch():
    """The torch module, or a skip of the calling test (a failure with JAXSERVE_REQUIRE_TORCH=1)."""
    if os.environ.get("JAXSERVE_REQUIRE_TORCH") == "1":
        import torch

        return torch
    return pytest.importorskip("torch", reason=NO_TORCH)


def require_peft():
    """peft (the LoRA parity reference, which needs torch), as `require_torch` treats torch."""
    require_torch()
    if os.environ.get("JAXSERVE_REQUIRE_TORCH") == "1":
        import peft

        return peft
    return pytest.importorskip("peft", reason="peft needs torch: " + NO_TORCH)


def require_compressed_tensors():
    """compressed-tensors (the writer and reader of pre-quantized W8A8 checkpoints in
    tests/models/test_prequantized.py; it needs torch), as `require_torch` treats torch."""
    require_torch()
    if os.environ.get("JAXSERVE_REQUIRE_TORCH") == "1":
        import compressed_tensors

        return compressed_tensors
    return pytest.importorskip(
        "compressed_tensors", reason="compressed-tensors needs torch: " + NO_TORCH
    )
