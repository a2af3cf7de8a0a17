"""The disconnect watcher: once the body is read, the walk is the only reader left."""

from __future__ import annotations

import asyncio
from typing import Any, Final

from fallback_mw.request.connection_loss import ConnectionLoss
from fallback_mw.request.context import RequestBody, RequestContext
from fallback_mw.request.types import Receive
from fallback_mw.timers import Wheel, wheel


async def watch_disconnect(
    receive: Receive, body: RequestBody, context: RequestContext, walk_task: asyncio.Task[Any]
) -> None:
    """Once the body is read, the walk is the only reader left: a disconnect cancels the
    attempt in flight (walk_task) and starts nothing new."""
    if not body.finished:  # read whole (the usual case): no coroutine to wait on
        await body.wait_finished()
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
WATCH_AFTER: Final = 0.01


class DisconnectWatch:
    """`watch_disconnect` in a task started WATCH_AFTER seconds from now (on the timer
    wheel: up to timers.TICK later), unless stopped first: a task per request costs more
    CPU than the rest of a fast walk's layer. Where the server tells of the connection's
    loss itself (`loss`: serve's protocol, request/connection_loss.py), no task and no
    timer: its callback does what the task would once `receive` said `http.disconnect`,
    at once rather than after WATCH_AFTER."""

    __slots__ = ("_args", "_key", "_loss", "_task", "_wheel")

    def __init__(
        self,
        receive: Receive,
        body: RequestBody,
        context: RequestContext,
        walk_task: asyncio.Task[Any],
        loss: ConnectionLoss | None = None,
    ) -> None:
        self._args = (receive, body, context, walk_task)
        self._task: asyncio.Task[None] | None = None
        self._key: int | None = None
        self._loss = loss
        self._wheel: Wheel | None = None
        if loss is not None:
            if not loss.add(self):
                self.connection_lost()  # gone already: as the task's first `receive` finds
            return
        self._wheel = found = wheel()
        self._key = found.add(found.loop.time() + WATCH_AFTER, self._start)

    def connection_lost(self) -> None:
        """`ConnectionLoss`'s call: the connection is gone."""
        _, body, context, walk_task = self._args
        # As `watch_disconnect`: only once the body is read (a body still streaming reads
        # the disconnect itself), and not once the response is complete.
        if body.finished and not context.completed:
            context.client_disconnected = True
            walk_task.cancel()

    def _start(self) -> None:
        self._key = None
        assert self._wheel is not None
        self._task = self._wheel.loop.create_task(watch_disconnect(*self._args))

    def stop(self) -> None:
        if self._loss is not None:
            self._loss.discard(self)
            return
        if self._key is not None:
            assert self._wheel is not None
            self._wheel.discard(self._key, self._start)
            self._key = None
        if self._task is not None:
            self._task.cancel()
