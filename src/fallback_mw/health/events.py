"""What health tells its listener (the gateway's telemetry). A leaf module: the health
implementations import it instead of the package that picks them (no import cycle)."""

from __future__ import annotations

from collections.abc import Callable

# Told of every breaker transition: (upstream, new state: "closed"/"half_open"/"open").
TransitionListener = Callable[[str, str], None]
