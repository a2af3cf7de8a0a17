"""`RequestContext.routed`, the resolver's positional constructor, makes the context the
dataclass's keyword constructor makes of the same fields: every other field at its
default, and a new request id, new lists and a new `Usage` for each request (nothing
shared between two requests)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import time

from fallback_mw.config import parse_config
from fallback_mw.request.context import RequestContext, Usage
from fallback_mw.request.secrets import RequestSecrets
from fallback_mw.routing import RouteTable


def _given() -> dict[str, object]:
    config = parse_config(
        {
            "upstreams": {"a": {"url": "http://127.0.0.1:9"}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["a"]}],
        }
    )
    table = RouteTable(config.routes, config.upstreams)
    route, _ = table.resolve_view("POST", "/v1/x", "default")
    started = time.monotonic()
    return {
        "route": route,
        "upstreams": table.upstream_views,
        "tenant": "acme",
        "session": "s-1",
        "method": "POST",
        "path": "/v1/x",
        "query": b"a=1",
        "deadline": started + 5,
        "configured_deadline_ms": 5000,
        "caller_deadline_ms": 400,
        "mount": "/m",
        "vary": (b"x-tenant-id",),
        "spelled_path": "/v1/%78",
        "overrides": frozenset({"PUT"}),
        "started": started,
        "upstream_auth_headers": frozenset({b"x-api-key"}),
        "request_model": "gpt",
        "secrets": RequestSecrets([], b""),
    }


def test_routed_makes_what_the_keyword_constructor_makes() -> None:
    given = _given()
    routed = RequestContext.routed(*given.values())  # type: ignore[arg-type]
    made = RequestContext(**given)  # type: ignore[arg-type]
    for field in dataclasses.fields(RequestContext):
        value = getattr(routed, field.name)  # unset: AttributeError
        if field.name == "request_id":
            assert re.fullmatch("[0-9a-f]{32}", value) and value != made.request_id
        else:
            assert value == getattr(made, field.name), field.name
    assert routed.usage == Usage()
    # The fields given are routed's parameters, in its order (the call above is right).
    assert list(inspect.signature(RequestContext.routed).parameters) == list(given)


def test_two_routed_contexts_share_nothing_they_change() -> None:
    given = list(_given().values())
    one = RequestContext.routed(*given)  # type: ignore[arg-type]
    two = RequestContext.routed(*given)  # type: ignore[arg-type]
    assert one.request_id != two.request_id
    for name in ("candidates", "forward_headers", "attempts", "skipped", "usage"):
        assert getattr(one, name) is not getattr(two, name), name
