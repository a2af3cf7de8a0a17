"""The disconnect watcher: once the body is read, the walk is the only reader left."""

from __future__ import annotations

import asyncio
from typing import Any

from fallback_mw.request.context import RequestBody, RequestContext
from fallback_mw.request.types import Receive
from fallback_mw.timers import wheel


async def watch_disconnect(
    receive: Receive, body: RequestBody, context: RequestContext, walk_task: asyncio.Task[Any]
) -> None:
    """Once the body is read, the walk is the only reader left: a disconnect cancels the
    attempt in flight (walk_task) and starts nothing new."""
    if not body.done.is_set():  # read whole (the usual case): no coroutine to wait on
        await body.done.wait()
    message = await receive()
    if message["type"] != "http.disconnect":
        # After the body's last message a server's `receive` blocks until the client
        # goes (ASGI). A driver that answers at once with another message cannot say
        # when that happens; reading it in a loop never suspended and held the event
        # loop (every request of the process) for good. Nothing more is watched.
        return
    if context.completed:
        # The response is complete: servers answer `receive` with a disconnect from
        # then on (uvicorn does). Not a client gone mid-walk: the walk's work after its
        # last chunk (closing the upstream response, settling tokens) is not cancelled.
        return
    context.client_disconnected = True
    walk_task.cancel()


# How long a walk runs before its disconnect watcher starts (see PlanWalker).
WATCH_AFTER = 0.01


class DisconnectWatch:
    """`watch_disconnect` in a task started WATCH_AFTER seconds from now (on the timer
    wheel: up to timers.TICK later), unless stopped first: a task per request costs more
    CPU than the rest of a fast walk's layer."""

    __slots__ = ("_args", "_key", "_task", "_wheel")

    def __init__(
        self,
        receive: Receive,
        body: RequestBody,
        context: RequestContext,
        walk_task: asyncio.Task[Any],
    ) -> None:
        self._args = (receive, body, context, walk_task)
        self._task: asyncio.Task[None] | None = None
        self._wheel = wheel()
        self._key: int | None = self._wheel.add(self._wheel.loop.time() + WATCH_AFTER, self._start)

    def _start(self) -> None:
        self._key = None
        self._task = self._wheel.loop.create_task(watch_disconnect(*self._args))

    def stop(self) -> None:
        if self._key is not None:
            self._wheel.discard(self._key, self._start)
            self._key = None
        if self._task is not None:
            self._task.cancel()
