"""The streamed bodies on the request path are async iterator classes, not async generators
(mypyc refuses those: scripts/compile.py), and keep a generator's rules: each ends for good
once it has ended or raised, and the engine's timed body pauses and arms the first-byte
timer where the generator did. These run whichever build is in place."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from fallback_mw.upstream.base import FirstByteTimer

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Source:
    """Chunks handed out one by one, then an end or an error."""

    def __init__(self, chunks: list[bytes], error: Exception | None = None) -> None:
        self.chunks = chunks
        self.error = error
        self.asked = 0

    def __aiter__(self) -> Source:
        return self

    async def __anext__(self) -> bytes:
        self.asked += 1
        if self.chunks:
            return self.chunks.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration


async def _all(chunks: AsyncIterator[bytes]) -> list[bytes]:
    return [chunk async for chunk in chunks]


async def test_a_timed_body_hands_on_every_chunk_then_ends_for_good() -> None:
    source = Source([b"a", b"b"])
    timed = FirstByteTimer(1.0).timed_body(source)
    assert await _all(timed) == [b"a", b"b"]
    with pytest.raises(StopAsyncIteration):
        await anext(timed)
    assert source.asked == 3  # never asked again once it ended


async def test_a_timed_body_whose_source_raised_ends_for_good() -> None:
    source = Source([b"a"], ValueError("the caller's body failed"))
    timed = FirstByteTimer(1.0).timed_body(source)
    assert await anext(timed) == b"a"
    with pytest.raises(ValueError, match="caller's body failed"):
        await anext(timed)
    with pytest.raises(StopAsyncIteration):
        await anext(timed)
    assert source.asked == 2


async def test_a_timed_body_times_the_upstream_only_while_it_holds_a_chunk() -> None:
    """Armed when a chunk is handed on and once the body has ended; paused while the
    caller's next chunk is awaited (SPEC §12: the upload is the caller's time)."""
    timer = FirstByteTimer(30.0)
    seen: list[bool] = []

    class Watched(Source):
        async def __anext__(self) -> bytes:
            seen.append(timer._key is not None)  # armed while the caller's chunk is awaited?
            return await super().__anext__()

    with timer.running():
        timed = timer.timed_body(Watched([b"a", b"b"]))
        assert await anext(timed) == b"a"
        assert timer._key is not None  # the upstream has a chunk: its time
        assert await anext(timed) == b"b"
        with pytest.raises(StopAsyncIteration):
            await anext(timed)
        assert timer._key is not None  # the body is sent: the first byte is timed
    assert seen == [False, False, False]


async def test_the_body_iterators_are_not_async_generators() -> None:
    """What lets their modules compile: no `yield` in an `async def` (the hazard check
    refuses one in a listed module)."""
    timed = FirstByteTimer(1.0).timed_body(Source([]))
    assert not hasattr(timed, "ag_frame")
    assert await _all(timed) == []
    await asyncio.sleep(0)
