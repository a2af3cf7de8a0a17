"""Capacity and repeat-allowance counts for one process (`state = "memory://"`): per upstream,
two rolling windows of one-second buckets with running totals (requests and tokens over
the minute; first attempts and repeats over the allowance's window), so an reservation costs
O(1), not a sum over the window."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Final

from fallback_mw.capacity.model import (
    CAPACITY_WINDOW,
    IMMEDIATE_CAPACITY,
    Ask,
    Refusal,
    Reservation,
    capacity_free_in,
    repeat_allowed,
    within_capacity,
)
from fallback_mw.config import RepeatAllowanceConfig


class Rolling:
    """Two counts per one-second bucket over the last `span` seconds, with their totals."""

    __slots__ = ("buckets", "index", "span", "totals")

    def __init__(self, span: int) -> None:
        self.span = span
        self.buckets: deque[tuple[int, list[int]]] = deque()
        self.index: dict[int, list[int]] = {}
        self.totals = [0, 0]

    def advance(self, now: int) -> list[int]:
        buckets = self.buckets
        while buckets and buckets[0][0] <= now - self.span:
            second, counts = buckets.popleft()
            del self.index[second]
            self.totals[0] -= counts[0]
            self.totals[1] -= counts[1]
        return self.totals

    def add(self, now: int, which: int, amount: int) -> None:
        bucket = self.index.get(now)
        if bucket is None:
            bucket = self.index[now] = [0, 0]
            self.buckets.append((now, bucket))
        bucket[which] += amount
        self.totals[which] += amount

    def adjust(self, second: int, which: int, amount: int) -> None:
        bucket = self.index.get(second)
        if bucket is not None:  # still in the window
            bucket[which] += amount
            self.totals[which] += amount


_REQUESTS: Final = 0  # capacity window
_TOKENS: Final = 1
_FIRSTS: Final = 0  # allowance window
_REPEATS: Final = 1


class MemoryCapacity:
    def __init__(
        self, allowance: RepeatAllowanceConfig, *, clock: Callable[[], float] | None = None
    ) -> None:
        self.allowance = allowance
        # The monotonic clock: with the wall clock, an NTP step back of an hour kept the
        # last minute's counts for that hour (the upstream skipped as at capacity, a
        # Retry-After of 3660 s), a step forward emptied the window at once.
        self.clock = time.monotonic if clock is None else clock
        self.window = max(int(allowance.window_ms // 1000), 1)
        self.keep = max(self.window, CAPACITY_WINDOW)
        self._capacity: dict[str, Rolling] = {}
        self._allowance: dict[str, Rolling] = {}

    def _windows(self, upstream: str) -> tuple[Rolling, Rolling]:
        capacity = self._capacity.get(upstream)
        if capacity is None:
            capacity = self._capacity[upstream] = Rolling(CAPACITY_WINDOW)
            self._allowance[upstream] = Rolling(self.window)
        return capacity, self._allowance[upstream]

    async def reserve(self, upstream: str, ask: Ask) -> Reservation | Refusal:
        return self.reserve_now(upstream, ask)

    def reserve_now(self, upstream: str, ask: Ask) -> Reservation | Refusal:
        now = int(self.clock())
        capacity = self._capacity.get(upstream)
        if capacity is None:
            capacity, allowance = self._windows(upstream)
        else:
            allowance = self._allowance[upstream]
        repeat = ask.repeat
        # The allowance window moved on to `now` once, before the repeat is weighed and
        # the attempt counted.
        firsts, repeats = allowance.advance(now)
        if repeat and not repeat_allowed(firsts, repeats, self.allowance):
            return "repeat_budget"
        counted = ask.capacity_declared
        if counted:
            requests, tokens = capacity.advance(now)
            if not within_capacity(requests, tokens, ask):
                return "capacity"
            capacity.add(now, _REQUESTS, 1)
            capacity.add(now, _TOKENS, ask.tokens)
        allowance.add(now, _REPEATS if repeat else _FIRSTS, 1)
        return Reservation(upstream, now, ask.tokens, repeat, counted)

    async def settle(self, reservation: Reservation, tokens: int) -> None:
        self.settle_now(reservation, tokens)

    def settle_now(self, reservation: Reservation, tokens: int) -> None:
        if reservation.counted:
            capacity, _ = self._windows(reservation.upstream)
            capacity.adjust(reservation.second, _TOKENS, tokens - reservation.tokens)

    async def cancel(self, reservation: Reservation) -> None:
        await self.release_capacity(reservation)
        _, allowance = self._windows(reservation.upstream)
        allowance.adjust(reservation.second, _REPEATS if reservation.repeat else _FIRSTS, -1)

    async def release_capacity(self, reservation: Reservation) -> None:
        if reservation.counted:
            capacity, _ = self._windows(reservation.upstream)
            capacity.adjust(reservation.second, _REQUESTS, -1)
            capacity.adjust(reservation.second, _TOKENS, -reservation.tokens)

    async def free_in(self, upstream: str, ask: Ask) -> float | None:
        capacity = self._capacity.get(upstream)
        buckets = capacity.buckets if capacity is not None else ()
        rows = [(second, counts[_REQUESTS], counts[_TOKENS]) for second, counts in buckets]
        return capacity_free_in(rows, int(self.clock()), ask)

    def keep_only(self, upstreams: Collection[str]) -> None:
        """Forget the windows of every upstream but `upstreams` (a store reload's table):
        a removed upstream's windows were kept for the life of the process."""
        for name in [name for name in self._capacity if name not in upstreams]:
            del self._capacity[name]
            self._allowance.pop(name, None)

    async def aclose(self) -> None:
        return None


IMMEDIATE_CAPACITY.add(MemoryCapacity)  # never waits: its calls are answered at the call
