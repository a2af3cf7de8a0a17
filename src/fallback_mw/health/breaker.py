"""The circuit breaker of SPEC §6 as a pure state machine: no clock, no I/O.

closed    every attempt admitted; the last `window` outcomes are kept. When the window
          holds at least `min_calls` outcomes and the failover-class failure rate reaches
          `failure_rate`, the breaker opens with the base cooldown.
open      nothing admitted until the cooldown has passed; outcomes are ignored.
half_open exactly one probe admitted at a time. A failed probe reopens the breaker with
          the cooldown doubled (capped at `max_cooldown_ms`); a successful one closes it and
          resets the window and the cooldown. A probe that never reports (its request was
          cancelled) loses its slot after its lease: the `lease` it was admitted with (the
          upstream's, `upstream_probe_lease`: longer than the upstream may take), never
          less than `probe_lease` seconds.

Fault attribution (SPEC §12): an outcome may come from a game-day fault (`fault` names it).
A breaker remembers in `fault` whether fault outcomes opened it: on opening, when the
window's fault failures alone reach `failure_rate`; on reopening, when the failed probe was
a fault. While it is open or half-open, skips it causes are the fault's. `reset_fault`
(the fault was cleared) closes a breaker that a fault opened (window and cooldown reset)
and drops fault outcomes from a closed breaker's window; a breaker real failures opened is
left alone.

Only the probe decides a half-open breaker: an attempt admitted while it was closed that
ends while it is half-open (its answer, or its caller gone) says nothing of the probe and
frees no slot. `admit` numbers each probe (`probe_owner`); `record` and `release` name the
admission they end (`probe`: that number, "" for a closed breaker's admission, None when
the caller does not say, taken as the probe's).

The Redis state runs the same machine in Lua (health/redis.py); keep the two in step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final, Literal

from fallback_mw.config import MAX_DEADLINE_MS, BreakerConfig
from fallback_mw.config.views import AnyUpstream

BreakerState = Literal["closed", "open", "half_open"]
Transition = Literal["opened", "half_open", "reopened", "closed"]

DEFAULT_PROBE_LEASE: Final = 30.0  # seconds: the least a half-open probe holds its slot
PROBE_LEASE_MARGIN: Final = 5.0  # seconds past the longest a probe's attempt can take


def upstream_probe_lease(upstream: AnyUpstream) -> float:
    """Seconds a half-open probe on `upstream` holds its slot unless it reports first: the
    longest the upstream may take to answer it (the connect and first-byte timeouts, never
    more than the longest walk deadline, which ends any attempt) plus a margin. A second
    probe admitted while the first still waits would break "one probe at a time" (SPEC §6)."""
    connect, first_byte = upstream.connect_timeout_ms, upstream.first_byte_timeout_ms
    return min(connect + first_byte, MAX_DEADLINE_MS) / 1000 + PROBE_LEASE_MARGIN


@dataclass(slots=True)
class Breaker:
    config: BreakerConfig
    probe_lease: float = DEFAULT_PROBE_LEASE
    state: BreakerState = "closed"
    # 0 success, 1 failover-class failure, 2 failure a game-day fault caused
    outcomes: deque[int] = field(default_factory=deque)
    cooldown: float = 0.0  # seconds of the current (or next) open period
    open_until: float = 0.0
    probe_until: float | None = None  # half-open: the probe's lease, None = slot free
    fault: str | None = None  # open / half-open: the fault whose outcomes opened it
    last_fault: str | None = None  # closed: the latest fault outcome's kind in the window
    # closed by a fault's reset (and not opened since): that fault. A skip refused by the
    # open breaker just before the reset asks `open_fault` after it, and is the fault's.
    reset_by: str | None = None
    probe_owner: int = 0  # half-open: the number of the probe that holds the slot

    def __post_init__(self) -> None:
        self.outcomes = deque(maxlen=self.config.window)
        self.cooldown = self.base_cooldown

    @property
    def base_cooldown(self) -> float:
        return self.config.cooldown_ms / 1000

    @property
    def max_cooldown(self) -> float:
        return max(self.config.max_cooldown_ms, self.config.cooldown_ms) / 1000

    def admit(self, now: float, lease: float = 0.0) -> tuple[bool, Transition | None]:
        """May an attempt run now? Returns (admitted, transition). A half-open probe holds
        its slot for `lease` seconds (at least `probe_lease`) unless it reports first."""
        transition: Transition | None = None
        if self.state == "closed":
            return True, None
        if self.state == "open":
            if now < self.open_until:
                return False, None
            self.state = "half_open"
            self.probe_until = None
            transition = "half_open"
        if self.probe_until is not None and now < self.probe_until:
            return False, transition
        self.probe_until = now + max(self.probe_lease, lease)
        self.probe_owner += 1
        return True, transition

    def admission(self) -> str:
        """Right after an `admit` that said yes: who it admitted, for `record` / `release`
        (the probe's number, "" for a closed breaker's admission)."""
        return str(self.probe_owner) if self.state == "half_open" else ""

    def record(
        self, *, failure: bool, now: float, fault: str | None = None, probe: str | None = None
    ) -> Transition | None:
        """The outcome of an admitted attempt (`fault`: the game-day fault that produced
        it; `probe`: its `admission()`); returns the transition it caused, if any."""
        faulted = failure and fault is not None
        if self.state == "closed":
            self.outcomes.append(2 if faulted else 1 if failure else 0)
            if faulted:
                self.last_fault = fault
            calls = len(self.outcomes)
            failures = calls - self.outcomes.count(0)  # deque.count: no Python loop
            if calls >= self.config.min_calls and failures / calls >= self.config.failure_rate:
                by_fault = self.outcomes.count(2) / calls
                self._open(now, self.base_cooldown)
                self.fault = self.last_fault if by_fault >= self.config.failure_rate else None
                return "opened"
            return None
        if self.state == "open" or self.probe_until is None or not self._is_probe(probe):
            return None  # a straggler admitted before the breaker opened, or a stale probe
        if failure:
            self._open(now, min(self.cooldown * 2, self.max_cooldown))
            self.fault = fault if faulted else None
            return "reopened"
        self._close()
        return "closed"

    def reset_fault(self) -> Transition | None:
        """A fault was cleared: close the breaker if fault outcomes opened it (window and
        cooldown reset); a closed breaker forgets its fault outcomes. Returns "closed" when
        it closed the breaker."""
        if self.state == "closed":
            kept = [o for o in self.outcomes if o != 2]
            if len(kept) != len(self.outcomes):
                self.outcomes.clear()
                self.outcomes.extend(kept)
            self.last_fault = None
            return None
        if self.fault is None:
            return None  # real failures opened it: left alone
        reset_by = self.fault
        self._close()
        self.reset_by = reset_by
        return "closed"

    def admits_in(self, now: float) -> float:
        """Seconds until the breaker admits an attempt again: an open one when its cooldown
        ends; 0 otherwise (a half-open probe in flight reports soon, and frees its slot)."""
        return max(self.open_until - now, 0.0) if self.state == "open" else 0.0

    def open_fault(self) -> str | None:
        """The fault whose outcomes opened this breaker, while it is not closed."""
        return None if self.state == "closed" else self.fault

    def skip_fault(self) -> str | None:
        """The fault a skip this breaker refused is booked to: `open_fault`, or, once
        closed by a fault's reset (and not opened since), that fault: a refusal made just
        before the reset asks after it."""
        return self.reset_by if self.state == "closed" else self.fault

    def _close(self) -> None:
        self.state = "closed"
        self.outcomes.clear()
        self.cooldown = self.base_cooldown
        self.probe_until = None
        self.fault = self.last_fault = None

    def release(self, probe: str | None = None) -> None:
        """An admitted attempt ended for a reason that says nothing of the upstream (the
        caller's deadline, a hang-up): the half-open probe slot it held is freed, nothing
        recorded."""
        if self.state == "half_open" and self._is_probe(probe):
            self.probe_until = None

    def _is_probe(self, probe: str | None) -> bool:
        return probe is None or probe == str(self.probe_owner)

    def _open(self, now: float, cooldown: float) -> None:
        self.state = "open"
        self.reset_by = None
        self.cooldown = cooldown
        self.open_until = now + cooldown
        self.probe_until = None
        self.outcomes.clear()
