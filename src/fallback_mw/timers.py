"""Coarse timers for the request path: deadlines that almost never fire.

Every request arms several: the body read's (the walk deadline, or the caller's idle gap),
each attempt's (what is left of the walk deadline), the upstream's first-byte timer, and
the start of the disconnect watcher. Nearly all are cancelled long before they are due,
yet a timer of the event loop costs its creation and its cancellation either way (on
uvloop, `call_at` and `cancel` are about 2 µs; an `asyncio.timeout` scope about 5 µs).

A `Wheel` (one per event loop) keeps them in buckets of `TICK` seconds instead: adding
and removing one is a dict operation, and the loop holds one timer for the earliest
bucket. A timer fires in the first bucket at or after its time: up to `TICK` late, never
early. `Deadline` is `asyncio.timeout_at` on it: the same `TimeoutError` and the same
cancellation rules as `asyncio.Timeout`, whose states it keeps.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import sys
import threading
import time
import types
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final

# `time.monotonic`, for the modules that read it on every request: compiled, a call of
# `time.monotonic()` looks the function up on the `time` module first (a generic attribute
# look-up, some 250 instructions), a `Final` name imported from here does not.
monotonic: Final = time.monotonic
_running_loop: Final = asyncio.get_running_loop  # the same, for each `Deadline` entered

TICK: Final = 0.005  # seconds: how late a timer may fire
_PER_SECOND: Final = 1 / TICK

Callback = Callable[[], object]


class Wheel:
    """Timers of one event loop, in buckets of TICK seconds, with one loop timer for the
    earliest bucket."""

    __slots__ = ("_armed", "_buckets", "_handle", "_heap", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._buckets: dict[int, dict[Callback, None]] = {}
        self._heap: list[int] = []  # bucket keys; a key whose bucket emptied is stale
        self._handle: asyncio.TimerHandle | None = None
        self._armed = math.inf  # the bucket the loop timer fires for (a float: inf for none)

    def add(self, when: float, callback: Callback) -> int:
        """Call `callback` once the loop's time passes `when` (in the first bucket at or
        after it). Returns the key `discard` needs. One callback object per timer: a bound
        method of the object that owns the timer does."""
        key = math.ceil(when * _PER_SECOND)
        if key * TICK < when:  # never early, float rounding included
            key += 1
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = {}
            heap = self._heap
            heapq.heappush(heap, key)
            if len(heap) > 2 * len(self._buckets) + 64:  # stale keys: keep the heap small
                self._heap = heap = list(self._buckets)
                heapq.heapify(heap)
            if key < self._armed:
                self._arm(key)
        bucket[callback] = None
        return key

    def discard(self, key: int, callback: Callback) -> None:
        """Cancel a timer that has not fired (nothing, if it has)."""
        bucket = self._buckets.get(key)
        if bucket is not None and callback in bucket:
            del bucket[callback]
            if not bucket:
                del self._buckets[key]

    def pending(self) -> int:
        """How many timers wait (for tests and the curious)."""
        return sum(len(bucket) for bucket in self._buckets.values())

    def _arm(self, key: int) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed = float(key)  # one type for the attribute (mypyc: an int is no float)
        self._handle = self.loop.call_at(key * TICK, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._armed = math.inf
        now = self.loop.time()
        heap, buckets = self._heap, self._buckets
        due: list[Callback] = []
        while heap and heap[0] * TICK <= now:  # the same float as the bucket's time: never early
            bucket = buckets.pop(heapq.heappop(heap), None)
            if bucket:
                due.extend(bucket)
        while heap and heap[0] not in buckets:
            heapq.heappop(heap)
        if heap:
            self._arm(heap[0])  # before the callbacks: one may add a timer
        for callback in due:
            try:
                callback()
            except Exception as exc:  # as the loop treats a failing callback of its own
                self.loop.call_exception_handler(
                    {"message": "fallback_mw timer callback failed", "exception": exc}
                )


# Each event loop's wheel, as the loop's own timers are the loop's: the one asked for last
# without a lock (a request asks several times), the rest under it.
_last: tuple[asyncio.AbstractEventLoop, Wheel] | None = None
_wheels: dict[asyncio.AbstractEventLoop, Wheel] = {}
_lock = threading.Lock()


def wheel(loop: asyncio.AbstractEventLoop | None = None) -> Wheel:
    """The wheel of `loop` (default: the running loop), made on first use; a closed
    loop's is dropped when a new loop asks."""
    global _last
    if loop is None:
        loop = asyncio.get_running_loop()
    last = _last
    if last is not None and last[0] is loop:
        return last[1]
    with _lock:  # loops in other threads ask too
        found = _wheels.get(loop)
        if found is None:
            for closed in [known for known in _wheels if known.is_closed()]:
                del _wheels[closed]
            found = _wheels[loop] = Wheel(loop)
    _last = (loop, found)
    return found


def _tasks_by_loop() -> dict[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None:
    """What `asyncio.current_task(loop)` reads on CPython 3.11, where it is a Python function
    (a frame per call, some five calls a request: each `Deadline` entered, the walk's own
    task): `_current_tasks.get(loop)`, the dict the C `_asyncio` module keeps. None where
    it is not so (3.12 on: `current_task` is C itself, and it is asked)."""
    found = getattr(asyncio.tasks, "_current_tasks", None)
    if (
        sys.version_info < (3, 12)
        and isinstance(asyncio.current_task, types.FunctionType)
        and isinstance(found, dict)
    ):
        return found
    return None


_TASKS: Final = _tasks_by_loop()


def current_task(loop: asyncio.AbstractEventLoop) -> asyncio.Task[Any] | None:
    """`asyncio.current_task(loop)`, without its Python frame on 3.11 (`_tasks_by_loop`)."""
    tasks = _TASKS
    return tasks.get(loop) if tasks is not None else asyncio.current_task(loop)


# Deadline's states, as asyncio.Timeout's.
# Final (as every constant a compiled module reads per request): compiled (mypyc), a name
# that is not is looked up in the module's dictionary at each use; these are literals.
_CREATED: Final = 0
_ENTERED: Final = 1
_EXPIRING: Final = 2
_EXPIRED: Final = 3
_EXITED: Final = 4


class Deadline:
    """`with Deadline(when) as scope:`, inside a task, is `asyncio.timeout_at(when)` on
    the wheel (a plain `with`: nothing here awaits, so no coroutines to enter and exit):
    once the loop's time passes `when` (up to TICK later) the block's task is cancelled
    and the scope raises `TimeoutError` in its place; a cancellation that is not the
    scope's own passes through untouched (the same `Task.cancelling` / `uncancel` rule as
    asyncio.Timeout). `when` None: no deadline until `reschedule`. A deadline already
    passed on entry, or rescheduled into the past, expires on the loop's next iteration,
    as asyncio's does. `deadline_after(seconds)` is `asyncio.timeout(seconds)`."""

    __slots__ = ("_cancelling", "_delay", "_handle", "_key", "_state", "_task", "_wheel", "_when")

    def __init__(self, when: float | None) -> None:
        self._when = when
        self._delay: float | None = None
        self._state = _CREATED
        self._key: int | None = None
        self._handle: asyncio.Handle | None = None

    def __enter__(self) -> Deadline:
        if self._state != _CREATED:
            raise RuntimeError("Deadline has already been entered")
        loop = _running_loop()
        tasks = _TASKS  # `current_task`, written out: one call fewer per scope
        task = tasks.get(loop) if tasks is not None else asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("Deadline should be used inside a task")
        self._state = _ENTERED
        self._task = task
        self._cancelling = task.cancelling()
        # The wheel and the arming written out here (`wheel`, `_arm`): every request
        # enters several of these scopes, and each call costs more than what it does.
        last = _last
        found = self._wheel = last[1] if last is not None and last[0] is loop else wheel(loop)
        if self._delay is None:
            when = self._when
            if when is None:
                return self
            now = loop.time()
        else:
            now = loop.time()  # one read of the clock: `when` is compared with it
            when = now + self._delay
        if when <= now:
            self._handle = loop.call_soon(self._expire)
        else:
            self._key = found.add(when, self._expire)
        return self

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        key = self._key
        if key is not None:  # `_disarm`, written out (the usual case: a timer that waits)
            self._wheel.discard(key, self._expire)
            self._key = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._state == _EXPIRING:
            self._state = _EXPIRED
            if self._task.uncancel() <= self._cancelling and typ is asyncio.CancelledError:
                raise TimeoutError from exc  # ours: the deadline passed
        elif self._state == _ENTERED:
            self._state = _EXITED

    def reschedule(self, when: float | None) -> None:
        """Move the deadline (None: none)."""
        if self._state != _ENTERED:
            raise RuntimeError("Deadline is not active: it cannot be rescheduled")
        self._disarm()
        self._arm(when)

    def expired(self) -> bool:
        return self._state in (_EXPIRING, _EXPIRED)

    def active(self) -> bool:
        """Entered, not exited and not expired: `reschedule` may move it."""
        return self._state == _ENTERED

    def _arm(self, when: float | None) -> None:
        if when is None:
            return
        wheel = self._wheel
        if when <= wheel.loop.time():
            self._handle = wheel.loop.call_soon(self._expire)
        else:
            self._key = wheel.add(when, self._expire)

    def _disarm(self) -> None:
        if self._key is not None:
            self._wheel.discard(self._key, self._expire)
            self._key = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _expire(self) -> None:
        self._key = self._handle = None
        if self._state == _ENTERED:
            self._task.cancel()
            self._state = _EXPIRING


class Stall:
    """`with Stall(seconds) as stall:` around a relay that waits on its client: each wait
    is `stall.waiting()` ... `stall.done()`, and one wait that lasts `seconds` cancels the
    block's task, which the scope turns into `TimeoutError` (a `Deadline` underneath, so
    the same cancellation rules). Checked once every `seconds` by one wheel timer, not a
    timer per wait: a stuck wait is cut between `seconds` and twice that after it began;
    each wait costs two attribute writes."""

    __slots__ = ("_count", "_deadline", "_key", "_seconds", "_seen", "_waiting", "_wheel")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._deadline = Deadline(None)
        self._count = 0  # waits begun
        self._seen = -1  # the wait in progress at the last check
        self._waiting = False
        self._key: int | None = None

    def __enter__(self) -> Stall:
        self._deadline.__enter__()
        self._wheel = self._deadline._wheel
        self._key = self._wheel.add(self._wheel.loop.time() + self._seconds, self._check)
        return self

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._key is not None:
            self._wheel.discard(self._key, self._check)
            self._key = None
        self._deadline.__exit__(typ, exc, tb)

    def waiting(self) -> None:
        self._count += 1
        self._waiting = True

    def done(self) -> None:
        self._waiting = False

    def in_wait(self) -> bool:
        """Whether a wait is in progress (begun, not done)."""
        return self._waiting

    def expired(self) -> bool:
        return self._deadline.expired()

    def _check(self) -> None:
        self._key = None
        if not self._deadline.active():
            return
        now = self._wheel.loop.time()
        if self._waiting and self._count == self._seen:  # the same wait as a check ago
            self._deadline.reschedule(now)  # expires on the next iteration
            return
        self._seen = self._count if self._waiting else -1
        self._key = self._wheel.add(now + self._seconds, self._check)


def deadline_after(seconds: float) -> Deadline:
    """`with deadline_after(s):` like `asyncio.timeout(s)`, on the wheel."""
    deadline = Deadline(None)
    deadline._delay = seconds  # from the moment the scope is entered, as asyncio's
    return deadline
