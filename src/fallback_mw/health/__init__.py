"""Upstream health: circuit breakers and credential pools behind one interface."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from fallback_mw.health.events import Admission as Admission
from fallback_mw.health.events import ImmediateHealth as ImmediateHealth
from fallback_mw.health.events import TransitionListener as TransitionListener
from fallback_mw.health.events import immediate_health as immediate_health
from fallback_mw.health.pool import Selection
from fallback_mw.store_url import is_redis_url

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from opentelemetry.metrics import Counter, MeterProvider

    from fallback_mw.config import BreakerConfig


class HealthState(Protocol):
    """What the walker asks of health. Implementations: memory (per process), Redis (shared)."""

    async def admit(
        self, upstream: str, *, lease: float = 0.0, admission: Admission | None = None
    ) -> bool:
        """May this upstream be attempted now? An open breaker says no; a half-open one
        admits exactly one probe (the caller must then `record` its outcome, or `release`).
        `lease`: seconds the probe holds its slot unless it reports first, longer than the
        upstream may take to answer (`breaker.upstream_probe_lease`); never less than the
        state's own `probe_lease` (30 s). `admission` is filled in: which admission this is,
        for the `record` or `release` that ends it."""
        ...

    async def record(
        self,
        upstream: str,
        *,
        failure: bool,
        fault: str | None = None,
        admission: Admission | None = None,
    ) -> None:
        """Outcome of an admitted attempt (`admission`: its admission; a half-open breaker
        heeds only its probe's). `failure` is failover-class (SPEC §6); statuses
        outside `failover_status` are recorded as successes for the breaker. `fault` names
        the game-day fault that produced it (the breaker remembers that faults opened it)."""
        ...

    async def open_fault(self, upstream: str) -> str | None:
        """The fault whose outcomes opened this upstream's breaker, while it is open or
        half-open (a skip it causes is the fault's); None otherwise."""
        ...

    async def skip_fault(self, upstream: str) -> str | None:
        """The fault a skip this upstream's breaker refused is booked to: `open_fault`'s,
        or, for a breaker a fault's reset closed (and nothing opened since), that fault: a
        refusal made just before the reset (another process's) asks after it."""
        ...

    async def reset_fault(self, upstream: str) -> None:
        """The fault on this upstream was cleared: a breaker its outcomes opened closes
        (window and cooldown reset); one real failures opened is left alone. Pool
        credentials a fault's outcome marked (`fault_marked`) are usable again."""
        ...

    async def forget(self, upstream: str, url: str) -> None:
        """This upstream name now stands for another origin, `url` (a store reload changed
        it): its breaker, kept for the old origin, starts closed again; once per change in a
        shared state, whichever process reloads first (a later one's reload of the same
        change leaves the breaker the new url's outcomes made)."""
        ...

    async def fault_marked(self, upstream: str, index: int, fault: str) -> None:
        """A fault's outcome reached this pool credential (a `revoke` 401 retired it, a
        `fail` cooled it down): `reset_fault` restores it."""
        ...

    async def pool_fault(self, upstream: str) -> str | None:
        """The fault whose outcomes marked credentials of this pool, until its revert (a
        `no_credential` skip is then the fault's); None otherwise."""
        ...

    async def release(self, upstream: str, admission: Admission | None = None) -> None:
        """An admitted attempt ended for a reason that is not the upstream's (SPEC §5:
        local conditions are not upstream failures): nothing is recorded; a half-open
        probe slot it held is freed."""
        ...

    async def usable_in(self, upstream: str, pool_size: int) -> float | None:
        """Seconds until this upstream may be attempted again: its breaker admits (an open
        one half-opens) and, for a pool, a credential is usable again. 0: now; None: never
        by itself (every credential of the pool retired). Asked only when a walk found no
        candidate to attempt (the Retry-After of 503 route_exhausted)."""
        ...

    async def pick_credential(
        self,
        upstream: str,
        pool_size: int,
        *,
        exclude: frozenset[int],
        session: str | None,
        selection: Selection = "round_robin",
    ) -> int | None:
        """Index of a usable credential of the pool, or None when none is usable.
        `session` is the affinity key (`pool.affinity_key`: route, model, session)."""
        ...

    async def credential_result(
        self,
        upstream: str,
        index: int,
        *,
        status: int | None,
        failure: bool,
        retry_after: float | None,
        session: str | None,
        latency: float | None = None,
        quota: float | None = None,
    ) -> None:
        """401 retires the credential; a 429 that says the quota is spent (`quota`: seconds
        until it resets) retires it until then; 403, a plain 429 and failover-class failures
        cool it down. `latency` (seconds to the response head) feeds the score."""
        ...

    def start(self) -> None:
        """The server started (lifespan startup, on its event loop): a shared state tries
        its connection now, in the background, so one it cannot use is said at startup
        (its outage warning), not at the first request. Never raises, never waits."""
        ...

    async def aclose(self) -> None: ...


class AlwaysHealthy:
    """No breakers, no credential health: every upstream admitted, first unused credential."""

    async def admit(
        self, upstream: str, *, lease: float = 0.0, admission: Admission | None = None
    ) -> bool:
        return True

    async def record(
        self,
        upstream: str,
        *,
        failure: bool,
        fault: str | None = None,
        admission: Admission | None = None,
    ) -> None:
        return None

    async def open_fault(self, upstream: str) -> str | None:
        return None

    async def skip_fault(self, upstream: str) -> str | None:
        return None

    async def reset_fault(self, upstream: str) -> None:
        return None

    async def forget(self, upstream: str, url: str) -> None:
        return None

    async def fault_marked(self, upstream: str, index: int, fault: str) -> None:
        return None

    async def pool_fault(self, upstream: str) -> str | None:
        return None

    async def release(self, upstream: str, admission: Admission | None = None) -> None:
        return None

    async def usable_in(self, upstream: str, pool_size: int) -> float | None:
        return 0.0

    async def pick_credential(
        self,
        upstream: str,
        pool_size: int,
        *,
        exclude: frozenset[int],
        session: str | None,
        selection: Selection = "round_robin",
    ) -> int | None:
        for index in range(pool_size):
            if index not in exclude:
                return index
        return None

    async def credential_result(
        self,
        upstream: str,
        index: int,
        *,
        status: int | None,
        failure: bool,
        retry_after: float | None,
        session: str | None,
        latency: float | None = None,
        quota: float | None = None,
    ) -> None:
        return None

    def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


class StateURLError(ValueError):
    pass


def create_health(
    state: str,
    breaker: BreakerConfig | None = None,
    *,
    on_transition: TransitionListener | None = None,
    on_observed: TransitionListener | None = None,
    meter_provider: MeterProvider | None = None,
    pools: Mapping[str, Sequence[str]] | None = None,
    series_at_zero: Callable[[Counter], None] | None = None,
) -> HealthState:
    """The health state named by `gateway.state`: "memory://" (per process, the default)
    or "redis://..." / "rediss://..." (shared; `?prefix=` namespaces the keys).
    `on_transition` hears every breaker transition this process makes (the gateway's
    telemetry), `on_observed` each one another process made to a shared breaker; `pools`: each
    upstream's credential variables, which name a pool's keys in Redis; `series_at_zero`
    exports the Redis state's counter at 0 (Telemetry.series_at_zero)."""
    if state in ("memory://", "memory", ""):
        from fallback_mw.health.memory import MemoryHealth

        return MemoryHealth(breaker, on_transition=on_transition)
    if is_redis_url(state):
        from fallback_mw.health.redis import RedisHealth

        return RedisHealth(
            state, breaker, on_transition=on_transition, on_observed=on_observed,
            meter_provider=meter_provider, pools=pools, series_at_zero=series_at_zero,
        )  # fmt: skip
    raise StateURLError('state must be "memory://" or "redis://host:port/db[?prefix=...]"')
