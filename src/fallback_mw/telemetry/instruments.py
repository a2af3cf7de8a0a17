"""The metric instruments one Telemetry records on (SPEC §9: requests, attempts, fallbacks
by route and candidate; durations; breaker transitions; skips; shadow copies). Attributes
are gateway facts only: labels, counts, status codes, failure kinds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

from opentelemetry import metrics
from opentelemetry.util.types import AttributeValue

from fallback_mw.request.context import SKIP_REASONS, AttemptRecord, RequestContext
from fallback_mw.request.local_errors import STATUS_FOR_CODE
from fallback_mw.telemetry.redact import label

# 6 s is the shipped FallbackMwLatencyP99Abort threshold (docs/alerts/): a quantile is
# interpolated inside its bucket, so without that boundary requests of 5.5 s read as a p99
# of 9.95 s and fired the abort.
DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 6, 10, 30, 60, 120, 300,
)  # fmt: skip


# At most this many series of one counter are exported at 0 (`Instruments.at_zero`): half
# the OpenTelemetry SDK's default limit of 2,000 series per instrument, past which the SDK
# counts every new series in one `otel.metric.overflow` series. At 12 `gateway.requests`
# series a route, 170 routes (loaded at once, or over a store's reloads: the SDK keeps a
# removed route's series) filled the limit with zeros, and every served request of every
# route was counted without its route. The series real traffic counts in keep the rest.
ZERO_SERIES_LIMIT = 1000

_SeriesKey = tuple[int, tuple[tuple[str, AttributeValue], ...]]  # (the counter's id, attributes)
_Series = tuple[metrics.Counter, dict[str, AttributeValue]]


def never_idle() -> bool:
    return False


class Tally:
    """A counter's per-request increments, counted here by attribute values and added to
    the counter once per attribute set when the metrics are collected (`flush`): the SDK's
    `add` (a `Measurement`, its attributes cleaned, hashed and matched to every view) costs
    about as much as the rest of the request's metric work, once per request; this costs a
    dict increment. Every collection flushes first (`Telemetry._observe_breakers`), so what
    a reader collects is what it would have collected from `add`; the counts carry no
    exemplars (they are added outside the request's span)."""

    __slots__ = ("_lock", "_pending", "counter")

    def __init__(self, counter: metrics.Counter) -> None:
        self.counter = counter  # what `flush` adds to (a series at 0 is added to it directly)
        self._lock = threading.Lock()  # the loop's thread adds, a reader's thread flushes
        self._pending: dict[tuple[tuple[str, AttributeValue], ...], int] = {}

    def add(self, attributes: Mapping[str, AttributeValue]) -> None:
        """One increment for these attributes (as `counter.add(1, attributes)` would)."""
        key = tuple(attributes.items())
        with self._lock:
            pending = self._pending
            pending[key] = pending.get(key, 0) + 1

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for key, count in pending.items():
            self.counter.add(count, dict(key))


class Instruments:
    def __init__(self, meter: metrics.Meter, *, idle: Callable[[], bool] = never_idle) -> None:
        # True while the recordings go nowhere (no SDK installed yet): the per-request
        # recordings then skip building their attributes.
        self.idle = idle
        # Series exported at 0 while no SDK was installed (`at_zero`), to be added again at
        # the first collection: each series once, however many store reloads named it (a
        # gateway reloading for weeks with no SDK ever installed kept every reload's).
        self._zeros: dict[_SeriesKey, _Series] = {}
        # The series each counter was exported at 0 in (by the counter's id), at most
        # ZERO_SERIES_LIMIT each: a series named again (a reload) is not one more.
        self._started: dict[int, set[tuple[tuple[str, AttributeValue], ...]]] = {}
        self.requests = Tally(
            meter.create_counter(
                "gateway.requests", unit="{request}", description="Routed requests, by outcome"
            )
        )
        self.attempts = Tally(
            meter.create_counter(
                "gateway.attempts", unit="{attempt}", description="Upstream requests made"
            )
        )
        self.fallbacks = Tally(
            meter.create_counter(
                "gateway.fallbacks",
                unit="{request}",
                description="Requests answered by a candidate other than the first of their order",
            )
        )
        self.skips = meter.create_counter(
            "gateway.skips",
            unit="{candidate}",
            description="Candidates skipped (breaker open, no usable credential)",
        )
        self.duration = meter.create_histogram(
            "gateway.request.duration",
            unit="s",
            description="Routed request duration, first byte in to last byte out",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.attempt_duration = meter.create_histogram(
            "gateway.attempt.duration",
            unit="s",
            description="Upstream attempt duration, until response headers or failure",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.transitions = meter.create_counter(
            "gateway.breaker.transitions",
            unit="{transition}",
            description="Breaker state changes, by upstream and new state",
        )
        self.shadows = meter.create_counter(
            "gateway.shadow.requests",
            unit="{request}",
            description="Shadow copies, by outcome (answered, failed, or why none was sent)",
        )
        self.shadow_duration = meter.create_histogram(
            "gateway.shadow.duration",
            unit="s",
            description="Shadow copy duration, request sent to answer read",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )

    def fallbacks_at_zero(self, route_id: str, plan: Sequence[str]) -> None:
        """The series a real fallback of this route counts in (served by a later candidate
        of its plan, no canary, no fault), at 0 before the first one: Prometheus's
        `increase` and `rate` ignore a series' first sample, so a counter that appears at 1
        read as no fallback at all (FallbackMwSilentFallback stayed silent)."""
        if self._zeros_full(self.fallbacks.counter):
            return
        for candidate in plan[1:]:
            self.at_zero(
                self.fallbacks.counter,
                {
                    "gateway.route.id": label(route_id),
                    "gateway.candidate": label(candidate),
                    "gateway.primary": label(plan[0]),
                    "gateway.outcome": "served",
                    "gateway.canary": False,
                    "gateway.fault": False,
                },
            )

    def errors_at_zero(self, route_id: str) -> None:
        """The route's `gateway.requests` series of each local error the gateway answers
        itself (no candidate chosen, no fallback, no canary, no fault; the status is the
        code's own), at 0 before the first one, for the same reason: a route that starts
        failing had its first errors missed by the error-rate rules' `rate` / `increase`.
        Outcomes whose labels depend on the request are not (`served`, `aborted`,
        `client_disconnected`, `cancelled`, `internal_error`: the candidate or status
        is the upstream's)."""
        if self._zeros_full(self.requests.counter):
            return
        route = label(route_id)
        for outcome, status in STATUS_FOR_CODE.items():
            if outcome == "config_error":  # answered before any route: never counted here
                continue
            self.at_zero(
                self.requests.counter,
                {
                    "gateway.route.id": route,
                    "gateway.outcome": outcome,
                    "gateway.fallback": False,
                    "gateway.canary": False,
                    "gateway.fault": False,
                    "gateway.candidate": "none",
                    "http.response.status_code": status,
                },
            )

    def skips_at_zero(self, route_id: str, plan: Sequence[str]) -> None:
        """Each candidate of the route's plan skipped for each reason (no fault), at 0
        before the first skip: `increase(gateway_skips_total[5m])` missed the first skips
        of a breaker that had just opened."""
        if self._zeros_full(self.skips):
            return
        route = label(route_id)
        for candidate in dict.fromkeys(plan):
            for reason in SKIP_REASONS:
                self.at_zero(
                    self.skips,
                    {
                        "gateway.route.id": route,
                        "gateway.candidate": label(candidate),
                        "gateway.skip.reason": reason,
                        "gateway.fault": False,
                    },
                )

    def transitions_at_zero(self, upstream: str) -> None:
        """An upstream's breaker transition series at 0 before its first transition, for
        the same reason: `increase(gateway_breaker_transitions_total[1d])` read a breaker
        that opened once as never opened."""
        if self._zeros_full(self.transitions):
            return
        for state in ("closed", "half_open", "open"):
            self.at_zero(
                self.transitions,
                {"gateway.upstream": label(upstream), "gateway.breaker.state": state},
            )

    def _zeros_full(self, counter: metrics.Counter) -> bool:
        """Whether `counter` holds ZERO_SERIES_LIMIT series at 0: `at_zero` adds none more
        (and one it holds is at 0 already), so the label sets need not be built. At 2,000
        routes a reload built 58,000 of them, a third of a second on the event loop."""
        return len(self._started.get(id(counter), ())) >= ZERO_SERIES_LIMIT

    def at_zero(self, counter: metrics.Counter, attributes: dict[str, AttributeValue]) -> None:
        key = tuple(attributes.items())
        started = self._started.setdefault(id(counter), set())
        if key not in started:
            if len(started) >= ZERO_SERIES_LIMIT:
                return  # the SDK's room is kept for the series traffic counts in
            started.add(key)
        counter.add(0, attributes)
        if self.idle():
            # The API's proxy drops what is added before an SDK is installed (a host app may
            # install it after building the gateway): added again at the first collection.
            self._zeros[(id(counter), key)] = (counter, attributes)

    def attempt(self, context: RequestContext, record: AttemptRecord, kind: str | None) -> None:
        if self.idle():
            return
        metric: dict[str, AttributeValue] = {
            "gateway.route.id": label(context.route.id),
            "gateway.candidate": label(record.candidate),
            "gateway.failure.kind": kind or "none",
            "gateway.fault": record.fault is not None,
            "gateway.canary": context.canary,
        }
        if record.status is not None:
            metric["http.response.status_code"] = record.status
        self.attempts.add(metric)
        duration = record.duration
        if duration is None:
            duration = time.monotonic() - record.started
        self.attempt_duration.record(max(duration, 0.0), metric)

    def request(
        self,
        context: RequestContext,
        outcome: str,
        candidates: list[str],
        chosen: str | None,
        fault: bool,
        duration: float,
    ) -> None:
        if self.idle():
            return
        route_id = label(context.route.id)
        common: dict[str, AttributeValue] = {
            "gateway.route.id": route_id,
            "gateway.outcome": label(outcome),
            "gateway.fallback": context.fallback,
            "gateway.canary": context.canary,
            "gateway.fault": fault,
        }
        counted: dict[str, AttributeValue] = {**common, "gateway.candidate": chosen or "none"}
        if context.status is not None:
            # What the client was answered: a 5xx relayed as `served` is still a server
            # error it got (the shipped rules count it with the error outcomes).
            counted["http.response.status_code"] = context.status
        self.requests.add(counted)
        self.duration.record(duration, common)
        if context.fallback and chosen is not None:
            self.fallbacks.add(
                {
                    "gateway.route.id": route_id,
                    "gateway.candidate": chosen,
                    "gateway.primary": candidates[0] if candidates else "none",
                    "gateway.outcome": label(outcome),
                    "gateway.canary": context.canary,
                    "gateway.fault": fault,
                }
            )

    def flush(self) -> None:
        """Add the counts waiting in the tallies to their counters (before a collection)."""
        if self._zeros and not self.idle():
            zeros, self._zeros = self._zeros, {}
            for counter, attributes in zeros.values():
                counter.add(0, attributes)
        for tally in (self.requests, self.attempts, self.fallbacks):
            tally.flush()
