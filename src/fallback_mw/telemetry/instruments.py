"""The metric instruments one Telemetry records on (SPEC §9: requests, attempts, fallbacks
by route and candidate; durations; breaker transitions; skips; shadow copies). Attributes
are gateway facts only: labels, counts, status codes, failure kinds."""

from __future__ import annotations

import time
from collections.abc import Callable

from opentelemetry import metrics
from opentelemetry.util.types import AttributeValue

from fallback_mw.request.context import AttemptRecord, RequestContext
from fallback_mw.telemetry.redact import label

# 6 s is the shipped FallbackMwLatencyP99Abort threshold (docs/alerts/): a quantile is
# interpolated inside its bucket, so without that boundary requests of 5.5 s read as a p99
# of 9.95 s and fired the abort.
DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 6, 10, 30, 60, 120, 300,
)  # fmt: skip


def never_idle() -> bool:
    return False


class Instruments:
    def __init__(self, meter: metrics.Meter, *, idle: Callable[[], bool] = never_idle) -> None:
        # True while the recordings go nowhere (no SDK installed yet): the per-request
        # recordings then skip building their attributes.
        self.idle = idle
        self.requests = meter.create_counter(
            "gateway.requests", unit="{request}", description="Routed requests, by outcome"
        )
        self.attempts = meter.create_counter(
            "gateway.attempts", unit="{attempt}", description="Upstream requests made"
        )
        self.fallbacks = meter.create_counter(
            "gateway.fallbacks",
            unit="{request}",
            description="Requests answered by a candidate other than the first of their order",
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
        self.attempts.add(1, metric)
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
        self.requests.add(1, {**common, "gateway.candidate": chosen or "none"})
        self.duration.record(duration, common)
        if context.fallback and chosen is not None:
            self.fallbacks.add(
                1,
                {
                    "gateway.route.id": route_id,
                    "gateway.candidate": chosen,
                    "gateway.primary": candidates[0] if candidates else "none",
                    "gateway.outcome": label(outcome),
                    "gateway.canary": context.canary,
                    "gateway.fault": fault,
                },
            )
