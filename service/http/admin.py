"""The operator's routes of the HTTP API, for an RL trainer in another process (docs/rl.md):
new weights from a folder, and the engine's memory given back and taken again.

Served only with `jaxserve serve --allow-weight-updates` (otherwise 404, as any unknown route)
and, like every route, behind the bearer token when one is configured (401 without it); the
server refuses the flag without a token unless it listens on the loopback only. Names and bodies
are those trainers already speak: sglang's POST /update_weights_from_disk {"model_path"}, vLLM's
POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping.

Each parses its request and calls service/admin.py, which gRPC's jaxserve.v1.Admin calls too:
the checks, their messages and the engine calls are there. A folder that cannot be read, or of
another model, is a 400 naming the path and the reason; requests sent while asleep get 503.
"""

from __future__ import annotations

from fastapi import Request

from service import admin
from service.http import protocol
from service.http.serving import OpenAIServing
from service.lifecycle import Lifecycle

ROUTES = ("/update_weights_from_disk", "/sleep", "/wake_up", "/is_sleeping")


class AdminRoutes:
    """The handlers of ROUTES over one server's lifecycle (its engine once warm)."""

    def __init__(self, lifecycle: Lifecycle, serving: OpenAIServing):
        self.lifecycle = lifecycle
        self.serving = serving

    async def update_weights(self, request: Request, fields: dict) -> dict:
        """POST /update_weights_from_disk: serves the folder's weights from the next step on."""
        body = await self.serving.parse(request, protocol.UpdateWeightsFromDiskRequest)
        done = await admin.update_weights_from_disk(
            self.lifecycle, body.model_path, body.load_format, fields
        )
        return {
            "success": True,
            "message": done.message,
            "weights_version": done.weights_version,
            "seconds": done.seconds,
        }

    async def sleep(self, request: Request, fields: dict) -> dict:
        """POST /sleep?level=1|2: drains, then frees the KV pool (2: the weights too)."""
        level = admin.check_sleep_level(request.query_params.get("level", "1"))
        fields.update(sleep_level=level)
        freed = await admin.sleep(self.lifecycle, level)
        return {"is_sleeping": True, "level": level, "freed_bytes": freed}

    async def wake_up(self, request: Request, fields: dict) -> dict:
        """POST /wake_up: allocates what /sleep freed; serving resumes with no compile."""
        await admin.wake_up(self.lifecycle)
        return {"is_sleeping": False}

    async def is_sleeping(self, request: Request, fields: dict) -> dict:
        """GET /is_sleeping (vLLM's)."""
        return {"is_sleeping": admin.is_sleeping(self.lifecycle)}
