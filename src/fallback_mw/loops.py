"""Pools made on one event loop and met again from another (Starlette's TestClient without
`with` runs each request on a new loop and closes the last): their connections belong to
the old loop and are closed there, never from this one."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any


def close_on_its_loop(
    loop: asyncio.AbstractEventLoop | None, close: Callable[[], Coroutine[Any, Any, Any]]
) -> bool:
    """Run `close()` on `loop` (another loop than the running one) while that loop runs.
    False when it has closed: nothing can close those connections any more (the garbage
    collector drops them); the coroutine is then closed unawaited, never left behind."""
    if loop is None or loop.is_closed():
        return False
    work = close()
    try:
        asyncio.run_coroutine_threadsafe(work, loop)
    except RuntimeError:  # it closed meanwhile
        work.close()
        return False
    return True


class CloseAtLoopEnd:
    """Runs `close()` on the running loop as that loop ends. A loop that asyncio.run,
    anyio.run or Starlette's TestClient ran (a new one per request without `with`, and no
    lifespan) closes every async generator still suspended on it before it closes: this
    one's `finally` closes the pool there, while the loop runs, instead of leaving its
    sockets to the garbage collector (a ResourceWarning each, an error under `-W error`).
    Made once per pool and loop, never per request. Its owner keeps it as long as the pool
    lives: `aclose()` closes the pool now, `forget()` when the owner closes it another way;
    one dropped before its loop ended closes the pool on that loop if it still runs."""

    __slots__ = ("_generator", "_wanted")

    def __init__(self, close: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        loop = asyncio.get_running_loop()
        self._wanted = True
        owner = self

        async def until_the_loop_ends() -> AsyncGenerator[None]:
            try:
                yield
            finally:
                if owner._wanted:
                    owner._wanted = False
                    await close()

        def dropped(generator: AsyncGenerator[None]) -> None:
            if owner._wanted:
                close_on_its_loop(loop, generator.aclose)

        self._generator = until_the_loop_ends()
        # Started here, to its `yield`, without awaiting anything: the loop's own first-
        # iteration hook registers it for the loop's end. The finaliser is ours: the loop's
        # would raise for a loop closed without ending its generators.
        firstiter, finalizer = sys.get_asyncgen_hooks()
        sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=dropped)
        try:
            self._generator.asend(None).send(None)
        except StopIteration:
            pass
        finally:
            sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=finalizer)

    async def aclose(self) -> None:
        """Close the pool now (on its loop), once."""
        await self._generator.aclose()

    def forget(self) -> None:
        """The owner closes the pool itself: nothing runs at the loop's end."""
        self._wanted = False
