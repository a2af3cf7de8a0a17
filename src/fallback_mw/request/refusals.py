"""The local errors for a request body the gateway will not forward (over the limit, too
slow), one wording for every layer that meets one: the budget guard, which reads the body
for its estimate, and the walker's preflight."""

from __future__ import annotations

from fallback_mw.config import GatewaySettings
from fallback_mw.request.context import RequestBody


def body_refusal(body: RequestBody, settings: GatewaySettings) -> tuple[str, str] | None:
    """(code, message) for a body over `max_request_body` or one that did not arrive in
    time; None otherwise (a caller that hung up is answered by no one)."""
    if body.too_large:
        limit = settings.max_request_body
        return "request_too_large", f"request body exceeds max_request_body ({limit} bytes)"
    if body.timed_out:
        return (
            "request_timeout",
            "the request body did not arrive in time (the route deadline, or a pause longer"
            " than header_timeout_ms)",
        )
    return None
