"""Health state for one process (`state = "memory://"`, the default)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

from fallback_mw.config import BreakerConfig
from fallback_mw.health import memory_calls
from fallback_mw.health.breaker import DEFAULT_PROBE_LEASE, Breaker
from fallback_mw.health.events import IMMEDIATE_HEALTH, Admission, TransitionListener
from fallback_mw.health.memory_calls import report_transition as report_transition
from fallback_mw.health.pool import (
    CredentialMark,
    CredentialPool,
    Selection,
    credential_mark,
    score_outcome,
)

logger = logging.getLogger("fallback_mw.health")


def breaker_credential_mark(
    config: BreakerConfig,
    upstream: str,
    index: int,
    *,
    status: int | None,
    failure: bool,
    retry_after: float | None,
    quota: float | None = None,
) -> CredentialMark | None:
    """`credential_mark` with the breaker settings' cool-downs; a mark is logged (the
    action only: never the answer that caused it)."""
    mark = credential_mark(
        status=status,
        failure=failure,
        retry_after=retry_after,
        default_cooldown=config.cooldown_ms / 1000,
        max_cooldown=max(config.max_cooldown_ms, config.cooldown_ms) / 1000,
        quota=quota,
    )
    if mark is not None:
        logger.info("credential upstream=%s index=%d mark=%s", upstream, index, mark.action)
    return mark


def probe_of(admission: Admission | None) -> str | None:
    """The probe an admission names; None (taken as the probe's) when nobody said."""
    return None if admission is None else admission.probe


class MemoryHealth:
    """Breakers and credential pools kept in this process. Credential health applies to
    pools (more than one credential); a single credential is governed by the breaker."""

    def __init__(
        self,
        breaker: BreakerConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        probe_lease: float = DEFAULT_PROBE_LEASE,
        on_transition: TransitionListener | None = None,
    ) -> None:
        self.on_transition = on_transition
        self.config = breaker or BreakerConfig()
        self.clock = clock
        self.probe_lease = probe_lease  # the least a probe holds its slot (see admit's lease)
        self._breakers: dict[str, Breaker] = {}
        self._pools: dict[str, CredentialPool] = {}
        # Pool credentials a fault's outcome marked: upstream -> index -> fault kind.
        self._fault_marks: dict[str, dict[int, str]] = {}
        self.pool_sizes: dict[str, int] = {}
        self.selections: dict[str, Selection] = {}

    def breaker(self, upstream: str) -> Breaker:
        found = self._breakers.get(upstream)
        if found is None:
            found = self._breakers[upstream] = Breaker(self.config, probe_lease=self.probe_lease)
        return found

    def pool(self, upstream: str) -> CredentialPool:
        found = self._pools.get(upstream)
        if found is None:
            found = self._pools[upstream] = CredentialPool()
        return found

    async def admit(
        self, upstream: str, *, lease: float = 0.0, admission: Admission | None = None
    ) -> bool:
        return self.admit_now(upstream, lease, admission)

    def admit_now(self, upstream: str, lease: float, admission: Admission | None) -> bool:
        return memory_calls.admit(self, upstream, lease, admission)

    def _admitting(self, upstream: str, admission: Admission | None) -> Breaker | None:
        return memory_calls.admitting(self, upstream, admission)

    async def record(
        self,
        upstream: str,
        *,
        failure: bool,
        fault: str | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.record_now(upstream, failure, fault, admission)

    def record_now(
        self, upstream: str, failure: bool, fault: str | None, admission: Admission | None
    ) -> None:
        memory_calls.record(self, upstream, failure, fault, admission)

    async def open_fault(self, upstream: str) -> str | None:
        found = self._breakers.get(upstream)
        return None if found is None else found.open_fault()

    async def skip_fault(self, upstream: str) -> str | None:
        found = self._breakers.get(upstream)
        return None if found is None else found.skip_fault()

    async def reset_fault(self, upstream: str) -> None:
        found = self._breakers.get(upstream)
        if found is not None:
            report_transition(self.on_transition, upstream, found.reset_fault())
        marked = self._fault_marks.pop(upstream, {})
        pool = self._pools.get(upstream)
        if pool is not None and marked:
            for index in marked:
                pool.unusable_until.pop(index, None)
            logger.info("credential upstream=%s restored=%d (fault cleared)", upstream, len(marked))

    async def forget(self, upstream: str, url: str) -> None:
        found = self._breakers.pop(upstream, None)
        if found is not None and found.state != "closed":
            report_transition(self.on_transition, upstream, "closed")

    def keep_only(self, upstreams: Collection[str]) -> None:
        """Forget every upstream but `upstreams` (a store reload's table): a route store
        adding and removing routes for weeks kept each removed upstream's breaker and pool
        for the life of the process. One added back later starts afresh, as a moved one
        does (`forget`)."""
        for name in [name for name in self._breakers if name not in upstreams]:
            found = self._breakers.pop(name)
            if found.state != "closed":
                report_transition(self.on_transition, name, "closed")
        for kept in (self._pools, self._fault_marks, self.pool_sizes, self.selections):
            for name in [name for name in kept if name not in upstreams]:
                del kept[name]

    async def fault_marked(self, upstream: str, index: int, fault: str) -> None:
        self._fault_marks.setdefault(upstream, {})[index] = fault

    async def pool_fault(self, upstream: str) -> str | None:
        return next(iter(self._fault_marks.get(upstream, {}).values()), None)

    async def release(self, upstream: str, admission: Admission | None = None) -> None:
        self.release_now(upstream, admission)

    def release_now(self, upstream: str, admission: Admission | None) -> None:
        breaker = self._admitting(upstream, admission)
        if breaker is not None:
            breaker.release(probe_of(admission))

    async def usable_in(self, upstream: str, pool_size: int) -> float | None:
        now = self.clock()
        found = self._breakers.get(upstream)
        wait: float | None = 0.0 if found is None else found.admits_in(now)
        if pool_size > 1:
            credential = self.pool(upstream).usable_in(pool_size, now)
            wait = None if credential is None else max(wait or 0.0, credential)
        return wait

    async def pick_credential(
        self,
        upstream: str,
        pool_size: int,
        *,
        exclude: frozenset[int],
        session: str | None,
        selection: Selection = "round_robin",
    ) -> int | None:
        return self.pick_credential_now(upstream, pool_size, exclude, session, selection)

    def pick_credential_now(
        self,
        upstream: str,
        pool_size: int,
        exclude: frozenset[int],
        session: str | None,
        selection: Selection,
    ) -> int | None:
        self.pool_sizes[upstream] = pool_size
        self.selections[upstream] = selection
        if pool_size <= 1:
            return None if 0 in exclude or pool_size < 1 else 0
        return self.pool(upstream).pick(
            pool_size, exclude=exclude, session=session, now=self.clock(), selection=selection
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
        self.credential_result_now(
            upstream, index, status, failure, retry_after, session, latency, quota
        )

    def pooled(self, upstream: str) -> bool:
        return memory_calls.pooled(self, upstream)

    def credential_result_now(
        self,
        upstream: str,
        index: int,
        status: int | None,
        failure: bool,
        retry_after: float | None,
        session: str | None,
        latency: float | None,
        quota: float | None,
    ) -> None:
        if not self.pooled(upstream):
            return
        mark = breaker_credential_mark(
            self.config, upstream, index, status=status, failure=failure,
            retry_after=retry_after, quota=quota,
        )  # fmt: skip
        pool, now = self.pool(upstream), self.clock()
        pool.apply(index, mark, now)
        if self.selections.get(upstream) == "score":
            pool.observe(index, ok=score_outcome(status=status, failure=failure), latency=latency,
                         now=now)  # fmt: skip

    def start(self) -> None:
        return None  # nothing to reach

    async def aclose(self) -> None:
        return None


IMMEDIATE_HEALTH.add(MemoryHealth)  # never waits: its calls are answered at the call
