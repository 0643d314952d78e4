"""`python -m jaxserve.cli ...`: the `jaxserve` command."""

from __future__ import annotations

import sys

from jaxserve.cli import main

sys.exit(main())
