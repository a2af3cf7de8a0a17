"""Whether a request may be sent more than once, as pure functions of the route and the
request (SPEC §5, §12): replayability (`is_replayable`, and the rule that makes a request
not replayable, `replay_rule`), the attempt ceiling (`attempt_ceiling`), whether the
walk's first attempt is hedged (`may_hedge`, `is_keyed_post`). Whether a further attempt
runs after an outcome is `failover.decide`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from fallback_mw.config.views import AnyRoute
from fallback_mw.security.fields import override_methods

IDEMPOTENCY_KEY: Final = b"idempotency-key"


def is_replayable(
    route: AnyRoute,
    method: str,
    *,
    buffered: bool,
    headers: Sequence[tuple[bytes, bytes]],
    overrides: frozenset[str] | None = None,
) -> bool:
    """SPEC §5: the method is in `replayable_methods` and the whole body was buffered; or,
    with `replay_with_idempotency_key`, a buffered POST that carries a non-empty
    `Idempotency-Key` (the same key goes with every attempt). A method-override field
    (`override_methods`) naming a method outside `replayable_methods` makes it not
    replayable: the upstream acts on that method (a GET carrying `POST`). `overrides`: those
    methods as already read (`RequestContext.overrides`), else read from `headers`."""
    if not buffered:
        return False
    if overrides is None:
        overrides = override_methods(headers, method)
    if overrides and overrides.difference(route.replayable_methods):
        return False
    if method in route.replayable_methods:
        return True
    return (
        route.replay_with_idempotency_key
        and method == "POST"
        and any(k.lower() == IDEMPOTENCY_KEY and v.strip() for k, v in headers)
    )


def replay_rule(
    route: AnyRoute,
    method: str,
    *,
    buffered: bool,
    headers: Sequence[tuple[bytes, bytes]],
    overrides: frozenset[str] | None = None,
) -> str | None:
    """Which rule makes the request not replayable (None: it is), the same test as
    `is_replayable`, told apart for the error message."""
    if overrides is None:
        overrides = override_methods(headers, method)
    if is_replayable(route, method, buffered=buffered, headers=headers, overrides=overrides):
        return None
    if overrides.difference(route.replayable_methods):
        return "method_override"
    if method in route.replayable_methods:
        return "not_buffered"
    if route.replay_with_idempotency_key and method == "POST":
        keyed = any(k.lower() == IDEMPOTENCY_KEY and v.strip() for k, v in headers)
        return "not_buffered" if keyed else "no_idempotency_key"
    return "not_replayable_method"


def attempt_ceiling(route: AnyRoute, *, replayable: bool) -> int:
    """The most upstream requests one walk may make: `1 + retries`, and 1 for a request
    that cannot be repeated. The first of two guards (SPEC §12): `further_attempt_possible`
    still checks `replayable`, so either guard alone stops a replay."""
    if not replayable:
        return 1
    return route.attempt_ceiling


def may_hedge(
    route: AnyRoute,
    *,
    replayable: bool,
    first_attempt: bool,
    at_first_candidate: bool,
    keyed_post: bool = False,
) -> bool:
    """Only the walk's first attempt, at the first candidate, of a replayable request on a
    route that hedges and has room for one more attempt. A POST carrying an
    Idempotency-Key is not hedged unless the route says `hedge_idempotent_posts`: a hedge
    sends two concurrent requests with one key, which many APIs answer with 409."""
    return (
        route.hedge_after_ms > 0
        and first_attempt
        and at_first_candidate
        and replayable
        and route.attempt_ceiling >= 2
        and (not keyed_post or route.hedge_idempotent_posts)
    )


def is_keyed_post(method: str, headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """A POST with a non-empty Idempotency-Key header."""
    return method == "POST" and any(k.lower() == IDEMPOTENCY_KEY and v.strip() for k, v in headers)
