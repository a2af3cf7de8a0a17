"""What a 504 `deadline_exceeded` (or a walk the deadline stopped) says: which timer ran
out, the attempt it cut or the wait for a connection it ended, the deadline shared by the
candidates, and the setting that would change it. failover/messages.py says the rest."""

from __future__ import annotations

from typing import Final

from fallback_mw.config import RouteConfig, UpstreamConfig, command_option
from fallback_mw.failover.replay import replay_rule
from fallback_mw.request.context import AttemptRecord, RequestContext
from fallback_mw.store.model import fallback_name, primary_name


def _cut_by_deadline(context: RequestContext) -> tuple[str, str, int] | None:
    """The candidate, the timer and its value when the deadline ended its attempt before
    that timer would have: raising deadline_ms below it changes nothing, since the walk
    moves on only once the attempt has failed. The timer is its first_byte_timeout_ms, or
    its connect_timeout_ms when the attempt outlived the first-byte timer of a buffered
    body (armed once connected: it never was) without waiting for a connection slot."""
    last = context.attempts[-1] if context.attempts else None
    if last is None or last.duration is None:
        return None
    waited = last.fault in ("hang", "blackhole")  # injected: booked to the upstream
    if not waited and last.failure_kind != "deadline":
        return None
    upstream = context.upstreams.get(last.candidate)
    if upstream is None:
        return None
    took_ms = last.duration * 1000
    if took_ms < upstream.first_byte_timeout_ms:
        return last.candidate, "first_byte_timeout_ms", upstream.first_byte_timeout_ms
    body = context.body
    buffered = body is not None and body.buffered is not None
    connecting = buffered and not waited and not last.queued_only
    if connecting and took_ms < upstream.connect_timeout_ms:
        return last.candidate, "connect_timeout_ms", upstream.connect_timeout_ms
    return None


def _queued_for_a_connection(context: RequestContext) -> tuple[str, int] | None:
    """The candidate and its `max_connections` when the deadline ended its attempt while it
    still waited for a connection slot: none of its timers had started, so a shorter one
    changes nothing."""
    last = context.attempts[-1] if context.attempts else None
    if last is None or not last.queued_only or last.failure_kind != "deadline":
        return None
    upstream = context.upstreams.get(last.candidate)
    return None if upstream is None else (last.candidate, upstream.max_connections)


def _inside(name: str, timer: str, timeout_ms: int) -> str:
    if timer == "connect_timeout_ms":
        return f"while {name!r} was still connecting, inside its {timer} ({timeout_ms} ms)"
    return f"while {name!r} was still inside its {timer} ({timeout_ms} ms)"


_DEFAULT_REPLAYABLE: Final = RouteConfig.model_fields["replayable_methods"].default


_DEFAULT_TIMERS: Final = tuple(
    UpstreamConfig.model_fields[timer].default
    for timer in ("connect_timeout_ms", "first_byte_timeout_ms")
)


# The shortest deadline a cut attempt and the attempt after it can share: below it, "lower
# that timeout below N ms" asks for a timer (1 ms at least) that would fail every attempt.
_LEAST_SHARED_DEADLINE_MS: Final = 100


def deadline_message(context: RequestContext) -> str:
    """Which deadline passed, the caller's x-gateway-deadline-ms or the configured one
    (the route's deadline_ms, else [gateway]'s), and what would let the walk go on."""
    attempts, waiting = context.attempt_count, _cut_by_deadline(context)
    configured, caller = context.configured_deadline_ms, context.caller_deadline_ms
    # A wait no upstream timer bounds, and the key that shortens it.
    backoff = fix = None
    queued = _queued_for_a_connection(context)
    if context.backoff_cut is not None:
        backoff = (
            f"while the walk waited the route's backoff_ms ({context.route.backoff_ms} ms) "
            f"before repeating {context.backoff_cut!r}"
        )
        fix = "lower the route's backoff_ms"
    elif queued is not None:
        name, slots = queued
        backoff = (
            f"while the attempt at {name!r} was still waiting for a free connection (its "
            f"max_connections, {slots}, were all in use: none of its timers had started)"
        )
        fix = f"raise the max_connections of {name!r}"
    if caller is not None:
        passed = (
            f"the deadline of {caller} ms the caller set with x-gateway-deadline-ms (the "
            f"route's is {configured} ms) passed after {attempts} attempt(s)"
        )
        if backoff is not None:
            return (
                f"{passed}, {backoff}: the caller may send a larger x-gateway-deadline-ms, or "
                f"none; or {fix}"
            )
        if waiting is None:
            return f"{passed}; the caller may send a larger x-gateway-deadline-ms, or none"
        name, timer, timeout_ms = waiting
        inside = _inside(name, timer, timeout_ms)
        remedy = f"lower that timeout below {caller} ms so that a hang ends in time for the "
        remedy += "next attempt"
        alone = _no_next_attempt(context, timer)
        hang = _injected_hang(context) if alone is not None else None
        if hang is not None:
            return f"{passed}, {inside}; {alone}: {hang}"
        if alone is not None:
            return (
                f"{passed}, {inside}; {alone}: the caller may send a larger "
                f"x-gateway-deadline-ms, or none, to wait longer for it"
            )
        if caller < _LEAST_SHARED_DEADLINE_MS:
            # No timeout can end a hang in time for another attempt inside 1 ms (or 40):
            # only the caller's own deadline stands between this request and the backup.
            larger = "a larger x-gateway-deadline-ms"
            if configured is not None and timeout_ms < configured:
                larger += f" (above {timeout_ms} ms)"
            return (
                f"{passed}, {inside}: {caller} ms is too short for any timeout to end a hang "
                f"in time for another attempt; the caller may send {larger}, or none (the "
                f"route's {configured} ms then applies)"
            )
        if store_shaped(context):
            remedy = (
                f"the caller may send a larger x-gateway-deadline-ms (above {timeout_ms} ms), or "
                "none"
                if configured is not None and timeout_ms < configured
                else f"raise [gateway] deadline_ms above {timeout_ms} ms, and the caller may send "
                "a larger x-gateway-deadline-ms, or none"
            )
            remedy += f"; {_STORE_TIMERS}"
        elif configured is not None and timeout_ms < configured:
            remedy = (
                f"the caller may send a larger x-gateway-deadline-ms (above {timeout_ms} ms), "
                f"or none; or {remedy}"
            )
        return f"{passed}, {inside}: {remedy}"
    key = "the route's deadline_ms"
    store = store_shaped(context)
    if context.route.deadline_ms is None:
        key = "[gateway] deadline_ms (or set the route's deadline_ms)"
        if store:
            key = "[gateway] deadline_ms"  # a store route has none of its own
    passed = f"the route deadline ({configured} ms) passed after {attempts} attempt(s)"
    if backoff is not None:
        return f"{passed}, {backoff}: {fix}, or raise {key}"
    if waiting is None:
        return f"{passed}; raise {key}"
    name, timer, timeout_ms = waiting
    inside = _inside(name, timer, timeout_ms)
    alone = _no_next_attempt(context, timer)
    hang = _injected_hang(context) if alone is not None else None
    if hang is not None:
        return f"{passed}, {inside}; {alone}: {hang}"
    if alone is not None:
        return (
            f"{passed}, {inside}; {alone}: raise {key} to wait longer for it (up to "
            f"{timeout_ms} ms)"
        )
    if configured is None or configured < _LEAST_SHARED_DEADLINE_MS:
        return f"{passed}, {inside}: raise {key} above {timeout_ms} ms"
    if store:
        return f"{passed}, {inside}: raise {key} above {timeout_ms} ms; {_STORE_TIMERS}"
    return (
        f"{passed}, {inside}: lower that below {configured} ms so that a hang ends in time "
        f"for the next attempt, or raise {key} above {timeout_ms} ms"
    )


# A route `fallback-mw routes add` stored: its upstreams keep the default timers and it keeps
# the default replayable_methods, since no admin verb sets them.
_STORE_TIMERS: Final = (
    "a store route's upstreams keep their default timers (no admin verb sets them): to "
    "lower one below the deadline, define the route in the config file"
)


def store_shaped(context: RequestContext) -> bool:
    """A route as the admin CLI stores it: its plan is the upstream names the store derives
    from its id (`chat-primary`, then `chat-fallback`), with the defaults no admin verb sets
    (replayable_methods, no deadline_ms of its own, its upstreams' timers). What only the
    config file can change is then said to be set there. A file route that keeps the names
    (moved from the store, as these messages advise) and sets one of those is a file
    route."""
    route = context.route
    names = (primary_name(route.id), fallback_name(route.id))
    if not (
        route.plan[0] == names[0]
        and set(route.plan) <= set(names)
        and route.replayable_methods == _DEFAULT_REPLAYABLE
        and route.deadline_ms is None
    ):
        return False
    for name in route.plan:
        upstream = context.upstreams.get(name)
        if (
            upstream is None
            or (
                upstream.connect_timeout_ms,
                upstream.first_byte_timeout_ms,
            )
            != _DEFAULT_TIMERS
        ):
            return False
    return True


def _injected_hang(context: RequestContext) -> str | None:
    """For a deadline that cut an attempt a game-day `hang` / `blackhole` fault holds: it
    never answers, so waiting longer for it serves nothing; what ends it. None otherwise."""
    last = context.attempts[-1] if context.attempts else None
    if last is None or last.fault not in ("hang", "blackhole"):
        return None
    return (
        f"the {last.fault} fault on {last.candidate!r} never answers, so a longer wait would "
        "not serve it: `fallback-mw faults clear "
        f"{command_option('--upstream', last.candidate)}` (or its expiry) ends it"
    )


def _no_next_attempt(context: RequestContext, timer: str) -> str | None:
    """Why no attempt could have followed the one the deadline cut (None: one could): a
    shorter `timer` would then only end the walk sooner, never serve it."""
    route, body = context.route, context.body
    rule = replay_rule(
        route,
        context.method,
        buffered=body is not None and body.buffered is not None,
        headers=context.forward_headers,
        overrides=context.overrides,
    )
    if rule is not None:
        return (
            f"the request is not replayable ({rule}), so no attempt follows it and a shorter "
            f"{timer} would only end it sooner"
        )
    if context.attempt_count >= route.attempt_ceiling:
        return (
            f"route {route.id!r} makes {route.attempt_ceiling} attempt(s) (1 + retries), so no "
            f"attempt follows and a shorter {timer} would only end it sooner"
        )
    return None


def last_failed(context: RequestContext) -> AttemptRecord:
    """The attempt whose outcome ended the walk: the one `decide` judged (the walker wrote
    its `local_error` on it), else the last one started, unless it lost a hedge race. The
    last started is not always the one judged: a hedge answered 502 at once is finished as
    the failure it is while the first attempt runs on, and that one's 503 ends the walk."""
    for record in reversed(context.attempts):
        if record.decision == "local_error":
            return record
    for record in reversed(context.attempts):
        if record.failure_kind != "cancelled":
            return record
    return context.attempts[-1]


def timer_ran_out(record: AttemptRecord, context: RequestContext) -> str:
    """Which of the upstream's own timers ended a `timeout` attempt, with its value: a host
    that drops the connection's SYNs and one that takes the request and never answers are
    told apart, and each by the key that times it."""
    upstream = context.upstreams.get(record.candidate)
    if record.timer is None or record.failure_kind != "timeout" or upstream is None:
        return ""
    waited = "connection" if record.timer == "connect_timeout_ms" else "response head"
    return f": no {waited} within its {record.timer} ({getattr(upstream, record.timer)} ms)"
