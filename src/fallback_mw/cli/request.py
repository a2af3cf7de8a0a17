"""`fallback-mw request`: one request through the gateway `serve` would build, and its trace.

Same configuration, same store, same shared state (an open breaker in Redis, an active fault
in the store): the request is one in-process ASGI call, and the trace is read from the
records the spans and the usage log are built from (`one_request`). Exit status: 0 when the
client would have received a 2xx in full, 1 otherwise (no route `--route` names included),
2 for a bad invocation or config.
Never printed: a credential, a request header value (except the tenant the gateway read,
a label that spans and the log line carry too), a query string, a body (unless
`--show-body`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from fallback_mw.cli.app import Console, Failed, Refused, run
from fallback_mw.cli.one_request import OneRequest, send_one, trace_of
from fallback_mw.cli.request_table import render
from fallback_mw.cli.target import missing_sqlite_file, no_store_file
from fallback_mw.config import GatewayConfig, load_config
from fallback_mw.health import StateURLError
from fallback_mw.request.types import ASGIApp
from fallback_mw.security.fields import canonical_name
from fallback_mw.security.values import is_field_name
from fallback_mw.store_url import is_redis_url

_MAX_TARGET = 8192


@dataclass(frozen=True, slots=True)
class Options:
    method: str | None  # None: POST with a body, GET without
    target: str | None  # --path
    route: str | None  # --route
    headers: tuple[tuple[str, str], ...]
    body_source: str | None  # a file name, or "-" for stdin
    show_body: bool
    json: bool


def parse_header(position: int, text: str) -> tuple[str, str]:
    """`name: value`. A refusal names the --header by position and never quotes its value
    (it may be a credential)."""
    name, colon, value = text.partition(":")
    name = name.strip()
    if not colon or not is_field_name(name):
        raise Refused(f"--header #{position}: expected 'name: value' with a valid field name")
    value = value.strip()
    # Any other text is sent in UTF-8 (as curl and the SDKs send it, and as the gateway
    # reads a tenant or session id): `x-tenant-id: 日本語` is a tenant a route may name.
    if any((ch < " " and ch != "\t") or "\x7f" <= ch <= "\x9f" for ch in value):
        raise Refused(f"--header #{position} ({name.lower()}): the value holds a control character")
    return name, value


def parse_target(text: str) -> str:
    if not text.startswith("/"):
        raise Refused("--path must start with '/' (e.g. /v1/chat/completions)")
    if len(text) > _MAX_TARGET:
        raise Refused(f"--path is longer than {_MAX_TARGET} characters")
    if not text.isascii() or any(ch.isspace() or not ch.isprintable() for ch in text):
        raise Refused("--path must be printable ASCII without spaces (percent-encode the rest)")
    return text


def options_from(args: argparse.Namespace) -> Options:
    if args.path is None and args.route is None:
        raise Refused("pass --route ID or --path /... (the request to send)")
    method = args.method
    if method is not None and not is_field_name(method):
        raise Refused("--method must be an HTTP method token (GET, POST, ...)")
    headers = tuple(parse_header(i, h) for i, h in enumerate(args.header or [], start=1))
    return Options(
        method=method.upper() if method else None,
        target=None if args.path is None else parse_target(args.path),
        route=args.route,
        headers=headers,
        body_source=args.body,
        show_body=args.show_body,
        json=args.json,
    )


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """As `serve` loads it (credential variables must be set: a request is really sent)."""
    if args.config is not None:
        return load_config(args.config)
    config = load_config({"gateway": {"store": args.store}})
    # `--store` alone routes by the store's routes: a file that is not there holds none, and
    # the gateway would create it, hiding a typo in the path behind "no route".
    absent = missing_sqlite_file(args.store)
    if absent is not None:
        raise Refused(f"--store: {no_store_file(absent)}")
    return config


def read_body(source: str | None, limit: int, stdin: BinaryIO) -> bytes | None:
    """The body, at most `limit` + 1 bytes: more than the gateway accepts is enough for
    it to answer 413 as it would to a client."""
    if source is None:
        return None
    if source == "-":
        return stdin.read(limit + 1)
    try:
        with open(source, "rb") as handle:
            return handle.read(limit + 1)
    except OSError as exc:
        raise Refused(f"--body {source}: {exc.strerror or exc}") from None


def route_request(app: Any, options: Options, tenant_header: str) -> OneRequest:
    """The request to send: `--path`, or `--route ID`'s prefix (with its tenant header when
    the route is tenant-bound and the caller named none)."""
    method = options.method or ("GET" if options.body_source is None else "POST")
    headers = list(options.headers)
    target = options.target
    if options.route is not None:
        table = app.services.table()
        route = next((r for r in table.routes if r.id == options.route), None)
        if route is None:
            known = ", ".join(sorted(r.id for r in table.routes)) or "none"
            # Not found, as `routes remove --id` of a route not there: 1, not a refusal.
            raise Failed(f"no route {options.route!r} (routes: {known})")
        if method not in route.accepted_methods:
            raise Refused(
                f"route {route.id!r} does not accept {method} "
                f"(methods: {', '.join(route.accepted_methods)})"
            )
        target = route.prefix
        # In the gateway's canonical form: `x_tenant_id` is the tenant field too (the
        # resolver reads it so), and a second spelling beside it would be refused.
        named = {canonical_name(name.encode("latin-1", "replace")) for name, _ in headers}
        wanted = canonical_name(tenant_header.encode("latin-1", "replace"))
        if route.tenant is not None and wanted not in named:
            headers.append((tenant_header, route.tenant))
    assert target is not None
    return OneRequest(method=method, target=target, headers=tuple(headers))


def typed_as_json(
    headers: Sequence[tuple[str, str]], body: bytes | None
) -> Sequence[tuple[str, str]]:
    """A `--body` that is a JSON object or array goes with `content-type: application/json`,
    as the SDKs send it, unless a --header names a type: sent with none, an upstream that
    reads bodies by their type (Express's json(), the provider APIs) saw no JSON and
    answered 400, which read as the gateway mangling the body."""
    if body is None or any(name.strip().lower() == "content-type" for name, _ in headers):
        return headers
    try:
        document = json.loads(body)  # UTF-8, or a UTF-16 / UTF-32 one, as json reads bytes
    except (ValueError, RecursionError):
        return headers
    if not isinstance(document, dict | list):
        return headers
    return (*headers, ("content-type", "application/json"))


async def exchange_for(app: Any, options: Options, body: bytes | None) -> dict[str, Any]:
    """Send the one request through `app` (a Gateway) and return its trace; closes `app`."""
    try:
        request = route_request(app, options, app.config.gateway.tenant_header)
        headers = typed_as_json(request.headers, body)
        request = OneRequest(request.method, request.target, headers, body)
        exchange = await send_one(app, request)
        state = shared_state(app)
    finally:
        await app.aclose()
    trace = trace_of(exchange, show_body=options.show_body)
    trace["state"] = state
    return trace


def shared_state(app: Any) -> dict[str, Any]:
    """Which breakers, credential health and counts the request met: `memory` (this
    process's), `shared` (Redis), or `local` (Redis configured but not usable: a fresh
    in-memory state, so an open breaker in Redis does not show), with the reason."""
    if not is_redis_url(app.config.gateway.state):
        return {"kind": "memory"}
    from fallback_mw.health.redis import RedisHealth

    health = app.services.health
    if not isinstance(health, RedisHealth) or health.available:
        return {"kind": "shared"}
    return {"kind": "local", "url": health.label, "reason": health.outage_reason}


def build_gateway(config: GatewayConfig, **services: Any) -> ASGIApp:
    from fallback_mw.cli.serve import not_found_app
    from fallback_mw.gateway import Gateway

    gateway = Gateway(not_found_app, config=config, **services)
    if gateway.config_error is not None:  # e.g. a store route the file's rules refuse
        raise Refused(gateway.config_error)
    return gateway


def request(args: argparse.Namespace, console: Console) -> None:
    options = options_from(args)
    config = gateway_config(args)
    body = read_body(options.body_source, config.gateway.max_request_body, sys.stdin.buffer)
    try:
        gateway = build_gateway(config)
    except StateURLError as exc:
        raise Refused(str(exc)) from None
    trace = run(lambda: exchange_for(gateway, options, body))
    console.print(json.dumps(trace, indent=2) if options.json else render(trace))
    if not trace["ok"]:
        client = trace["client"]
        got = " ".join(str(p) for p in (client["status"], client["error_code"]) if p is not None)
        raise Failed(f"the client would have received {got or 'no response'}, not a full 2xx")
