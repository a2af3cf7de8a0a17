"""Spans, metrics and the request log line (SPEC §9).

Redaction is by construction: every attribute, event field, metric attribute and log field
is built here, from an allowlist of gateway facts — route id, candidate names, counts,
status codes, failure kinds. Nothing reads a body, a header value (other than the W3C
trace context), a credential or a query string, so nothing can leak one. Exceptions are
never recorded (their messages are not ours to vouch for).

The library uses `opentelemetry-api` only; the host app (or `fallback-mw serve`, see
`otel_setup`) owns the SDK. Without an SDK every call is a cheap no-op.
"""

from fallback_mw.telemetry.breakers import normalise_breaker_state
from fallback_mw.telemetry.core import ATTEMPT_SPAN, REQUEST_SPAN, SKIP_EVENT, Telemetry
from fallback_mw.telemetry.shadow_spans import SHADOW_SPAN

__all__ = [
    "ATTEMPT_SPAN",
    "REQUEST_SPAN",
    "SHADOW_SPAN",
    "SKIP_EVENT",
    "Telemetry",
    "normalise_breaker_state",
]
