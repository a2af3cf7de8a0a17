"""Calls that are ready on one turn of an event loop, handed over together: a group
commit. The SQLite ledger writes a group in one transaction, the Redis state sends it in
one pipeline.

The first call of a turn schedules the hand-over as a loop callback, so every task ready
on that turn runs first and may join, and no caller's cancellation can leave the others
waiting. Each call waits on a future of its own for its own result (`settle`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Pending(Generic[T]):
    """One call waiting for its group: what to do, and the future its caller awaits."""

    __slots__ = ("future", "item")

    def __init__(self, item: T, future: asyncio.Future[Any]) -> None:
        self.item = item
        self.future = future


class Failed:
    """A call's exception, in its group's list of results."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Group(Generic[T]):
    """One event loop's calls waiting to be handed over (to `hand_over`, all at once)."""

    __slots__ = ("_hand_over", "loop", "waiting")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, hand_over: Callable[[list[Pending[T]]], None]
    ) -> None:
        self.loop = loop
        self.waiting: list[Pending[T]] = []
        self._hand_over = hand_over

    def join(self, item: T) -> asyncio.Future[Any]:
        """The future of `item`'s result; the group is handed over on the next turn."""
        future: asyncio.Future[Any] = self.loop.create_future()
        if not self.waiting:
            self.loop.call_soon(self._flush)
        self.waiting.append(Pending(item, future))
        return future

    def _flush(self) -> None:
        calls, self.waiting = self.waiting, []
        self._hand_over(calls)


def settle(calls: Sequence[Pending[Any]], results: Sequence[object]) -> None:
    """Each call's result (a `Failed`: its exception). A call whose caller was cancelled
    is skipped: what was done for it stands."""
    for call, result in zip(calls, results, strict=True):
        if call.future.done():
            continue
        if isinstance(result, Failed):
            call.future.set_exception(result.exc)
        else:
            call.future.set_result(result)


def fail(calls: Sequence[Pending[Any]], exc: BaseException) -> None:
    """Every call of the group fails with `exc`."""
    settle(calls, [Failed(exc)] * len(calls))
