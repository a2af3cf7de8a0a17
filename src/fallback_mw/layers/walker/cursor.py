"""The candidate cursor: which candidate (and which credential) the walk tries next.

Plan order, passes and skips (SPEC §5): each further attempt goes to the next candidate;
after the last one the walk restarts from the top, and repeating a candidate already tried
waits `backoff_ms` first. A candidate whose breaker is open, or with no usable
credential, or whose declared capacity (`rpm`/`tpm`) this attempt would exceed, is
skipped: it costs no attempt. A whole pass in which every candidate was skipped ends the
walk (`NO_CANDIDATE`); so does a repeat that the upstream's repeat budget refuses
(`REPEAT_BUDGET_SPENT`, left in `ended`). The pool rule (SPEC §6): a pool's credentials
are each used at most once per request; a single-credential upstream may be repeated on a
later pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fallback_mw.capacity import Admission, Ask, CapacityState
from fallback_mw.config import UpstreamConfig
from fallback_mw.failover.decide import NO_CANDIDATE, REPEAT_BUDGET_SPENT, Outcome
from fallback_mw.health import HealthState
from fallback_mw.request.context import RequestContext, SkipRecord
from fallback_mw.telemetry import Telemetry


@dataclass(frozen=True, slots=True)
class Pick:
    name: str
    upstream: UpstreamConfig
    credential_index: int | None
    repeat: bool  # already tried in this request: backoff_ms before it
    admission: Admission  # as counted by the capacity state (declared capacity, repeat budget)


class CandidateCursor:
    def __init__(
        self,
        order: Sequence[str],
        upstreams: Mapping[str, UpstreamConfig],
        health: HealthState,
        *,
        session: str | None,
        has_credential: Callable[[str, int], bool],
        on_skip: Callable[[str, str], None],
        capacity: CapacityState,
        ask: Callable[[str, UpstreamConfig, bool], Ask],
    ) -> None:
        self.order = list(order)
        self.upstreams = upstreams
        self.health = health
        self.session = session
        self.has_credential = has_credential
        self.on_skip = on_skip
        self.capacity = capacity
        self.ask = ask
        self.ended: Outcome = NO_CANDIDATE  # why pick() returned None
        self.used: dict[str, set[int]] = {}
        self.tried: set[str] = set()
        self._position = 0
        self._attempted_in_pass = False
        self._same_again = False

    def pool_size(self, name: str) -> int:
        return len(self.upstreams[name].credential_envs)

    def other_credential(self, name: str) -> bool:
        """A pool upstream with a credential this request has not used yet."""
        pool = self.pool_size(name)
        return pool > 1 and len(self.used.get(name, ())) < pool

    def same_upstream_again(self) -> None:
        """The next pick is the upstream just tried, with another of its credentials."""
        self._same_again = True

    def mark_used(self, name: str, credential_index: int | None) -> None:
        if credential_index is not None:
            self.used.setdefault(name, set()).add(credential_index)
        self.tried.add(name)
        self._attempted_in_pass = True

    async def pick(self) -> Pick | None:
        """The next candidate to attempt, recording the ones skipped; None when none is
        left (a whole pass skipped)."""
        order = self.order
        while True:
            if self._same_again:
                self._position -= 1
                self._same_again = False
            elif self._position and self._position % len(order) == 0:
                if not self._attempted_in_pass:
                    return None  # a whole pass with every candidate skipped
                self._attempted_in_pass = False
                for name in list(self.used):
                    if self.pool_size(name) < 2:
                        del self.used[name]  # a single credential may be used again
            name = order[self._position % len(order)]
            self._position += 1
            upstream = self.upstreams[name]
            credential_index: int | None = None
            pool = len(upstream.credential_envs)
            if pool:
                credential_index = await self.health.pick_credential(
                    name,
                    pool,
                    exclude=frozenset(self.used.get(name, ())),
                    session=self.session,
                )
                if credential_index is None or not self.has_credential(name, credential_index):
                    self.on_skip(name, "no_credential")
                    continue
            if not await self.health.admit(name):
                self.on_skip(name, "breaker_open")
                continue
            repeat = name in self.tried
            admission = await self.capacity.admit(name, self.ask(name, upstream, repeat))
            if isinstance(admission, str):
                await self.health.release(name)  # a half-open probe slot it held is freed
                self.on_skip(name, admission)
                if admission == "repeat_budget":
                    self.ended = REPEAT_BUDGET_SPENT
                    return None
                continue
            return Pick(name, upstream, credential_index, repeat, admission)

    async def pick_hedge_credential(self, name: str, credential_index: int | None) -> int | None:
        """The credential a hedge at `name` uses: in a pool another one (each at most once
        per request), else the same. Returns -1 when no credential is left."""
        pool = self.pool_size(name)
        if pool < 2:
            return credential_index
        found = await self.health.pick_credential(
            name, pool, exclude=frozenset(self.used.get(name, ())), session=self.session
        )
        return -1 if found is None else found


def skip_recorder(context: RequestContext, telemetry: Telemetry) -> Callable[[str, str], None]:
    """Records a skip in the context and telemetry (no reference back to the walk)."""

    def skip(name: str, reason: str) -> None:
        context.skipped.append(
            SkipRecord(candidate=name, reason=reason, after_attempts=context.attempt_count)
        )
        telemetry.skipped(context, name, reason)

    return skip
