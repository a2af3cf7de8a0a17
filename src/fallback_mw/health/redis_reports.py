"""What a process on the Redis health state reports of the shared breakers: its own
transitions, those of the local breakers it serves on while Redis is away, and the state
another process moved a breaker to, read at startup, at each admission and, while one it
reported is not closed, every `refresh_interval`: every process's gauge follows the shared
state (FallbackMwBreakerOpen fires and resolves with it)."""

from __future__ import annotations

import asyncio

from fallback_mw.health.events import TransitionListener
from fallback_mw.health.memory import report_transition
from fallback_mw.health.redis_link import RedisLink
from fallback_mw.health.redis_outage import Unavailable
from fallback_mw.health.redis_scripts import BREAKER_STATE

_STATE_AFTER = {"opened": "open", "reopened": "open"}  # other transitions name the state


class RedisBreakerReports(RedisLink):
    """What RedisHealth reports of the shared breakers; it sets what is declared here."""

    on_transition: TransitionListener | None
    on_observed: TransitionListener | None
    refresh_interval: float
    _upstreams: tuple[str, ...]  # read at startup (_started)
    _seen: dict[str, str]  # breaker state last reported, per upstream
    _refresh_timer: asyncio.TimerHandle | None
    _refreshing: asyncio.Task[None] | None

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
