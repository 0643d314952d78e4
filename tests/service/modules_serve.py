"""`jaxserve serve` that says, as it exits, which OpenTelemetry modules it loaded, for
tests/service/test_tracing.py (tracing off: none beyond what FastAPI imports by itself).

    python -m tests.service.modules_serve serve [serve flags...]

After the server has drained (SIGTERM), one JSON line on stdout: the `opentelemetry*` modules
in sys.modules, and the global tracer provider's type if the API was loaded at all.
"""

from __future__ import annotations

import json
import sys

from jaxserve.cli import main

if __name__ == "__main__":
    status = main(sys.argv[1:])
    modules = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
    provider = None
    if "opentelemetry.trace" in sys.modules:
        provider = type(sys.modules["opentelemetry.trace"].get_tracer_provider()).__name__
    print(json.dumps({"modules": modules, "tracer_provider": provider}), flush=True)
    sys.exit(status)
