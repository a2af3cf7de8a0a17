"""Credential pools on the Redis health state: which credential a request uses (round robin
or score, a session's affinity), the marks an answer leaves on one (cooled down, retired),
a game-day fault's marks, and when a pool has a usable credential again. Each is one Lua
script (health/redis_scripts.py); while Redis is away, the local state's answer."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fallback_mw.config import BreakerConfig
from fallback_mw.health.memory import MemoryHealth, breaker_credential_mark
from fallback_mw.health.pool import AFFINITY_LIMIT, SCORE_HALF_LIFE, Selection, score_outcome
from fallback_mw.health.redis_link import RedisLink
from fallback_mw.health.redis_outage import Unavailable
from fallback_mw.health.redis_scripts import (
    FAULT_MARKED,
    MARK,
    OBSERVE,
    PICK,
    POOL_FAULT,
    USABLE_IN,
)

T = TypeVar("T")

CREDENTIAL_TTL_MS = 24 * 3600 * 1000  # a retired credential stays retired this long
AFFINITY_TTL_MS = 3600 * 1000  # an idle session forgets its credential after this long


class RedisCredentialPools(RedisLink):
    """What RedisHealth does for credential pools; it sets what is declared here."""

    config: BreakerConfig
    local: MemoryHealth  # the state served while Redis is unreachable
    _pool_ids: dict[str, str]  # per upstream, its list of variables' own key suffix
    _pool_sizes: dict[str, int]
    _selections: dict[str, Selection]
    _furthest_end_ms: int

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
