"""The real alert state, from Prometheus's HTTP API (`GET /api/v1/alerts`), polled while a
game day runs: when each alert was first seen firing, and when it stopped. Only alert
names, states and times are kept (label values can name hosts; they are not reported).

Prometheus lists the whole fleet's alerts: only the instances about the exercise count —
an instance labelled with another route (`gateway_route_id`) or with an upstream outside
the route's plan (`gateway_upstream`) is another team's news, not the exercise's result.
An alert with neither label (one of your own) counts as it is."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

POLL_TIMEOUT_S = 3.0


class PrometheusURLError(ValueError):
    pass


def check_url(url: str) -> str:
    # Credentials first, read off the text: without its scheme (`admin:pw@prom:9090`)
    # urlsplit finds no userinfo, and the refusal quoted the URL, password and all.
    if "@" in url or "?" in url or "#" in url:
        raise PrometheusURLError("--prometheus: no credentials, query or fragment in the URL")
    try:
        parts = urlsplit(url)
        hostname = parts.hostname
    except ValueError:  # an unclosed `[`: one line, not an internal error
        hostname = None
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not hostname:
        raise PrometheusURLError(f"--prometheus {url!r}: expected http(s)://host:port")
    return url.rstrip("/")


@dataclass
class AlertSeen:
    pending_at: float | None = None  # epoch seconds, first poll that saw it pending/firing
    firing_at: float | None = None  # first poll that saw it firing
    resolved_at: float | None = None  # first poll after firing that no longer saw it firing


class PrometheusUnavailable(RuntimeError):
    pass


@dataclass
class AlertWatcher:
    url: str
    route: str | None = None  # the exercise's route: other routes' instances are ignored
    upstreams: frozenset[str] = frozenset()  # its plan: other upstreams' are ignored
    alerts: dict[str, AlertSeen] = field(default_factory=dict)
    polls: int = 0
    failures: int = 0
    last_error: str | None = None
    # Alerts already firing before the fault: not the exercise's doing until they resolve.
    firing_before: set[str] = field(default_factory=set)
    _session: aiohttp.ClientSession | None = None
    _in_flight: asyncio.Task[None] | None = None

    async def _states(self) -> dict[str, str]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=POLL_TIMEOUT_S)
            )
        try:
            async with self._session.get(self.url + "/api/v1/alerts") as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                payload: Any = await response.json(content_type=None)
            states: dict[str, str] = {}
            for alert in payload["data"]["alerts"]:
                if not isinstance(alert["labels"], dict):
                    # Not Prometheus's shape (a proxy's, another product's): a failed poll,
                    # as a refused one is; `.get` on it ended the game day in an internal
                    # error after the exercise, its report unwritten.
                    raise ValueError("an alert whose labels are not an object")
                if not self.concerns(alert["labels"]):
                    continue
                name = str(alert["labels"]["alertname"])
                state = str(alert["state"])
                if state not in ("pending", "firing"):
                    continue  # inactive: not listed by Prometheus, ignored if it were
                if states.get(name) != "firing":  # firing anywhere wins
                    states[name] = state
            return states
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            message = type(exc).__name__ if not str(exc) else str(exc)[:200]
            raise PrometheusUnavailable(message) from None

    def concerns(self, labels: dict[str, Any]) -> bool:
        """Whether an alert instance is about the exercise's route or one of its upstreams."""
        route = labels.get("gateway_route_id")
        if self.route is not None and route is not None and route != self.route:
            return False
        upstream = labels.get("gateway_upstream")
        return not (self.upstreams and upstream is not None and upstream not in self.upstreams)

    async def alert_rules(self) -> set[str] | None:
        """The names of the alerting rules Prometheus evaluates (`GET /api/v1/rules`), or
        None when it does not say (an API without it, an error): then nothing is checked."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=POLL_TIMEOUT_S)
            )
        try:
            async with self._session.get(
                self.url + "/api/v1/rules", params={"type": "alert"}
            ) as response:
                if response.status != 200:
                    return None
                payload: Any = await response.json(content_type=None)
            names = set()
            for group in payload["data"]["groups"]:
                for rule in group["rules"]:
                    if not isinstance(rule, dict):  # not Prometheus's shape: it does not say
                        return None
                    if rule.get("type", "alerting") == "alerting":
                        names.add(str(rule["name"]))
            return names
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            return None

    async def baseline(self) -> None:
        """Before the fault: Prometheus answers (else PrometheusUnavailable), and which
        alerts already fire (they are not credited to the exercise while they do)."""
        states = await self._states()
        self.firing_before = {name for name, state in states.items() if state == "firing"}

    async def poll(self, now: float | None = None) -> None:
        """One look at the alert state; a failed poll is counted, never raised (the
        exercise goes on; the report says how many polls failed). Without `now`, what it
        saw is dated when Prometheus answered: an alert first seen firing in a slow answer
        is not dated back to when the question was sent (a prediction is an upper bound)."""
        self.polls += 1
        try:
            states = await self._states()
        except PrometheusUnavailable as exc:
            self.failures += 1
            self.last_error = str(exc)
            return
        now = time.time() if now is None else now
        self.firing_before &= {name for name, state in states.items() if state == "firing"}
        for name in self.firing_before:
            states.pop(name, None)  # still the old firing: not this exercise's
        for name, state in states.items():
            seen = self.alerts.setdefault(name, AlertSeen())
            if seen.pending_at is None:
                seen.pending_at = now
            if state == "firing":
                if seen.firing_at is None:
                    seen.firing_at = now
                seen.resolved_at = None  # firing again
        for name, seen in self.alerts.items():
            firing = states.get(name) == "firing"
            if seen.firing_at is not None and not firing and seen.resolved_at is None:
                seen.resolved_at = now

    def poll_soon(self) -> None:
        """Start a poll unless one is still in flight, without waiting for it: a slow or
        hung Prometheus (each poll may take POLL_TIMEOUT_S) must not delay the exercise's
        loop, whose abort criteria, Ctrl-C and end clear the fault at once."""
        if self._in_flight is None or self._in_flight.done():
            self._in_flight = asyncio.ensure_future(self.poll())

    async def settle(self) -> None:
        """Wait for the poll in flight, if any (before the alert state is reported)."""
        if self._in_flight is not None:
            await self._in_flight
            self._in_flight = None

    def all_resolved(self) -> bool:
        return all(s.firing_at is None or s.resolved_at is not None for s in self.alerts.values())

    def summary(self, t0: float) -> dict[str, Any]:
        def rel(moment: float | None) -> float | None:
            return None if moment is None else round(moment - t0, 3)

        return {
            "url": self.url,
            "polls": self.polls,
            "failed_polls": self.failures,
            "last_error": self.last_error,
            "firing_before_the_fault": sorted(self.firing_before),
            "alerts": {
                name: {
                    "pending_s": rel(seen.pending_at),
                    "firing_s": rel(seen.firing_at),
                    "resolved_s": rel(seen.resolved_at),
                }
                for name, seen in sorted(self.alerts.items())
            },
        }

    async def aclose(self) -> None:
        if self._in_flight is not None:
            self._in_flight.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._in_flight
            self._in_flight = None
        if self._session is not None:
            await self._session.close()
            self._session = None
