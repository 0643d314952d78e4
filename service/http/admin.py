"""The operator's routes of the HTTP API, for an RL trainer in another process (docs/rl.md):
new weights from a folder, and the engine's memory given back and taken again.

Served only with `jaxserve serve --allow-weight-updates` (otherwise 404, as any unknown route)
and, like every route, behind the bearer token when one is configured (401 without it); the
server refuses the flag without a token unless it listens on the loopback only. Names and bodies
are those trainers already speak: sglang's POST /update_weights_from_disk {"model_path"}, vLLM's
POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping.

Each only translates to the AsyncEngine (async_engine.py): the folder is read off the engine
thread, then the engine drains (requests sent before finish on the old weights, those sent after
wait for the new), and swaps or sleeps between two steps. A folder that cannot be read, or of
another model, is a 400 naming the path and the reason; requests sent while asleep get 503.
"""

from __future__ import annotations

import logging
import os
import time

from fastapi import Request

from service.http import protocol
from service.http.serving import OpenAIServing
from service.lifecycle import Lifecycle
from service.logs import log
from service.validation import InvalidRequest

ROUTES = ("/update_weights_from_disk", "/sleep", "/wake_up", "/is_sleeping")


class AdminRoutes:
    """The handlers of ROUTES over one server's lifecycle (its engine once warm)."""

    def __init__(self, lifecycle: Lifecycle, serving: OpenAIServing, logger):
        self.lifecycle = lifecycle
        self.serving = serving
        self.logger = logger

    async def update_weights(self, request: Request, fields: dict) -> dict:
        """POST /update_weights_from_disk: serves the folder's weights from the next step on."""
        body = await self.serving.parse(request, protocol.UpdateWeightsFromDiskRequest)
        fields.update(model_path=body.model_path)
        if body.load_format not in (None, "auto"):
            raise InvalidRequest(
                f"load_format={body.load_format!r} is not supported: the format (Hugging Face "
                "safetensors or orbax) is read from the folder; send 'auto' or leave it out.",
                "load_format",
            )
        path = os.path.expanduser(body.model_path)
        if not os.path.isdir(path):
            raise InvalidRequest(
                f"model_path={body.model_path!r} is not a folder on the server "
                f"({'a file' if os.path.exists(path) else 'no such path'}); send the folder of "
                "a Hugging Face safetensors or orbax checkpoint of the served model.",
                "model_path",
            )
        start = time.perf_counter()
        try:
            version = await self.serving.engine.update_weights(path)
        except ValueError as e:  # unreadable, another model, shapes that differ
            raise InvalidRequest(
                f"Cannot serve the weights of model_path={body.model_path!r}: {e}", "model_path"
            ) from None
        seconds = round(time.perf_counter() - start, 3)
        fields.update(weights_version=version)
        log(
            self.logger,
            logging.INFO,
            "weights updated",
            path=path,
            version=version,
            seconds=seconds,
        )
        return {
            "success": True,
            "message": f"Serving the weights of {body.model_path} (version {version}).",
            "weights_version": version,
            "seconds": seconds,
        }

    async def sleep(self, request: Request, fields: dict) -> dict:
        """POST /sleep?level=1|2: drains, then frees the KV pool (2: the weights too)."""
        raw = request.query_params.get("level", "1")
        if raw not in ("1", "2"):
            raise InvalidRequest(
                f"level={raw!r} must be 1 (free the KV pool) or 2 (the weights too).", "level"
            )
        fields.update(sleep_level=int(raw))
        engine = self.serving.engine
        if engine.is_sleeping:
            raise InvalidRequest("The engine is asleep already; POST /wake_up first.", "level")
        freed = await engine.sleep(int(raw))
        return {"is_sleeping": True, "level": int(raw), "freed_bytes": freed}

    async def wake_up(self, request: Request, fields: dict) -> dict:
        """POST /wake_up: allocates what /sleep freed; serving resumes with no compile."""
        engine = self.serving.engine
        if engine.is_sleeping:  # awake already: nothing to do (so a retry is harmless)
            await engine.wake_up()
        return {"is_sleeping": False}

    async def is_sleeping(self, request: Request, fields: dict) -> dict:
        """GET /is_sleeping (vLLM's)."""
        return {"is_sleeping": self.serving.engine.is_sleeping}
