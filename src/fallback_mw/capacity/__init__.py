"""Counters shared by every request to an upstream, beside health: declared capacity
(`rpm`, `tpm`, a rolling minute) and the budget for repeats and hedges (a sliding window
of first attempts). Memory (per process) and Redis (shared, one Lua script per admission)
implementations sit behind one small interface, like the health state's.

`admit` is asked once per attempt, after the breaker admitted it. It either counts the
attempt (an `Admission`) or refuses it: `"capacity"` (a declared limit would be exceeded:
the candidate is skipped, no packet, no breaker mark) or `"repeat_budget"` (a repeat or a
hedge over the budget: the walk ends, `walk.decide`). Moving to a candidate not tried yet
is never refused for the budget; its first attempt is what the budget is a fraction of."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fallback_mw.capacity.model import (
    CAPACITY_WINDOW,
    Admission,
    Ask,
    CapacityState,
    Refusal,
    repeat_allowed,
    within_capacity,
)

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider

    from fallback_mw.config import RepeatBudgetConfig
    from fallback_mw.health import HealthState


def create_capacity(
    state: str,
    budget: RepeatBudgetConfig,
    *,
    health: HealthState | None = None,
    meter_provider: MeterProvider | None = None,
) -> CapacityState:
    """The counters for `gateway.state`: memory, or Redis (shared by every process, on the
    Redis health state's connections when `health` is one)."""
    if state.startswith(("redis://", "rediss://", "unix://")):
        from fallback_mw.capacity.redis import RedisCapacity
        from fallback_mw.health.redis import RedisHealth

        if isinstance(health, RedisHealth):
            return RedisCapacity(health, budget)
        own = RedisHealth(state, meter_provider=meter_provider)
        return RedisCapacity(own, budget, owned=True)
    from fallback_mw.capacity.memory import MemoryCapacity

    return MemoryCapacity(budget)


__all__ = [
    "CAPACITY_WINDOW",
    "Admission",
    "Ask",
    "CapacityState",
    "Refusal",
    "create_capacity",
    "repeat_allowed",
    "within_capacity",
]
