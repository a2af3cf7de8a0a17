"""What health tells its listener (the gateway's telemetry), the admission an attempt
carries from `admit` to its `record` / `release`, and the synchronous face of a state that
never waits (`ImmediateHealth`). A leaf module: the health implementations import it
instead of the package that picks them (no import cycle)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from fallback_mw.health.pool import Selection

# Told of every breaker transition: (upstream, new state: "closed"/"half_open"/"open").
TransitionListener = Callable[[str, str], None]


class Admission:
    """One attempt's admission by a breaker, filled in by `admit` and handed to the `record`
    or `release` that ends the attempt: `probe` names the half-open probe it is ("" when a
    closed breaker admitted it). Only the probe's own outcome decides a half-open breaker."""

    __slots__ = ("breaker", "origin", "probe")

    def __init__(self) -> None:
        self.probe: str | None = None  # None: not admitted (yet)
        # The memory state's breaker that admitted it: once the upstream's url changed
        # (`forget`), its outcome judged the old url and goes to no breaker.
        self.breaker: object | None = None
        # The Redis state's mark of the url the upstream stood for in this process when it
        # was admitted (the same rule: an outcome of the old url goes to no breaker).
        self.origin: object | None = None


class ImmediateHealth(Protocol):
    """The calls of the request path, answered at the call by a state that never waits
    (the memory state): the answers its `HealthState` coroutines give, which are these
    calls (one copy of the logic). Asked through `immediate_health`, the attempt lifecycle
    and the cursor spend no coroutine on each (about 700 instructions apiece)."""

    def admit_now(self, upstream: str, lease: float, admission: Admission | None) -> bool: ...

    def record_now(
        self, upstream: str, failure: bool, fault: str | None, admission: Admission | None
    ) -> None: ...

    def release_now(self, upstream: str, admission: Admission | None) -> None: ...

    def pick_credential_now(
        self,
        upstream: str,
        pool_size: int,
        exclude: frozenset[int],
        session: str | None,
        selection: Selection,
    ) -> int | None: ...

    def pooled(self, upstream: str) -> bool:
        """Whether `credential_result_now` keeps anything for this upstream (a pool): asked
        first, so a single credential's answer is not read for a Retry-After or a quota."""
        ...

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
    ) -> None: ...


# The classes whose instances are their own `ImmediateHealth` (each adds itself where it
# is defined). By exact type: a subclass may override the coroutines (a test's double, a
# host's state), and is then asked through them.
IMMEDIATE_HEALTH: set[type] = set()


def immediate_health(health: object) -> ImmediateHealth | None:
    """`health` answering at the call, when it is a state that never waits; else None."""
    return health if type(health) in IMMEDIATE_HEALTH else None  # type: ignore[return-value]
