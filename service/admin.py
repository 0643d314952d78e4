"""The operator's calls, for an RL trainer in another process (docs/rl.md), shared by both front
ends: new weights from a folder on disk, and the engine's memory given back and taken again.

HTTP serves them as sglang's POST /update_weights_from_disk and vLLM's POST /sleep, POST
/wake_up, GET /is_sleeping (http/admin.py); gRPC as the jaxserve.v1.Admin service
(grpc/servicer.py). Both only with --allow-weight-updates and behind the bearer token. Each
front end parses its request, calls one function here and translates the answer; the checks,
their messages and the engine calls are these, so both fronts say the same sentences.

Each is one AsyncEngine call (async_engine.py): the folder is read off the engine thread, then
the engine drains (requests sent before finish on the old weights, those sent after wait for the
new), and swaps or sleeps between two steps. A folder that cannot be read, or of another model,
is an InvalidRequest (HTTP 400, gRPC INVALID_ARGUMENT) naming the path and the reason; requests
sent while asleep get the engine's EngineAsleep (HTTP 503, gRPC UNAVAILABLE).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING

from service.logs import log
from service.validation import InvalidRequest

if TYPE_CHECKING:
    from jaxserve.engine.async_engine import AsyncEngine
    from service.lifecycle import Lifecycle

logger = logging.getLogger("jaxserve.server")

SLEEP_LEVELS = (1, 2)


@dataclasses.dataclass(frozen=True)
class WeightsUpdated:
    """What update_weights_from_disk answers."""

    message: str
    weights_version: int
    seconds: float


def engine_of(lifecycle: Lifecycle) -> AsyncEngine:
    """The server's engine; before warm-up has built one (or after it failed), the lifecycle's
    refusal (UNAVAILABLE, 503) for the calls that are not admitted (wake-up, is-sleeping)."""
    if lifecycle.engine is None:
        lifecycle.admit()  # raises: warming up, or warm-up failed
    return lifecycle.engine


async def update_weights_from_disk(
    lifecycle: Lifecycle, model_path: str, load_format: str | None = None, fields=None
) -> WeightsUpdated:
    """Serves the weights of the folder `model_path` from the next step on; `fields` (the
    call's log fields) gains the path and the new version."""
    fields = {} if fields is None else fields
    fields.update(model_path=model_path)
    if load_format not in (None, "", "auto"):
        raise InvalidRequest(
            f"load_format={load_format!r} is not supported: the format (Hugging Face "
            "safetensors or orbax) is read from the folder; send 'auto' or leave it out.",
            "load_format",
        )
    path = os.path.expanduser(model_path)
    if not os.path.isdir(path):
        raise InvalidRequest(
            f"model_path={model_path!r} is not a folder on the server "
            f"({'a file' if os.path.exists(path) else 'no such path'}); send the folder of "
            "a Hugging Face safetensors or orbax checkpoint of the served model.",
            "model_path",
        )
    start = time.perf_counter()
    try:
        version = await engine_of(lifecycle).update_weights(path)
    except ValueError as e:  # unreadable, another model, shapes that differ
        raise InvalidRequest(
            f"Cannot serve the weights of model_path={model_path!r}: {e}", "model_path"
        ) from None
    seconds = round(time.perf_counter() - start, 3)
    fields.update(weights_version=version)
    log(logger, logging.INFO, "weights updated", path=path, version=version, seconds=seconds)
    return WeightsUpdated(
        message=f"Serving the weights of {model_path} (version {version}).",
        weights_version=version,
        seconds=seconds,
    )


def check_sleep_level(level) -> int:
    """The sleep level a request sent (HTTP's query text or gRPC's int), as 1 or 2."""
    if level not in SLEEP_LEVELS and level not in tuple(map(str, SLEEP_LEVELS)):
        raise InvalidRequest(
            f"level={level!r} must be 1 (free the KV pool) or 2 (the weights too).", "level"
        )
    return int(level)


async def sleep(lifecycle: Lifecycle, level: int) -> int:
    """Drains, then frees the KV pool (level 2: the weights too); returns the bytes freed.
    Refused when asleep already: waking first says which level to keep."""
    engine = engine_of(lifecycle)
    if engine.is_sleeping:
        raise InvalidRequest(
            "The engine is asleep already; wake it up first (HTTP POST /wake_up, gRPC "
            "jaxserve.v1.Admin/WakeUp).",
            "level",
        )
    return await engine.sleep(level)


async def wake_up(lifecycle: Lifecycle) -> None:
    """Allocates what `sleep` freed; serving resumes with no compile. A no-op when awake, so a
    retry is harmless."""
    engine = engine_of(lifecycle)
    if engine.is_sleeping:
        await engine.wake_up()


def is_sleeping(lifecycle: Lifecycle) -> bool:
    return engine_of(lifecycle).is_sleeping
