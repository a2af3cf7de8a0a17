"""The disconnect watcher: once the body is read, the walk is the only reader left."""

from __future__ import annotations

import asyncio
from typing import Any

from fallback_mw.request.context import RequestBody, RequestContext
from fallback_mw.request.types import Receive


async def watch_disconnect(
    receive: Receive, body: RequestBody, context: RequestContext, walk_task: asyncio.Task[Any]
) -> None:
    """Once the body is read, the walk is the only reader left: a disconnect cancels the
    attempt in flight (walk_task) and starts nothing new."""
    await body.done.wait()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            context.client_disconnected = True
            walk_task.cancel()
            return
