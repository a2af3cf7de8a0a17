"""One request through a gateway, in process, and its trace (`fallback-mw request`).

The request is one ASGI call with a hand-built scope; the response messages are captured.
The trace is read from the request context the walker filled in — the same
`AttemptRecord`s and `SkipRecord`s the spans (`telemetry.py`) and the usage record
(`budget/guard.py`) are built from. There is no second bookkeeping here: this module only
reads them.

What the trace never holds: a credential (it reads none), a request header value (names
only: a caller's `--header` may well be a credential), a query string, a response header
other than the gateway's own `x-gateway-*`, and a body unless asked for (`show_body`).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from fallback_mw.failover.replay import attempt_ceiling, is_replayable
from fallback_mw.request.body_json import BYTE_ORDER_MARKS
from fallback_mw.request.context import (
    AttemptRecord,
    RequestContext,
    SkipRecord,
    get_context,
    walk_order,
)
from fallback_mw.request.types import ASGIApp, Message, Scope
from fallback_mw.telemetry.redact import tenant_label

GATEWAY_HEADER_PREFIX = "x-gateway-"
_CHUNK = 65536


@dataclass(frozen=True, slots=True)
class OneRequest:
    method: str
    target: str  # the request target: a path, with an optional ?query (sent, never shown)
    headers: Sequence[tuple[str, str]] = ()
    body: bytes | None = None

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


@dataclass(slots=True)
class Exchange:
    """What one ASGI call did: the context it left in the scope and what the client got."""

    request: OneRequest
    context: RequestContext | None  # None: no route matched (the host app answered)
    status: int | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)  # x-gateway-* only
    body: bytearray = field(default_factory=bytearray)
    complete: bool = False  # the final body message arrived
    deadline_left: float | None = None  # seconds left when the response head was sent
    content_type: bytes | None = None  # to show the body in its charset (`show_body`)

    @property
    def succeeded(self) -> bool:
        """The client received a 2xx, in full (an aborted 200 is not a success)."""
        served = self.context is None or self.context.outcome == "served"
        return self.status is not None and 200 <= self.status < 300 and self.complete and served


def build_scope(request: OneRequest) -> Scope:
    path, _, query = request.target.partition("?")
    # Values in UTF-8, as curl sends them (a route's tenant `日本語` has no latin-1 form,
    # and latin-1 bytes >= 0x80 are a 400 to the gateway).
    headers = [(k.strip().lower().encode("latin-1"), v.encode()) for k, v in request.headers]
    names = {name for name, _ in headers}
    if b"host" not in names:
        headers.insert(0, (b"host", b"localhost"))
    if request.body is not None and b"content-length" not in names:
        headers.append((b"content-length", str(len(request.body)).encode()))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": request.method.upper(),
        "scheme": "http",
        "path": unquote(path),
        "raw_path": path.encode("latin-1"),
        "query_string": query.encode("latin-1"),
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }


async def send_one(app: ASGIApp, request: OneRequest) -> Exchange:
    """Send `request` through `app` (a Gateway) and capture the response."""
    scope = build_scope(request)
    body = request.body or b""
    chunks = [body[i : i + _CHUNK] for i in range(0, len(body), _CHUNK)] or [b""]
    exchange = Exchange(request=request, context=None)

    async def receive() -> Message:
        if chunks:
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}
        # The client stays connected until the call returns (a server's receive blocks
        # the same way); the walker cancels its disconnect watcher when it is done.
        await asyncio.Event().wait()
        raise AssertionError("unreachable")  # pragma: no cover

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            exchange.status = int(message["status"])
            for key, value in message.get("headers", ()):
                name = bytes(key).decode("latin-1").lower()
                if name.startswith(GATEWAY_HEADER_PREFIX):
                    exchange.headers.append((name, bytes(value).decode("latin-1")))
                elif name == "content-type" and exchange.content_type is None:
                    exchange.content_type = bytes(value)
            context = get_context(scope)
            if context is not None:
                exchange.deadline_left = context.remaining
        elif message["type"] == "http.response.body":
            exchange.body += message.get("body", b"")
            if not message.get("more_body", False):
                exchange.complete = True

    await app(scope, receive, send)
    exchange.context = get_context(scope)
    return exchange


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _attempt(record: AttemptRecord, context: RequestContext) -> dict[str, Any]:
    ended = record.started + (record.duration or 0.0)
    upstream = context.upstreams.get(record.candidate)
    return {
        "step": "attempt",
        "number": record.number,
        "candidate": record.candidate,
        "address": record.server_address,
        "status": record.status,
        "failure_kind": record.failure_kind,
        "timer": record.timer,  # the upstream's timer behind a `timeout` (its key)
        "fault": record.fault,
        "hedge": record.hedge,
        "credential_index": record.credential_index,  # a pool position, never a value
        "pool_size": len(upstream.credential_envs) if upstream is not None else 0,
        "responsible": record.responsible,
        "decision": record.decision,
        "reason": record.reason,
        "started_ms": _ms(record.started - context.started),
        "elapsed_ms": _ms(record.duration),
        "deadline_left_ms": _ms(context.deadline - ended),
    }


def _skip(record: SkipRecord) -> dict[str, Any]:
    return {"step": "skip", "candidate": record.candidate, "reason": record.reason}


def walk_steps(context: RequestContext) -> list[dict[str, Any]]:
    """Attempts and skips in the order the walk met them (a skip made after k attempts
    comes before attempt k + 1)."""
    return [
        _skip(step) if isinstance(step, SkipRecord) else _attempt(step, context)
        for step in walk_order(context)
    ]


_CHARSET = re.compile(rb";\s*charset\s*=\s*\"?([^;\"\s]*)", re.IGNORECASE)
# Types whose readers take no charset: JSON (RFC 8259 §11: the parameter "has no effect on
# compliant recipients"; the SDKs parse the bytes) and an event stream (always UTF-8).
_CHARSET_IGNORED = re.compile(
    rb"\s*(?:application/(?:[!#$&^_.+\-\w]*\+)?json|text/event-stream)\s*(?:;|$)", re.IGNORECASE
)


def shown_body(body: bytes, content_type: bytes | None) -> str:
    """The body as text, read as its reader would: by its byte-order mark, else the
    charset its `Content-Type` declares (an answer in ISO-8859-1 showed every `ü` as
    U+FFFD, one in UTF-16 as `?` between its letters) unless its type's readers ignore
    one (JSON, an event stream: `charset=utf-7` showed `+ADw-b+AD4-` as `<b>`, which no
    SDK reads), else a JSON body's own encoding (RFC 8259), else UTF-8; bytes the
    encoding does not hold read as U+FFFD."""
    for mark, codec in BYTE_ORDER_MARKS:
        if body.startswith(mark):
            return body[len(mark) :].decode(codec, "replace")
    match = _CHARSET.search(content_type or b"")
    if match is not None and not _CHARSET_IGNORED.match(content_type or b""):
        with contextlib.suppress(LookupError, UnicodeError):
            return body.decode(codecs.lookup(match[1].decode("ascii")).name, "replace")
    if body[:1] == b"\x00" or body[1:2] == b"\x00":  # `{` or `[` in UTF-16 / UTF-32
        return body.decode(json.detect_encoding(body), "replace")
    return body.decode("utf-8", "replace")


def trace_of(exchange: Exchange, *, show_body: bool = False) -> dict[str, Any]:
    """The trace as one JSON-ready object (`--json` prints exactly this)."""
    context = exchange.context
    request = exchange.request
    client: dict[str, Any] = {
        "status": exchange.status,
        "headers": dict(exchange.headers),
        "error_code": None,
        "complete": exchange.complete,
        "body_bytes": len(exchange.body),
    }
    if show_body:
        client["body"] = shown_body(bytes(exchange.body), exchange.content_type)
    trace: dict[str, Any] = {
        "ok": exchange.succeeded,
        "matched": context is not None,
        "method": request.method.upper(),
        # What the upstream was sent: the caller's escapes kept where they are (`%2F`).
        "path": request.path if context is None else (context.spelled_path or context.path),
        "request_headers": [name.strip().lower() for name, _ in request.headers],
        "request_body_bytes": None if request.body is None else len(request.body),
    }
    if context is None:
        trace["client"] = client
        return trace
    if context.chosen is None and context.outcome not in (None, "served"):
        client["error_code"] = context.outcome  # a local error (SPEC §5), never upstream's
    trace.update(
        {
            "request_id": context.request_id,
            "route": context.route.id,
            # As spans and the log line record it: `[REDACTED]` when it is a credential.
            "tenant": tenant_label(context.tenant, context.secrets),
            # The request's order; the route's plan when it was refused before the walk
            # ordered it (a 405, a 413), as the span and the log line say.
            "candidates": list(context.candidates or context.route.plan),
            "strategy": context.route.strategy,
            "attempt_ceiling": _ceiling(context),
            "canary": context.canary,
            "pinned": context.pinned,
            "deadline_ms": _ms(context.deadline - context.started),
            "steps": walk_steps(context),
            "attempts": context.attempt_count,
            "skipped": len(context.skipped),
            "chosen": context.chosen,
            "fallback": context.fallback,
            "outcome": context.outcome,
            "rule": context.rule,  # what ended the walk (docs/failover.md, `rule`)
            "deadline_left_ms": _ms(exchange.deadline_left),
            "client": client,
        }
    )
    return trace


def _ceiling(context: RequestContext) -> int:
    """The ceiling this request walked under: 1 + retries, or 1 when it cannot be repeated
    (the walker's own rule, `failover.replay.attempt_ceiling`)."""
    body = context.body
    replayable = body is not None and is_replayable(
        context.route,
        context.method,
        buffered=body.buffered is not None,
        headers=context.forward_headers,
        overrides=context.overrides,
    )
    return attempt_ceiling(context.route, replayable=replayable)
