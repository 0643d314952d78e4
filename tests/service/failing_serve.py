"""`jaxserve serve` with a fault armed in the device step, for tests/service/test_engine_failure.py.

    python -m tests.service.failing_serve TRIGGER_FILE [serve flags...]

Once TRIGGER_FILE exists, every `ModelRunner.execute` raises, as a device failure would: the
engine thread dies mid-serving. The product has no such switch; it is patched in here.
"""

from __future__ import annotations

import os
import sys

from jaxserve.cli import main
from jaxserve.runtime.model_runner import ModelRunner

FAULT = "injected device failure"


def _arm(trigger: str) -> None:
    real = ModelRunner.execute

    def execute(self, *args, **kwargs):
        if os.path.exists(trigger):
            raise RuntimeError(FAULT)
        return real(self, *args, **kwargs)

    ModelRunner.execute = execute


if __name__ == "__main__":
    _arm(sys.argv[1])
    sys.exit(main(["serve", *sys.argv[2:]]))
