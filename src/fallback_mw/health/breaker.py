"""The circuit breaker of SPEC §6 as a pure state machine: no clock, no I/O.

closed    every attempt admitted; the last `window` outcomes are kept. When the window
          holds at least `min_calls` outcomes and the failover-class failure rate reaches
          `failure_rate`, the breaker opens with the base cooldown.
open      nothing admitted until the cooldown has passed; outcomes are ignored.
half_open exactly one probe admitted at a time. A failed probe reopens the breaker with
          the cooldown doubled (capped at `max_cooldown_ms`); a successful one closes it and
          resets the window and the cooldown. A probe that never reports (its request was
          cancelled) loses its slot after `probe_lease` seconds.

The Redis state runs the same machine in Lua (health/redis.py); keep the two in step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from fallback_mw.config import BreakerConfig

BreakerState = Literal["closed", "open", "half_open"]
Transition = Literal["opened", "half_open", "reopened", "closed"]

DEFAULT_PROBE_LEASE = 30.0  # seconds; longer than any sane first-byte timeout


@dataclass(slots=True)
class Breaker:
    config: BreakerConfig
    probe_lease: float = DEFAULT_PROBE_LEASE
    state: BreakerState = "closed"
    outcomes: deque[bool] = field(default_factory=deque)  # True = failover-class failure
    cooldown: float = 0.0  # seconds of the current (or next) open period
    open_until: float = 0.0
    probe_until: float | None = None  # half-open: the probe's lease, None = slot free

    def __post_init__(self) -> None:
        self.outcomes = deque(maxlen=self.config.window)
        self.cooldown = self.base_cooldown

    @property
    def base_cooldown(self) -> float:
        return self.config.cooldown_ms / 1000

    @property
    def max_cooldown(self) -> float:
        return max(self.config.max_cooldown_ms, self.config.cooldown_ms) / 1000

    def admit(self, now: float) -> tuple[bool, Transition | None]:
        """May an attempt run now? Returns (admitted, transition)."""
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
        self.probe_until = now + self.probe_lease
        return True, transition

    def record(self, *, failure: bool, now: float) -> Transition | None:
        """The outcome of an admitted attempt; returns the transition it caused, if any."""
        if self.state == "closed":
            self.outcomes.append(failure)
            calls = len(self.outcomes)
            if calls >= self.config.min_calls and (
                sum(self.outcomes) / calls >= self.config.failure_rate
            ):
                self._open(now, self.base_cooldown)
                return "opened"
            return None
        if self.state == "open" or self.probe_until is None:
            return None  # a straggler admitted before the breaker opened
        if failure:
            self._open(now, min(self.cooldown * 2, self.max_cooldown))
            return "reopened"
        self.state = "closed"
        self.outcomes.clear()
        self.cooldown = self.base_cooldown
        self.probe_until = None
        return "closed"

    def release(self) -> None:
        """An admitted attempt ended for a reason that says nothing of the upstream (the
        caller's deadline, a hang-up): a half-open probe slot is freed, nothing recorded."""
        if self.state == "half_open":
            self.probe_until = None

    def _open(self, now: float, cooldown: float) -> None:
        self.state = "open"
        self.cooldown = cooldown
        self.open_until = now + cooldown
        self.probe_until = None
        self.outcomes.clear()
