"""The streamed request body as an engine sends it, timed by the upstream's first-byte
timer (upstream/base.py FirstByteTimer.timed_body)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol


class FirstByteTimer(Protocol):
    """What the body asks of its timer (upstream/base.py FirstByteTimer), named here so
    that this module imports nothing back from base.py."""

    def pause(self) -> None: ...

    def arm(self) -> None: ...


class TimedBody:
    """`FirstByteTimer.timed_body`: an async iterator class, not an async generator, so
    this module compiles with mypyc (scripts/compile.py). Paused when the next chunk is
    asked for, armed when one is handed on and at the end; once ended or raised, it
    ends for good, as a generator does."""

    __slots__ = ("_ended", "_given", "_source", "_timer")

    def __init__(self, timer: FirstByteTimer, source: AsyncIterator[bytes]) -> None:
        self._timer = timer
        self._source = source.__aiter__()
        self._given = self._ended = False

    def __aiter__(self) -> TimedBody:
        return self

    async def __anext__(self) -> bytes:
        if self._ended:
            raise StopAsyncIteration
        timer = self._timer
        if self._given:
            timer.pause()  # the upstream took the last chunk: the caller's time again
        try:
            chunk = await self._source.__anext__()
        except StopAsyncIteration:
            self._ended = True
            timer.arm()  # the body is sent: the upstream's first byte is timed
            raise
        except BaseException:
            self._ended = True
            raise
        self._given = True
        timer.arm()
        return chunk

    async def aclose(self) -> None:
        self._ended = True
