"""Pools made on one event loop and met again from another (Starlette's TestClient without
`with` runs each request on a new loop and closes the last): their connections belong to
the old loop and are closed there, never from this one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
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
