"""`Via` on each request the gateway forwards (RFC 9110 §7.6.3: a gateway sends it in
each inbound request), and the request that comes back. Two gateways whose plans name each
other (team A's plan names team B's gateway, B's names A's), or a plan naming its own
gateway by another spelling, sent each request round for ever: each hop strips what the
last one added (`x-gateway-*`), each attempt is a new request with a deadline of its own,
and the caller's hanging up ended only the front of it (thousands of requests a second,
long after the caller's 504). A walker names itself, per route, with a pseudonym (never a
host, port or route id: a `Via` reaches every upstream) and refuses a request whose `Via`
already names it for that route: 508 `loop_detected`, before any attempt. Per route: a
plan may name another route of its own gateway (`front` -> `pool` -> the model), which
passes the gateway twice and ends. `serve --workers N` runs N walkers, so a loop through
it may pass it up to N times before one of them sees its own name."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from typing import Final

from fallback_mw.request.context import RequestContext
from fallback_mw.request.local_errors import send_error
from fallback_mw.request.types import Scope, Send

_FIELD: Final = b"via"
_PREFIX: Final = b"fallback-mw-"
# The openai and anthropic SDKs retry a 5xx unless told not to: each retry would go round
# again to the same answer.
NO_RETRY: Final = (b"x-should-retry", b"false")
# Names kept per walker: route ids come and go with store reloads.
_MAX_NAMES: Final = 4096


class ViaSecret:
    """What a walker's names in `Via` are made from: random per walker, so two gateways in
    one process (a host app mounting team A's and team B's) have names of their own. Its
    name for a route is made once per route id, then looked up."""

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(16)
        self._names: dict[str, bytes] = {}

    def name(self, route_id: str) -> bytes:
        """The walker's name in `Via` for one route."""
        name = self._names.get(route_id)
        if name is None:
            if len(self._names) >= _MAX_NAMES:
                self._names.clear()
            text = route_id.encode("utf-8", "replace")
            digest = hashlib.sha256(self._secret + b"\0" + text).hexdigest()
            name = self._names[route_id] = _PREFIX + digest[:16].encode()
        return name


def walker_secret() -> ViaSecret:
    return ViaSecret()


def came_back(context: RequestContext, secret: ViaSecret, scope: Scope) -> bool:
    """Whether the request came back to this walker's route (`refuse_loop` answers it);
    else the walker's own entry is added to `context.forward_headers` after the caller's
    (RFC 9110 §7.6.3: in the order the hops were made). Not a coroutine: every request
    asks, and almost none is refused.

    The `Via` read is the one received, and the gateways' names in it go on even where
    `strip_headers` names `via` (an operator keeping the caller's hops from the vendors):
    checked and forwarded as stripped, each gateway of a loop saw only the last one's
    name, never its own, and the request went round for ever."""
    name = secret.name(context.route.id)
    received = None
    # Typed: compiled, each field is read as a tuple, not through an iterator (the
    # resolver made the head tuples of two bytes: `layers.limits.byte_fields`).
    fields: Sequence[tuple[bytes, bytes]] = scope.get("headers", ())
    for field, value in fields:
        if len(field) == 3 and field.lower() == _FIELD:
            received = value if received is None else received + b", " + value
    headers = context.forward_headers
    if received is not None:
        forwarded = any(field == _FIELD for field, _ in headers)
        if not forwarded or received.find(name) >= 0:
            hops = _hops(received)  # read once: for this walker's name, and the gateways'
            if any(by == name for _, by in hops):
                return True
            if not forwarded:  # stripped: the caller's hops, not the gateways'
                kept = b", ".join(p + b" " + by for p, by in hops if by.startswith(_PREFIX))
                if kept:
                    headers.append((_FIELD, kept))
    version = scope.get("http_version", "1.1")
    headers.append((_FIELD, version.encode("latin-1", "replace") + b" " + name))
    return False


async def refuse_loop(send: Send, context: RequestContext) -> None:
    message = loop_message(context.route.id)
    await send_error(send, context, "loop_detected", message, headers=[NO_RETRY])


def _hops(value: bytes) -> list[tuple[bytes, bytes]]:
    """Each member of a `Via` value as (protocol, received-by): `Via: 1.1 name [(comment)],
    1.0 other`; a member without both is no hop of anyone's."""
    hops = []
    for member in value.split(b","):
        words = member.split()
        if len(words) >= 2:
            hops.append((words[0], words[1]))
    return hops


def loop_message(route_id: str) -> str:
    return (
        "this request already passed through this gateway (its Via names it): a plan on "
        f"its way here, route {route_id!r} or one of a gateway it forwards to, names a "
        "gateway that forwards back to this one, or this gateway itself by another name; "
        "remove that candidate from the plan: nothing was sent upstream"
    )
