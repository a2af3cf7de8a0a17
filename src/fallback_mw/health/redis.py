"""Health state shared by every gateway process through Redis (`state = "redis://..."`).

Each transition is one Lua script, so it is atomic across processes: exactly one process
gets the half-open probe. Time is Redis's own clock (`TIME`), so processes with skewed
clocks agree. Every key expires. `?prefix=` in the URL namespaces the keys.

If Redis cannot be reached the gateway keeps serving on this process's in-memory state
(`self.local`) until it is back; the connections, the pipelined calls and the outage are
health/redis_link.py's, the credential pools health/redis_pools.py's, and what a process
reports of the shared breakers health/redis_reports.py's.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from opentelemetry import metrics
from opentelemetry.metrics import MeterProvider

from fallback_mw.config import MAX_COOLDOWN_MS, MAX_DEADLINE_MS, BreakerConfig
from fallback_mw.health.breaker import DEFAULT_PROBE_LEASE, PROBE_LEASE_MARGIN
from fallback_mw.health.events import Admission, TransitionListener
from fallback_mw.health.memory import MemoryHealth
from fallback_mw.health.pool import Selection
from fallback_mw.health.redis_link import DEFAULT_MAX_CONNECTIONS
from fallback_mw.health.redis_outage import Unavailable
from fallback_mw.health.redis_pools import CREDENTIAL_TTL_MS, RedisCredentialPools
from fallback_mw.health.redis_reports import RedisBreakerReports
from fallback_mw.health.redis_scripts import (
    ADMIT,
    FORGET,
    OPEN_FAULT,
    RECORD,
    RELEASE,
    RESET_FAULT,
    RESTORE_FAULT_MARKS,
    SKIP_FAULT,
)

logger = logging.getLogger("fallback_mw.health")

T = TypeVar("T")

# How often a process whose gauge says a breaker is not closed reads its shared state.
REFRESH_INTERVAL = 5.0


def shared_probe(admission: Admission | None) -> str:
    """The admission that ended, as RECORD and RELEASE read it: '*' when nobody said (taken
    as the probe's), '-' a closed breaker's, else the probe's owner."""
    if admission is None or admission.probe is None:
        return "*"
    return admission.probe or "-"


class RedisHealth(RedisBreakerReports, RedisCredentialPools):
    def __init__(
        self,
        url: str,
        breaker: BreakerConfig | None = None,
        *,
        probe_lease: float = DEFAULT_PROBE_LEASE,
        retry_interval: float = 1.0,
        socket_timeout: float = 0.5,
        refresh_interval: float = REFRESH_INTERVAL,
        on_transition: TransitionListener | None = None,
        on_observed: TransitionListener | None = None,
        meter_provider: MeterProvider | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        pool_timeout: float = 2.0,
        pools: Mapping[str, Sequence[str]] | None = None,
        series_at_zero: Callable[[metrics.Counter], None] | None = None,
    ) -> None:
        super().__init__(
            url,
            retry_interval=retry_interval,
            socket_timeout=socket_timeout,
            meter_provider=meter_provider,
            max_connections=max_connections,
            pool_timeout=pool_timeout,
            series_at_zero=series_at_zero,
        )
        self.on_transition = on_transition
        # Told of a state another process moved the shared breaker to (the gauge follows
        # it; not a transition of this process's, so not counted twice); else on_transition.
        self.on_observed = on_observed
        # Credential marks are kept per index; an index means one variable only within one
        # list of variables. A pool whose list changed (a revoked key removed, one added or
        # reordered) gets keys of its own, so no mark lands on another credential.
        self._upstreams = tuple(pools or ())  # read at startup (_started)
        self._pool_ids = {
            name: hashlib.sha256("\x1f".join(envs).encode()).hexdigest()[:12]
            for name, envs in (pools or {}).items()
            if len(envs) > 1
        }
        self.config = breaker or BreakerConfig()
        self.probe_lease_ms = max(int(probe_lease * 1000), 1)  # admit's lease may be longer
        self._seen: dict[str, str] = {}  # breaker state last reported, per upstream
        # While a breaker this process reported is not closed, its shared state is read
        # every refresh_interval (`_watch`): another process's probe may close it.
        self.refresh_interval = refresh_interval
        self._refresh_timer: asyncio.TimerHandle | None = None
        self._refreshing: asyncio.Task[None] | None = None
        self.local = MemoryHealth(
            self.config, probe_lease=probe_lease, on_transition=self._local_transition
        )
        self._pool_sizes: dict[str, int] = {}
        self._selections: dict[str, Selection] = {}
        # Upstreams whose fault ended while Redis was unreachable: the reset reached only
        # the local state, so it is made again on the shared one once Redis is back (else
        # the fault's shared breaker outlived it, skipped by every process for its cooldown).
        self._fault_resets: set[str] = set()
        # Likewise upstreams whose url changed (`forget`) while Redis was unreachable: their
        # shared breaker is still the old url's, dropped once Redis is back.
        self._forgets: dict[str, str] = {}
        # A mark per upstream whose url this process has seen change (`forget`), new at each
        # change: an attempt admitted before it (`Admission.origin`) judged the old url, and
        # its outcome goes to no breaker, as on the memory state. Recorded, a failure of the
        # old url counted against the new url's fresh shared breaker, and could open it.
        self._origins: dict[str, object] = {}
        self._max_cooldown_ms = max(self.config.max_cooldown_ms, self.config.cooldown_ms)
        self.breaker_ttl_ms = self._breaker_ttl_ms(self.probe_lease_ms)
        # The furthest an open breaker's end or a probe's lease can be written ahead by any
        # process on this Redis, whatever its own breaker settings (a rolling change of
        # max_cooldown_ms): the longest cooldown any configuration allows, twice, and a walk
        # deadline's lease. One further off is due (redis_scripts._AHEAD).
        self._furthest_end_ms = (
            2 * MAX_COOLDOWN_MS + MAX_DEADLINE_MS + math.ceil(PROBE_LEASE_MARGIN * 1000)
        )

    def _breaker_ttl_ms(self, lease_ms: int) -> int:
        """A breaker key outlives its longest open period twice over, and a probe's lease."""
        return max(2 * self._max_cooldown_ms + lease_ms, 600_000)

    def _after_recovery(self) -> None:
        if self._fault_resets or self._forgets:
            task = asyncio.get_running_loop().create_task(self._catch_up())
            self._giving_back.add(task)
            task.add_done_callback(self._giving_back.discard)

    async def _catch_up(self) -> None:
        """The resets of faults that ended, and the forgets of upstreams whose url changed,
        during the outage, on the shared state now (a Redis away again keeps them for its
        end)."""
        for upstream in sorted(self._fault_resets):
            await self.reset_fault(upstream)
        for upstream, url in sorted(self._forgets.items()):
            # Not marked as moved again: an attempt admitted since the move judged its url.
            await self._forget(upstream, url)

    # --- HealthState -------------------------------------------------------------------

    async def admit(
        self, upstream: str, *, lease: float = 0.0, admission: Admission | None = None
    ) -> bool:
        lease_ms = max(self.probe_lease_ms, math.ceil(lease * 1000))
        ttl_ms = self._breaker_ttl_ms(lease_ms)  # the key outlives the probe's lease
        number = next(self._admissions)
        if admission is not None:
            admission.origin = self._origins.get(upstream)

        def convert(result: Any) -> bool:
            admitted, transition, *rest = result
            self._report(upstream, transition or None)
            if rest and rest[0]:
                self._sync(upstream, str(rest[0]))
            if int(admitted) and admission is not None:
                # The probe's owner as ADMIT wrote it; '-' a closed breaker's admission.
                half_open = bool(rest) and rest[0] == "half_open"
                admission.probe = f"{self._owner}:{number}" if half_open else "-"
            return bool(int(admitted))

        return await self._with_fallback(
            "admit",
            ADMIT,
            [self._key("breaker", upstream)],
            [lease_ms, ttl_ms, self._owner, number, self._furthest_end_ms],
            lambda: self.local.admit(upstream, lease=lease, admission=admission),
            convert,
        )

    async def record(
        self,
        upstream: str,
        *,
        failure: bool,
        fault: str | None = None,
        admission: Admission | None = None,
    ) -> None:
        if self._moved_since(upstream, admission):
            return
        config = self.config

        def convert(result: Any) -> None:
            self._report(upstream, result or None)

        await self._with_fallback(
            "record",
            RECORD,
            [self._key("breaker", upstream)],
            [
                "1" if failure else "0",
                config.window,
                config.min_calls,
                repr(config.failure_rate),
                config.cooldown_ms,
                max(config.max_cooldown_ms, config.cooldown_ms),
                self.breaker_ttl_ms,
                fault or "",
                shared_probe(admission),
            ],
            lambda: self.local.record(upstream, failure=failure, fault=fault, admission=admission),
            convert,
        )

    async def open_fault(self, upstream: str) -> str | None:
        return await self._with_fallback(
            "open_fault",
            OPEN_FAULT,
            [self._key("breaker", upstream)],
            [],
            lambda: self.local.open_fault(upstream),
            lambda result: str(result) or None,
        )

    async def skip_fault(self, upstream: str) -> str | None:
        return await self._with_fallback(
            "skip_fault",
            SKIP_FAULT,
            [self._key("breaker", upstream)],
            [],
            lambda: self.local.skip_fault(upstream),
            lambda result: str(result) or None,
        )

    async def reset_fault(self, upstream: str) -> None:
        reset = await self._run(
            "reset_fault", RESET_FAULT, [self._key("breaker", upstream)], [self.config.cooldown_ms]
        )
        marks = await self._run(
            "restore_fault_marks",
            RESTORE_FAULT_MARKS,
            [self._pool_key("credentials", upstream), self._pool_key("fault_marks", upstream)],
            [],
        )
        if isinstance(reset, Unavailable) or isinstance(marks, Unavailable):
            self._fault_resets.add(upstream)  # made again once Redis is back (_recovered)
        else:
            self._fault_resets.discard(upstream)
        if not isinstance(reset, Unavailable):
            if reset == "=closed":
                self._sync(upstream, "closed")
            else:
                self._report(upstream, reset or None)
        # The local state served while Redis was unreachable is reset too.
        await self.local.reset_fault(upstream)

    def keep_only(self, upstreams: Collection[str]) -> None:
        """This process's own copy forgets every upstream but `upstreams` (MemoryHealth's);
        the shared keys expire by themselves."""
        self.local.keep_only(upstreams)
        for name in [name for name in self._origins if name not in upstreams]:
            del self._origins[name]

    async def forget(self, upstream: str, url: str) -> None:
        self._origins[upstream] = object()
        await self._forget(upstream, url)

    async def _forget(self, upstream: str, url: str) -> None:
        """`forget` on the shared state (made again once Redis is back, if it was away)."""

        def convert(result: Any) -> None:
            if result == "=":
                return  # another process forgot it for this url: the breaker is the new url's
            if result == "=closed":
                self._sync(upstream, "closed")
            else:
                self._report(upstream, result or None)

        result = await self._run(
            "forget",
            FORGET,
            [self._key("breaker", upstream), self._key("breaker_url", upstream)],
            [hashlib.sha256(url.encode()).hexdigest()[:32], CREDENTIAL_TTL_MS],
        )
        if isinstance(result, Unavailable):
            self._forgets[upstream] = url  # made once Redis is back (_recovered)
        else:
            if self._forgets.get(upstream) == url:
                del self._forgets[upstream]
            convert(result)
        await self.local.forget(upstream, url)  # the state served while Redis was unreachable

    def _moved_since(self, upstream: str, admission: Admission | None) -> bool:
        """Whether the upstream's url changed (`forget`) since `admission` was admitted."""
        return admission is not None and admission.origin is not self._origins.get(upstream)

    async def release(self, upstream: str, admission: Admission | None = None) -> None:
        if self._moved_since(upstream, admission):
            return  # the probe slot it held was the old url's breaker's, dropped with it
        await self._with_fallback(
            "release",
            RELEASE,
            [self._key("breaker", upstream)],
            [shared_probe(admission)],
            lambda: self.local.release(upstream, admission),
            lambda result: None,
        )

    async def aclose(self) -> None:
        # Calls already made go out first (a batch waiting for its turn of the loop, then
        # the pipelines in flight), never on a client made again after this one closed.
        group = self._group
        if group is not None and group.loop is asyncio.get_running_loop():
            if group.waiting:
                await asyncio.sleep(0)
            if self._senders:
                await asyncio.gather(*self._senders, return_exceptions=True)
            trying = self._trying
            if trying is not None and trying.get_loop() is group.loop:
                await asyncio.gather(trying, return_exceptions=True)
            if self._giving_back:
                await asyncio.gather(*self._giving_back, return_exceptions=True)
            if self._retiring:  # pools retired by an outage
                await asyncio.gather(*self._retiring, return_exceptions=True)
        if self._retry_timer is not None:  # after the try in flight: it may set another
            self._retry_timer.cancel()
            self._retry_timer = None
        if self._refresh_timer is not None:
            self._refresh_timer.cancel()
            self._refresh_timer = None
        refreshing = self._refreshing
        if refreshing is not None and refreshing.get_loop() is asyncio.get_running_loop():
            refreshing.cancel()
            await asyncio.gather(refreshing, return_exceptions=True)
        self._follow_loop(asyncio.get_running_loop())  # another loop's pool: closed there
        client, self._client = self._client, None
        self._closes_with(None)
        if client is not None:
            await client.aclose()
