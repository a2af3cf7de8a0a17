"""Local error responses in the shape OpenAI clients already parse (SPEC §5)."""

from __future__ import annotations

import json
from typing import Any, Final

from fallback_mw.request.context import RequestContext
from fallback_mw.request.types import Send

STATUS_FOR_CODE: Final = {
    "upstream_failed": 502,
    "route_exhausted": 503,
    "deadline_exceeded": 504,
    "response_too_large": 502,
    "request_too_large": 413,
    "budget_exceeded": 402,
    "budget_unavailable": 503,
    "bad_request": 400,
    "request_timeout": 408,
    "headers_too_large": 431,
    "overloaded": 503,
    "method_not_allowed": 405,
    "loop_detected": 508,
    "config_error": 503,
}

# The rule a local error names when its sender gives none: the setting that decided it.
DEFAULT_RULE: Final = {
    "request_too_large": "max_request_body",
    "headers_too_large": "max_header_bytes",
    "overloaded": "max_concurrency",
    "budget_exceeded": "budget",
    "budget_unavailable": "budget_store",
    "request_timeout": "body_timeout",
    "response_too_large": "max_response_body",
    "method_not_allowed": "methods",
    "route_exhausted": "no_candidate",
    "deadline_exceeded": "deadline",
    "loop_detected": "loop",
}


def skipped_header(context: RequestContext) -> bytes:
    """`x-gateway-skipped: NAME;reason=REASON[, ...]` (SPEC §12): each candidate passed
    over without an attempt, in walk order, once per (name, reason)."""
    seen: list[str] = []
    for skip in context.skipped:
        item = f"{skip.candidate};reason={skip.reason}"
        if item not in seen:
            seen.append(item)
    return ", ".join(seen).encode("latin-1", "replace")


def gateway_headers(context: RequestContext) -> list[tuple[bytes, bytes]]:
    headers = [
        (b"x-gateway-route", context.route.id.encode("latin-1", "replace")),
        (b"x-gateway-attempts", str(context.attempt_count).encode()),
    ]
    if context.chosen is not None:
        headers.append((b"x-gateway-provider", context.chosen.encode("latin-1", "replace")))
    if context.skipped:
        headers.append((b"x-gateway-skipped", skipped_header(context)))
    if context.canary:
        headers.append((b"x-gateway-canary", b"1"))
    if context.fault:
        # Game-day traffic is named as such (a pin, a faulted attempt, or a skip past a
        # breaker that fault outcomes opened).
        headers.append((b"x-gateway-fault", b"1"))
    return headers


def error_body(code: str, message: str, context: RequestContext, rule: str | None = None) -> bytes:
    payload: dict[str, Any] = {
        "error": {
            "type": "gateway_error",
            "code": code,
            "message": message,
            "route": context.route.id,
            "attempts": context.attempt_count,
            "rule": rule or DEFAULT_RULE.get(code, code),
        }
    }
    return json.dumps(payload, separators=(",", ":")).encode()


async def send_error(
    send: Send,
    context: RequestContext,
    code: str,
    message: str,
    *,
    rule: str | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Send a local error. Never echoes an upstream body or header. `rule` names what
    ended the request (SPEC §12; default: the setting behind `code`)."""
    status = STATUS_FOR_CODE[code]
    rule = rule or DEFAULT_RULE.get(code, code)
    body = error_body(code, message, context, rule)
    context.status = status
    context.outcome = code
    context.rule = rule
    context.committed = True
    response_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        *gateway_headers(context),
        *(headers or ()),
    ]
    if context.attempt_count:
        # The route's retry policy has already run against the upstreams. The openai and
        # anthropic SDKs retry every 5xx by default and obey this header: without it each
        # SDK retry walks the plan again, resending a POST the route does not replay.
        response_headers.append((b"x-should-retry", b"false"))
    try:
        await send({"type": "http.response.start", "status": status, "headers": response_headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    except OSError:
        # The server's word that the client left (ASGI HTTP 2.4): the answer stands as
        # given, nothing is raised on to the server, and there is nothing left to break.
        context.client_disconnected = True
        return
    context.completed = True
