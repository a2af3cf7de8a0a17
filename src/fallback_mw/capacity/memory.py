"""Capacity and repeat-budget counts for one process (`state = "memory://"`): per
upstream, one-second buckets of [requests, tokens, first attempts, repeats]."""

from __future__ import annotations

import time
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

_REQUESTS, _TOKENS, _FIRSTS, _REPEATS = range(4)


class MemoryCapacity:
    def __init__(
        self, budget: RepeatBudgetConfig, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.budget = budget
        self.clock = clock
        self.window = max(int(budget.window_ms // 1000), 1)
        self.keep = max(self.window, CAPACITY_WINDOW)
        self._buckets: dict[str, dict[int, list[int]]] = {}

    def _sums(self, upstream: str, now: int) -> tuple[dict[int, list[int]], list[int]]:
        buckets = self._buckets.setdefault(upstream, {})
        totals = [0, 0, 0, 0]
        for second in list(buckets):
            age = now - second
            if age >= self.keep:
                del buckets[second]
                continue
            counts = buckets[second]
            if age < CAPACITY_WINDOW:
                totals[_REQUESTS] += counts[_REQUESTS]
                totals[_TOKENS] += counts[_TOKENS]
            if age < self.window:
                totals[_FIRSTS] += counts[_FIRSTS]
                totals[_REPEATS] += counts[_REPEATS]
        return buckets, totals

    async def admit(self, upstream: str, ask: Ask) -> Admission | Refusal:
        now = int(self.clock())
        buckets, totals = self._sums(upstream, now)
        if ask.repeat and not repeat_allowed(totals[_FIRSTS], totals[_REPEATS], self.budget):
            return "repeat_budget"
        counted = ask.capacity_declared
        if counted and not within_capacity(totals[_REQUESTS], totals[_TOKENS], ask):
            return "capacity"
        bucket = buckets.setdefault(now, [0, 0, 0, 0])
        if counted:
            bucket[_REQUESTS] += 1
            bucket[_TOKENS] += ask.tokens
        bucket[_REPEATS if ask.repeat else _FIRSTS] += 1
        return Admission(upstream, now, ask.tokens, ask.repeat, counted)

    async def settle(self, admission: Admission, tokens: int) -> None:
        bucket = self._buckets.get(admission.upstream, {}).get(admission.second)
        if bucket is not None and admission.counted:
            bucket[_TOKENS] += tokens - admission.tokens

    async def cancel(self, admission: Admission) -> None:
        bucket = self._buckets.get(admission.upstream, {}).get(admission.second)
        if bucket is None:
            return
        if admission.counted:
            bucket[_REQUESTS] -= 1
            bucket[_TOKENS] -= admission.tokens
        bucket[_REPEATS if admission.repeat else _FIRSTS] -= 1

    async def aclose(self) -> None:
        return None
