"""Capacity planning: each route's observed peak per minute against what its fallbacks
declare they accept (`fallback-mw capacity`).

A full failover at peak sends a fallback everything the primary carried in its busiest
minute. For each route and each fallback this compares the route's peak requests and
tokens per minute (from the usage records) with the fallback's `rpm` and `tpm`:
`ratio = peak / limit`, and the fallback carries the peak when `peak x margin <= limit`.
A limit that is not declared, or a peak that was never observed, is unknown: reported as
such, never as fine."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from fractions import Fraction
from typing import Literal

from fallback_mw.budget import RollingPeak
from fallback_mw.config import RouteConfig, UpstreamConfig

Verdict = Literal["carries", "cannot_carry", "unknown"]


def needed_limit(peak: int, margin: float) -> int:
    """The least limit that carries `peak` with `margin`, in exact arithmetic: in floating
    point a peak past 2^53 lost its last digits."""
    return math.ceil(Fraction(peak) * Fraction(repr(margin)))


@dataclass(frozen=True, slots=True)
class Peak:
    """A route's busiest minute, for requests and for tokens (not always the same one)."""

    requests: int = 0
    requests_at: datetime | None = None
    tokens: int | None = None  # None: no request in the window reported usage
    tokens_at: datetime | None = None
    metered_share: float = 0.0  # share of the window's requests that reported usage


def peaks(rolling: Iterable[RollingPeak]) -> dict[str, Peak]:
    """Each route's busiest rolling minute (any 60 seconds, as `rpm` / `tpm` are enforced,
    not a clock minute: a burst across a minute's turn counts whole), as the ledger found
    it (`Ledger.rolling_peaks`). A peak's time is its window's first second."""
    return {
        p.route: Peak(
            requests=p.requests,
            requests_at=p.requests_at,
            tokens=p.tokens if p.metered else None,
            tokens_at=p.tokens_at if p.metered else None,
            metered_share=p.metered / p.total if p.total else 0.0,
        )
        for p in rolling
    }


@dataclass(frozen=True, slots=True)
class Dimension:
    """One limit (requests or tokens per minute) of one fallback against the peak."""

    peak: int | None
    limit: int | None

    @property
    def ratio(self) -> float | None:
        if self.peak is None or self.limit is None:
            return None
        return self.peak / self.limit

    def verdict(self, margin: float) -> Verdict:
        if self.peak is None or self.limit is None:
            return "unknown"
        return "carries" if needed_limit(self.peak, margin) <= self.limit else "cannot_carry"


@dataclass(frozen=True, slots=True)
class FallbackReport:
    name: str
    requests: Dimension
    tokens: Dimension
    verdict: Verdict


@dataclass(frozen=True, slots=True)
class RouteReport:
    route: str
    primary: str
    peak: Peak | None  # None: no usage record in the window
    fallbacks: tuple[FallbackReport, ...]


def assess(
    route: RouteConfig,
    upstreams: Mapping[str, UpstreamConfig],
    peak: Peak | None,
    margin: float,
) -> RouteReport:
    reports = []
    for name in route.plan[1:]:
        upstream = upstreams[name]
        requests = Dimension(peak.requests if peak else None, upstream.rpm)
        tokens = Dimension(peak.tokens if peak else None, upstream.tpm)
        verdicts = {requests.verdict(margin), tokens.verdict(margin)}
        if "cannot_carry" in verdicts:
            verdict: Verdict = "cannot_carry"
        elif "unknown" in verdicts:
            verdict = "unknown"
        else:
            verdict = "carries"
        reports.append(FallbackReport(name, requests, tokens, verdict))
    return RouteReport(route.id, route.plan[0], peak, tuple(reports))
