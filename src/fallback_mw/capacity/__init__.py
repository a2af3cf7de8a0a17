"""Counters shared by every request to an upstream, beside health: declared capacity
(`rpm`, `tpm`, a rolling minute) and the allowance for repeats and hedges (a sliding window
of first attempts). Memory (per process) and Redis (shared, one Lua script per reservation)
implementations sit behind one small interface, like the health state's.

`admit` is asked once per attempt, after the breaker admitted it. It either counts the
attempt (an `Reservation`) or refuses it: `"capacity"` (a declared limit would be exceeded:
the candidate is skipped, no packet, no breaker mark) or `"repeat_budget"` (a repeat or a
hedge over the allowance: the walk ends, `walk.decide`). Moving to a candidate not tried yet
is never refused for the allowance; its first attempt is what the allowance is a fraction of."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fallback_mw.capacity.model import (
    CAPACITY_WINDOW,
    Ask,
    CapacityState,
    ImmediateCapacity,
    Refusal,
    Reservation,
    immediate_capacity,
    repeat_allowed,
    within_capacity,
)
from fallback_mw.store_url import is_redis_url
from fallback_mw.tokens import estimate_tokens

if TYPE_CHECKING:
    from opentelemetry.metrics import Counter, MeterProvider

    from fallback_mw.config import RepeatAllowanceConfig
    from fallback_mw.config.views import AnyUpstream
    from fallback_mw.health import HealthState
    from fallback_mw.request.context import Usage


def asker(
    buffered: bytes | None,
    parsed: Mapping[str, Any] | None,
    declared: int | None,
    unparsed: Callable[[], tuple[bytes, Mapping[str, Any]] | None] | None = None,
) -> Callable[[str, AnyUpstream, bool], Ask]:
    """What each attempt of one request adds to its upstream's counts. The token estimate
    (tokens.py: body size, largest output limit) is made once, and only for an upstream
    that declares `tpm`. `unparsed`: a buffered body that is not JSON as sent, as the
    budget's estimate reads it (decoded from gzip / deflate, an integer of thousands of
    digits read), so the same estimate counts here (`request.body_json.estimate_source`)."""
    tokens: list[int] = []

    def ask(name: str, upstream: AnyUpstream, repeat: bool) -> Ask:
        if upstream.tpm is None:
            return Ask(upstream.rpm, None, 0, repeat)
        if not tokens:
            size = len(buffered) if buffered is not None else declared
            read = parsed
            if read is None and buffered and unparsed is not None:
                source = unparsed()  # a body the upstream reads, which json.loads does not
                if source is not None:
                    size, read = len(source[0]), source[1]
            tokens.append(estimate_tokens(size or 0, read))
        return Ask(upstream.rpm, upstream.tpm, tokens[0], repeat)

    return ask


def reported_tokens(usage: Usage) -> int | None:
    """Input + output tokens the upstream reported (None: it reported none)."""
    if usage.input_tokens is None and usage.output_tokens is None:
        return None
    return (usage.input_tokens or 0) + (usage.output_tokens or 0)


def create_capacity(
    state: str,
    allowance: RepeatAllowanceConfig,
    *,
    health: HealthState | None = None,
    meter_provider: MeterProvider | None = None,
    series_at_zero: Callable[[Counter], None] | None = None,
) -> CapacityState:
    """The counters for `gateway.state`: memory, or Redis (shared by every process, on the
    Redis health state's connections when `health` is one)."""
    if is_redis_url(state):
        from fallback_mw.capacity.redis import RedisCapacity
        from fallback_mw.health.redis import RedisHealth

        if isinstance(health, RedisHealth):
            return RedisCapacity(health, allowance)
        own = RedisHealth(state, meter_provider=meter_provider, series_at_zero=series_at_zero)
        return RedisCapacity(own, allowance, owned=True)
    from fallback_mw.capacity.memory import MemoryCapacity

    return MemoryCapacity(allowance)


__all__ = [
    "CAPACITY_WINDOW",
    "Ask",
    "CapacityState",
    "ImmediateCapacity",
    "Refusal",
    "Reservation",
    "asker",
    "create_capacity",
    "immediate_capacity",
    "repeat_allowed",
    "reported_tokens",
    "within_capacity",
]
