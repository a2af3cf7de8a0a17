"""What a Gateway, or a layer used alone, whose configuration did not load answers, whatever
is asked: the lifespan startup fails with the problem, every request is a local 503
`config_error` naming it (logged once), a WebSocket handshake is refused. A configuration
that does not load never serves (SPEC §3), however late the host builds its middleware
(Starlette builds it at the first ASGI call, and uvicorn's default lifespan mode swallows an
exception raised there: the server started, the host's own startup never ran, and every
request was a bare 500)."""

from __future__ import annotations

import json
import logging

from fallback_mw.config import ConfigError
from fallback_mw.request.types import Receive, Scope, Send

logger = logging.getLogger("fallback_mw")


class ConfigRefusal:
    def __init__(self, error: ConfigError) -> None:
        self.problem = f"fallback_mw configuration error: {error}"
        self._logged = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan" and not self._logged:
            # Said once: by the server as the lifespan startup failure, else at the first
            # request (a host without lifespan), never per request.
            self._logged = True
            logger.error("%s; every request is answered 503 config_error", self.problem)
        await _refuse(self.problem, scope, receive, send)


async def _refuse(problem: str, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.failed", "message": problem})
                # Then end the lifespan by raising, as Starlette's router does: a server
                # stops on the message alone, but an in-process harness (Starlette's
                # TestClient) waits for the app to end it, and reports what it raised.
                raise ConfigError(problem)
            if message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    elif scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1011})
    elif scope["type"] == "http":
        body = json.dumps(
            {"error": {"type": "gateway_error", "code": "config_error", "message": problem,
                       "route": None, "attempts": 0, "rule": "config"}},
            separators=(",", ":"),
        ).encode()  # fmt: skip
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"cache-control", b"no-store"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
