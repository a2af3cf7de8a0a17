"""What health tells its listener (the gateway's telemetry), and the admission an attempt
carries from `admit` to its `record` / `release`. A leaf module: the health
implementations import it instead of the package that picks them (no import cycle)."""

from __future__ import annotations

from collections.abc import Callable

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
