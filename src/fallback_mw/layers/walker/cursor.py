"""The candidate cursor: which candidate (and which credential) the walk tries next.

Plan order, passes and skips (SPEC §5): each further attempt goes to the next candidate;
after the last one the walk restarts from the top, and repeating a candidate already tried
waits `backoff_ms` first. A candidate whose breaker is open, or with no usable
credential, or whose declared capacity (`rpm`/`tpm`) this attempt would exceed, is
skipped: it costs no attempt. A whole pass in which every candidate was skipped ends the
walk (`NO_CANDIDATE`); so does a repeat that the upstream's repeat allowance refuses
(`REPEAT_ALLOWANCE_SPENT`). After a pool's 401/403/429 the next pick is that upstream
again, with another credential, or `NO_OTHER_CREDENTIAL` when none can be tried. `pick`
returns the next `Pick` or the `Outcome` that ended the pass; what happens then is
`decide`'s. The gates themselves (the breaker, capacity, the repeat allowance) are the
attempt lifecycle's (`failover.attempt.AttemptLifecycle.gate`). The pool
rule (SPEC §6): a pool's credentials are each used at most once per request; a
single-credential upstream may be repeated on a later pass.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Final, NamedTuple, Protocol

from fallback_mw.capacity import Reservation
from fallback_mw.config.views import AnyUpstream
from fallback_mw.failover.outcome import (
    NO_CANDIDATE,
    NO_OTHER_CREDENTIAL,
    REPEAT_ALLOWANCE_SPENT,
    Outcome,
)
from fallback_mw.health import HealthState, immediate_health
from fallback_mw.request.context import RequestContext, SkipRecord
from fallback_mw.telemetry import Telemetry


class Pick(NamedTuple):  # a tuple: made for every attempt, cheaply (as capacity's Ask)
    name: str
    upstream: AnyUpstream
    credential_index: int | None
    repeat: bool  # already tried in this request: backoff_ms before it
    reservation: Reservation  # counted by capacity (declared capacity, repeat allowance)


# (name, upstream, repeat) -> the reservation, or the skip reason
Gate = Callable[[str, AnyUpstream, bool], Awaitable[Reservation | str]]


class SkipListener(Protocol):
    """Told of each skipped candidate; `fault` names the game-day fault whose outcomes
    opened the breaker behind a `breaker_open` skip (the skip is the fault's, SPEC §12)."""

    def __call__(self, name: str, reason: str, fault: str | None = None) -> None: ...


_NONE_USED: Final[frozenset[int]] = frozenset()


class CandidateCursor:
    def __init__(
        self,
        order: Sequence[str],
        upstreams: Mapping[str, AnyUpstream],
        health: HealthState,
        session: str | None,  # the affinity key (health.pool.affinity_key)
        has_credential: Callable[[str, int], bool],
        on_skip: SkipListener,
        gate: Gate,
    ) -> None:
        self.order = list(order)
        self.upstreams = upstreams
        self.health = health
        self._health_now = immediate_health(health)  # a memory state: no coroutine per pick
        self.session = session
        self.has_credential = has_credential
        self.on_skip = on_skip
        self.gate = gate
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

    async def pick(self) -> Pick | Outcome:
        """The next candidate to attempt, recording the ones skipped; else the outcome
        that ended the walk's passes (`NO_CANDIDATE`, `REPEAT_ALLOWANCE_SPENT`)."""
        order = self.order
        while True:
            # Another credential of the upstream just tried (a pool's 401/403/429): when
            # none can be tried, that answer is served, never another upstream's.
            same_again = self._same_again
            if same_again:
                self._position -= 1
                self._same_again = False
            elif self._position and self._position % len(order) == 0:
                if not self._attempted_in_pass:
                    return NO_CANDIDATE  # a whole pass with every candidate skipped
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
                # The shared empty set while none of its credentials is used (the first
                # pick of every request): no set made for it.
                used = frozenset(self.used[name]) if name in self.used else _NONE_USED
                now = self._health_now
                if now is not None:
                    credential_index = now.pick_credential_now(
                        name, pool, used, self.session, upstream.selection
                    )
                else:
                    credential_index = await self.health.pick_credential(
                        name, pool, exclude=used, session=self.session,
                        selection=upstream.selection,
                    )  # fmt: skip
                if credential_index is None or not self.has_credential(name, credential_index):
                    # A pool a fault emptied (e.g. `revoke`): the skip is the fault's.
                    self.on_skip(name, "no_credential", await self.health.pool_fault(name))
                    if same_again:
                        return NO_OTHER_CREDENTIAL
                    continue
            repeat = name in self.tried
            verdict = await self.gate(name, upstream, repeat)
            if isinstance(verdict, str):
                fault = None
                if verdict == "breaker_open":
                    fault = await self.health.skip_fault(name)
                self.on_skip(name, verdict, fault)
                if same_again:
                    return NO_OTHER_CREDENTIAL
                if verdict == "repeat_budget":
                    return REPEAT_ALLOWANCE_SPENT
                continue
            self.mark_used(name, credential_index)
            return Pick(name, upstream, credential_index, repeat, verdict)

    async def pick_hedge(self, primary: Pick, credential_index: int | None) -> Pick | None:
        """A hedge at the primary's upstream: in a pool another credential (each at most
        once per request), else the same one; admitted like a repeat. None when it may not
        run (no credential left, the breaker's probe slot taken, capacity or the repeat
        allowance refusing: only those are recorded as skips)."""
        name, upstream = primary.name, primary.upstream
        pool = self.pool_size(name)
        if pool >= 2:
            # No session: a hedge says nothing against the session's credential (it may
            # well win the race), so it must not rebind the session to the hedge's.
            credential_index = await self.health.pick_credential(
                name, pool, exclude=frozenset(self.used.get(name, ())), session=None,
                selection=upstream.selection,
            )  # fmt: skip
            if credential_index is None or not self.has_credential(name, credential_index):
                return None  # never sent without its credential (unset at run time)
        verdict = await self.gate(name, upstream, True)
        if isinstance(verdict, str):
            if verdict != "breaker_open":  # e.g. the primary attempt is the half-open probe
                self.on_skip(name, verdict)
            return None
        self.mark_used(name, credential_index)
        return Pick(name, upstream, credential_index, True, verdict)


def skip_recorder(context: RequestContext, telemetry: Telemetry) -> SkipListener:
    """Records a skip in the context and telemetry (no reference back to the walk)."""

    def skip(name: str, reason: str, fault: str | None = None) -> None:
        context.skipped.append(
            SkipRecord(
                candidate=name, reason=reason, after_attempts=context.attempt_count, fault=fault
            )
        )
        telemetry.skipped(context, name, reason, fault=fault)

    return skip
