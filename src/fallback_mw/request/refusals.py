"""The local errors for a request body the gateway will not forward (over the limit, too
slow, not the length it declared), one wording for every layer that meets one: the budget
guard, which reads the body for its estimate, the walker's preflight and its walk."""

from __future__ import annotations

from typing import Final

from fallback_mw.config.views import AnySettings
from fallback_mw.request.context import RequestBody


def body_refusal(body: RequestBody, settings: AnySettings) -> tuple[str, str] | None:
    """(code, message) for a body over `max_request_body`, one that did not arrive in
    time, or one longer than its Content-Length; None otherwise (a caller that hung up is
    answered by no one)."""
    if body.too_large:
        limit = settings.max_request_body
        return "request_too_large", f"request body exceeds max_request_body ({limit} bytes)"
    if body.timed_out:
        return "request_timeout", SLOW_BODY
    if body.misframed:
        return "bad_request", MISFRAMED
    return None


# One wording for a body too slow, before the walk or during an attempt it streams to.
SLOW_BODY: Final = (
    "the request body did not arrive in time (the walk deadline: the route's deadline_ms or"
    " a shorter x-gateway-deadline-ms; or a pause longer than [gateway] header_timeout_ms)"
)

MISFRAMED: Final = (
    "the request body is not the length its Content-Length declares (the server in front"
    " of the gateway passed it on); send the body's exact length"
)
