"""Health state shared by every gateway process through Redis (`state = "redis://..."`).

Each transition is one Lua script, so it is atomic across processes: exactly one process
gets the half-open probe. Time is Redis's own clock (`TIME`), so processes with skewed
clocks agree. Every key expires. `?prefix=` in the URL namespaces the keys.

If Redis cannot be reached the gateway keeps serving on this process's in-memory state
(`self.local`) until it is back; the connections, the pipelined calls and the outage are
health/redis_link.py's.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from opentelemetry import metrics
from opentelemetry.metrics import MeterProvider

from fallback_mw.config import MAX_COOLDOWN_MS, MAX_DEADLINE_MS, BreakerConfig
from fallback_mw.health.breaker import DEFAULT_PROBE_LEASE, PROBE_LEASE_MARGIN
from fallback_mw.health.events import Admission, TransitionListener
from fallback_mw.health.memory import MemoryHealth, breaker_credential_mark, report_transition
from fallback_mw.health.pool import AFFINITY_LIMIT, SCORE_HALF_LIFE, Selection, score_outcome
from fallback_mw.health.redis_link import (
    DEFAULT_MAX_CONNECTIONS,
    RedisLink,
    Unavailable,
)
from fallback_mw.health.redis_scripts import (
    ADMIT,
    BREAKER_STATE,
    FAULT_MARKED,
    FORGET,
    MARK,
    OBSERVE,
    OPEN_FAULT,
    PICK,
    POOL_FAULT,
    RECORD,
    RELEASE,
    RESET_FAULT,
    RESTORE_FAULT_MARKS,
    SKIP_FAULT,
    USABLE_IN,
)

logger = logging.getLogger("fallback_mw.health")

T = TypeVar("T")

CREDENTIAL_TTL_MS = 24 * 3600 * 1000  # a retired credential stays retired this long
AFFINITY_TTL_MS = 3600 * 1000  # an idle session forgets its credential after this long
# How often a process whose gauge says a breaker is not closed reads its shared state.
REFRESH_INTERVAL = 5.0


_STATE_AFTER = {"opened": "open", "reopened": "open"}  # other transitions name the state


def shared_probe(admission: Admission | None) -> str:
    """The admission that ended, as RECORD and RELEASE read it: '*' when nobody said (taken
    as the probe's), '-' a closed breaker's, else the probe's owner."""
    if admission is None or admission.probe is None:
        return "*"
    return admission.probe or "-"


class RedisHealth(RedisLink):
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

    async def _started(self) -> None:
        """At startup, the shared state of each configured upstream's breaker: one that
        other (or earlier) processes opened is reported now. A restarted `serve` said
        closed for it until its first admission of that upstream, so FallbackMwBreakerOpen
        resolved on a deploy while the shared breaker stayed open."""
        names = [name for name in self._upstreams if name not in self._seen]
        if self._outage or not names:
            return
        states = await asyncio.gather(
            *(
                self._run("breaker_state", BREAKER_STATE, [self._key("breaker", name)], [])
                for name in names
            )
        )
        for name, state in zip(names, states, strict=True):
            if not isinstance(state, Unavailable):
                self._sync(name, str(state))

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

    async def _with_fallback(
        self,
        name: str,
        source: str,
        keys: list[str],
        args: list[Any],
        local: Callable[[], Awaitable[T]],
        convert: Callable[[Any], T],
    ) -> T:
        result = await self._run(name, source, keys, args)
        if isinstance(result, Unavailable):
            return await local()
        return convert(result)

    def _pool_key(self, kind: str, upstream: str) -> str:
        """A key holding credential indexes: named after the pool's list of variables."""
        pool = self._pool_ids.get(upstream)
        return self._key(kind, upstream) + (f":{pool}" if pool else "")

    # --- HealthState -------------------------------------------------------------------

    def _report(self, upstream: str, transition: str | None) -> None:
        """A transition this process's script made: logged and told to the listener."""
        if transition:
            self._seen[upstream] = state = _STATE_AFTER.get(transition, transition)
            report_transition(self.on_transition, upstream, transition)
            if state != "closed":
                self._watch()

    def _local_transition(self, upstream: str, state: str) -> None:
        """A transition of the local breakers served during an outage: reported like any,
        and remembered as the state last reported, so the first admission once Redis is
        back reports the shared state again (`_sync`). Else a breaker opened locally kept
        the gauge at open, FallbackMwBreakerOpen firing, while the shared one was closed."""
        self._seen[upstream] = state
        if self.on_transition is not None:
            self.on_transition(upstream, state)
        if state != "closed":
            self._watch()

    def _sync(self, upstream: str, state: str) -> None:
        """The shared breaker's state as an admission found it: told to the listener when it
        differs from what this process last reported (another process moved it), so every
        process's gauge follows the shared state (FallbackMwBreakerOpen resolves)."""
        if self._seen.get(upstream, "closed") != state:
            self._seen[upstream] = state
            listener = self.on_observed or self.on_transition
            if listener is not None:
                listener(upstream, state)
            if state != "closed":
                self._watch()

    def _watch(self) -> None:
        """Read the shared state of the breakers this process last reported not closed in
        refresh_interval: another process's probe may close one, and this process's gauge
        followed only at its next admission of that upstream, so on a quiet route
        FallbackMwBreakerOpen (max over processes) kept firing after the recovery. One
        timer at a time, none while every breaker reported is closed."""
        if self._refresh_timer is not None or self._refreshing is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._refresh_timer = loop.call_later(self.refresh_interval, self._start_refresh)

    def _start_refresh(self) -> None:
        self._refresh_timer = None
        self._refreshing = asyncio.get_running_loop().create_task(self._refresh())

    async def _refresh(self) -> None:
        try:
            # During an outage the local breakers stand; a read would only count as a
            # local fallback (that counter moves with traffic only).
            upstreams = [] if self._outage else [n for n, s in self._seen.items() if s != "closed"]
            states = await asyncio.gather(
                *(
                    self._run("breaker_state", BREAKER_STATE, [self._key("breaker", name)], [])
                    for name in upstreams
                )
            )
            for name, state in zip(upstreams, states, strict=True):
                if not isinstance(state, Unavailable):  # an outage: its local state stands
                    self._sync(name, str(state))
        finally:
            self._refreshing = None
        if any(state != "closed" for state in self._seen.values()):
            self._watch()

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

    async def fault_marked(self, upstream: str, index: int, fault: str) -> None:
        await self._with_fallback(
            "fault_marked",
            FAULT_MARKED,
            [self._pool_key("fault_marks", upstream)],
            [index, fault, CREDENTIAL_TTL_MS],
            lambda: self.local.fault_marked(upstream, index, fault),
            lambda result: None,
        )

    async def pool_fault(self, upstream: str) -> str | None:
        return await self._with_fallback(
            "pool_fault",
            POOL_FAULT,
            [self._pool_key("fault_marks", upstream)],
            [],
            lambda: self.local.pool_fault(upstream),
            lambda result: str(result) or None,
        )

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

    async def usable_in(self, upstream: str, pool_size: int) -> float | None:
        def convert(result: Any) -> float | None:
            breaker, credential = (int(v) for v in result)
            return None if credential < 0 else max(breaker, credential) / 1000

        return await self._with_fallback(
            "usable_in",
            USABLE_IN,
            [self._key("breaker", upstream), self._pool_key("credentials", upstream)],
            [pool_size, self._furthest_end_ms],
            lambda: self.local.usable_in(upstream, pool_size),
            convert,
        )

    async def pick_credential(
        self,
        upstream: str,
        pool_size: int,
        *,
        exclude: frozenset[int],
        session: str | None,
        selection: Selection = "round_robin",
    ) -> int | None:
        self._pool_sizes[upstream] = self.local.pool_sizes[upstream] = pool_size
        self._selections[upstream] = self.local.selections[upstream] = selection
        if pool_size <= 1:
            return None if 0 in exclude or pool_size < 1 else 0
        field = ""
        if session is not None:
            field = hashlib.sha256(session.encode("utf-8", "replace")).hexdigest()[:32]
        affinity = self._pool_key("affinity", upstream)
        excluded = "," + ",".join(str(i) for i in sorted(exclude)) + ","

        def convert(result: Any) -> int | None:
            index = int(result)
            return None if index < 0 else index

        return await self._with_fallback(
            "pick",
            PICK,
            [
                self._pool_key("credentials", upstream),
                self._pool_key("rotation", upstream),
                affinity,
                self._pool_key("score", upstream),
                f"{affinity}:older",
            ],
            [
                pool_size,
                excluded,
                "1" if session is not None else "0",
                AFFINITY_TTL_MS,
                CREDENTIAL_TTL_MS,
                selection,
                int(SCORE_HALF_LIFE * 1000),
                field,
                AFFINITY_LIMIT,
            ],
            lambda: self.local.pick_credential(
                upstream, pool_size, exclude=exclude, session=session, selection=selection
            ),
            convert,
        )

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
        if self._pool_sizes.get(upstream, 0) <= 1:
            return
        if self._selections.get(upstream) == "score":
            ok = score_outcome(status=status, failure=failure)
            await self._with_fallback(
                "observe",
                OBSERVE,
                [self._pool_key("score", upstream)],
                [index, "1" if ok else "0", f"{max(latency or 0.0, 0.0):.6f}",
                 int(SCORE_HALF_LIFE * 1000), CREDENTIAL_TTL_MS],
                lambda: self._observe_locally(upstream, index, ok=ok, latency=latency),
                lambda result: None,
            )  # fmt: skip
        mark = breaker_credential_mark(
            self.config, upstream, index, status=status, failure=failure,
            retry_after=retry_after, quota=quota,
        )  # fmt: skip
        if mark is None:
            return
        await self._with_fallback(
            "mark",
            MARK,
            [self._pool_key("credentials", upstream)],
            [index, mark.action, int(mark.seconds * 1000), CREDENTIAL_TTL_MS],
            lambda: self.local.credential_result(
                upstream,
                index,
                status=status,
                failure=failure,
                retry_after=retry_after,
                session=session,
                quota=quota,
            ),
            lambda result: None,
        )

    async def _observe_locally(
        self, upstream: str, index: int, *, ok: bool, latency: float | None
    ) -> None:
        self.local.pool(upstream).observe(index, ok=ok, latency=latency, now=self.local.clock())

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
