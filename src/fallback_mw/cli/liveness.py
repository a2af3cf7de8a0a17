"""Liveness of `serve --workers N`, both ways: a worker dies with its supervisor
(`die_with`), however the supervisor dies; the supervisor tells a hung worker from a busy
one by its heartbeats (`Heartbeats`). A worker whose event loop stops running (a
deadlock, a C call that never returns, a process stopped by SIGSTOP) keeps its listening
socket, and the kernel keeps handing it its share of new connections, which then wait
forever; it does not die, so watching for deaths alone never noticed it.

Each worker's event loop writes the time (CLOCK_MONOTONIC, one clock for every process of
the machine) into its slot of a page shared with the supervisor, once a second, from the
moment it serves until its loop ends; the supervisor kills (SIGKILL) a worker whose slot
is older than the timeout, and replaces it as any worker that dies. A slot at 0 is not
watched: a worker starting, or one whose loop has ended (its last flushes run outside
it)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
import signal
import struct
import time

BEAT_SECONDS = 1.0
_SLOT = struct.Struct("d")

_PR_SET_PDEATHSIG = 1


def die_with(supervisor: int) -> None:
    """In a worker: SIGTERM when the supervisor dies, however it dies (SIGKILL, an unhandled
    signal), so that no worker goes on serving unsupervised, never replaced, never stopped
    by a later `serve`'s operator. Linux's PR_SET_PDEATHSIG; elsewhere nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            return
    except (OSError, AttributeError):  # not Linux: no such call
        return
    if os.getppid() != supervisor:  # it died between the fork and the prctl
        os.kill(os.getpid(), signal.SIGTERM)


class Heartbeats:
    """One slot per worker place, shared across the fork (anonymous MAP_SHARED)."""

    def __init__(self, count: int) -> None:
        self._page = mmap.mmap(-1, max(1, count) * _SLOT.size)
        self._tasks: set[asyncio.Task[None]] = set()

    def clear(self, slot: int) -> None:
        _SLOT.pack_into(self._page, slot * _SLOT.size, 0.0)

    def silent_for(self, slot: int, now: float) -> float:
        """Seconds since the slot's last beat; 0 when it is not watched."""
        (last,) = _SLOT.unpack_from(self._page, slot * _SLOT.size)
        return 0.0 if last == 0.0 else now - last

    def hung(self, slots: dict[int, int], timeout: float) -> list[int]:
        """The pids (of `slots`: pid -> slot) whose loop has been silent `timeout` s."""
        now = time.monotonic()
        return [pid for pid, slot in slots.items() if self.silent_for(slot, now) >= timeout]

    def start(self, slot: int) -> None:
        """In a worker, from its event loop: beat until the loop ends. Without a running
        loop (a worker that is no asyncio server) nothing: the slot stays unwatched."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self._beat(slot), name="fallback-mw heartbeat")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _beat(self, slot: int) -> None:
        try:
            while True:
                _SLOT.pack_into(self._page, slot * _SLOT.size, time.monotonic())
                await asyncio.sleep(BEAT_SECONDS)
        finally:  # the loop ends (its tasks cancelled): what follows is not the loop's
            with contextlib.suppress(ValueError):
                self.clear(slot)

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self._page.close()
