"""The one log line per routed request (`fallback_mw.request`): failovers and local
errors at WARNING, every other request at INFO (off unless the host turns it on). Fields
are gateway facts only, never a header value, body or query string."""

from __future__ import annotations

import logging
from typing import Any

from fallback_mw.request.context import RequestContext
from fallback_mw.telemetry.redact import label

logger = logging.getLogger("fallback_mw.request")
# Outcomes that are the caller's or the upstream's doing, not a gateway failure.
QUIET_OUTCOMES = frozenset({"served", "client_disconnected"})


def log_request(
    context: RequestContext,
    outcome: str,
    candidates: list[str],
    chosen: str | None,
    fault: bool,
    duration: float,
    trace_id: str | None,
    span_id: str | None,
) -> None:
    # Failovers (a further attempt, or a fallback served) and local errors are WARNING:
    # Python's default logging shows them under any host. Every other request's line is
    # INFO, off unless the host turns it on (docs/telemetry.md).
    quiet = outcome in QUIET_OUTCOMES and context.attempt_count <= 1 and not context.fallback
    level = logging.INFO if quiet else logging.WARNING
    if not logger.isEnabledFor(level):
        return
    duration_ms = round(duration * 1000, 1)
    fields: dict[str, Any] = {
        "route": label(context.route.id),
        "tenant": label(context.tenant),
        "method": label(context.method),
        "candidates": candidates,
        "chosen": chosen,
        "attempts": context.attempt_count,
        "attempt_candidates": [label(a.candidate) for a in context.attempts],
        "skipped": [label(s.candidate) for s in context.skipped],
        "outcome": label(outcome),
        "status": context.status,
        "fallback": context.fallback,
        "canary": context.canary,
        "fault": fault,
        "duration_ms": duration_ms,
        "request_id": context.request_id,
        "trace_id": trace_id,
        "span_id": span_id,
    }
    logger.log(
        level,
        "gateway request route=%s outcome=%s status=%s chosen=%s attempts=%d "
        "candidates=%s duration_ms=%.1f",
        fields["route"],
        fields["outcome"],
        context.status if context.status is not None else "-",
        chosen or "-",
        context.attempt_count,
        ",".join(candidates) or "-",
        duration_ms,
        extra=fields,
    )
