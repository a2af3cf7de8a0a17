"""Capacity and repeat-budget counts for one process (`state = "memory://"`): per upstream,
two rolling windows of one-second buckets with running totals (requests and tokens over
the minute; first attempts and repeats over the budget's window), so an admission costs
O(1), not a sum over the window."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from fallback_mw.capacity.model import (
    CAPACITY_WINDOW,
    Admission,
    Ask,
    Refusal,
    repeat_allowed,
    within_capacity,
)
from fallback_mw.config import RepeatBudgetConfig


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


_REQUESTS, _TOKENS = 0, 1  # capacity window
_FIRSTS, _REPEATS = 0, 1  # budget window


class MemoryCapacity:
    def __init__(
        self, budget: RepeatBudgetConfig, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.budget = budget
        self.clock = clock
        self.window = max(int(budget.window_ms // 1000), 1)
        self.keep = max(self.window, CAPACITY_WINDOW)
        self._capacity: dict[str, Rolling] = {}
        self._budget: dict[str, Rolling] = {}

    def _windows(self, upstream: str) -> tuple[Rolling, Rolling]:
        capacity = self._capacity.get(upstream)
        if capacity is None:
            capacity = self._capacity[upstream] = Rolling(CAPACITY_WINDOW)
            self._budget[upstream] = Rolling(self.window)
        return capacity, self._budget[upstream]

    async def admit(self, upstream: str, ask: Ask) -> Admission | Refusal:
        now = int(self.clock())
        capacity, budget = self._windows(upstream)
        if ask.repeat:
            firsts, repeats = budget.advance(now)
            if not repeat_allowed(firsts, repeats, self.budget):
                return "repeat_budget"
        counted = ask.capacity_declared
        if counted:
            requests, tokens = capacity.advance(now)
            if not within_capacity(requests, tokens, ask):
                return "capacity"
            capacity.add(now, _REQUESTS, 1)
            capacity.add(now, _TOKENS, ask.tokens)
        budget.advance(now)
        budget.add(now, _REPEATS if ask.repeat else _FIRSTS, 1)
        return Admission(upstream, now, ask.tokens, ask.repeat, counted)

    async def settle(self, admission: Admission, tokens: int) -> None:
        if admission.counted:
            capacity, _ = self._windows(admission.upstream)
            capacity.adjust(admission.second, _TOKENS, tokens - admission.tokens)

    async def cancel(self, admission: Admission) -> None:
        capacity, budget = self._windows(admission.upstream)
        if admission.counted:
            capacity.adjust(admission.second, _REQUESTS, -1)
            capacity.adjust(admission.second, _TOKENS, -admission.tokens)
        budget.adjust(admission.second, _REPEATS if admission.repeat else _FIRSTS, -1)

    async def aclose(self) -> None:
        return None
