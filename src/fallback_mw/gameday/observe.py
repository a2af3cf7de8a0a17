"""What a game day observes, from usage records."""

from __future__ import annotations

# Outcomes that are the caller's own doing, never a customer-visible error. The shipped
# alert rules (docs/alerts/fallback_mw.rules.yml) exclude exactly these and `served`.
CALLER_OUTCOMES = frozenset(
    {
        "client_disconnected",
        "budget_exceeded",
        "bad_request",
        "request_too_large",
        "headers_too_large",
        "request_timeout",
    }
)
