"""What a local error says (SPEC §12: every local error's message names the rule that
ended the walk and what configuration would change it): `error_message`, from the
decision `failover.decide.decide` made and the facts the walk gathered. Nothing here
decides what happens to a request; it only explains it."""

from __future__ import annotations

from fallback_mw.config import RouteConfig, UpstreamConfig
from fallback_mw.failover.decide import Decision, replay_rule
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


# What would change each rule's answer: the configuration key (or caller header) to use.
_REMEDY = {
    "not_buffered": "the body is larger than [gateway] replay_buffer, so it cannot be "
    "replayed; raise replay_buffer to let it fail over",
    "ceiling": "the attempt ceiling (1 + retries) is reached; raise the route's retries",
    "method_override": "a method-override header (X-HTTP-Method-Override and its kin), a "
    "_method query parameter or a form body's _method field names a "
    "method the route's replayable_methods leave out; add it there to let it fail over",
    "no_candidate": "every other candidate was skipped (see x-gateway-skipped)",
    "repeat_budget": "the upstream's budget for repeats is spent "
    "([gateway.repeat_budget] percent / min_per_second)",
    "unsafe_address": "the connect-time guard refused the address its host resolved to when "
    "the request was sent (a listed name may reach only public addresses; link-local and "
    "metadata addresses never): if that address is the upstream's own, add it or its "
    "network (CIDR) to [gateway] allow_hosts; nothing was sent to it",
}


# What would bring a skipped candidate back, by skip reason (route_exhausted's message).
_SKIP_REMEDY = {
    "breaker_open": "an open breaker lets a probe through after its cooldown "
    "([gateway.breaker] cooldown_ms)",
    "no_credential": "a credential a quota 429 retired returns at its reset (or after the "
    "upstream's quota_retire_ms), one a plain 429 cooled after its Retry-After; one a 401 "
    "retired does not return (for the gateway's life; 24 h in a Redis state, restarts "
    "included): list a working key under a new variable name in the upstream's auth_env "
    "pool (a changed list starts the pool's health afresh)",
    "capacity": "a declared rpm / tpm is full until the rolling minute frees room "
    "(Retry-After says when), or the request's token estimate is over the whole tpm; raise "
    "the upstream's rpm / tpm (fallback-mw capacity)",
    "repeat_budget": _REMEDY["repeat_budget"],
    "model_rewrite": "a candidate that rewrites the model takes only a JSON object body within "
    "[gateway] replay_buffer",
}


def _tried_out(context: RequestContext) -> list[str]:
    """The pools skipped for want of a credential after every one of their keys was tried
    in this request (SPEC §6: a pool's key at most once per request): what brings a key
    back after a 429 or a 401 is beside the point, the pool had no key left for this one."""
    names: list[str] = []
    for skip in context.skipped:
        upstream = context.upstreams.get(skip.candidate)
        if skip.reason != "no_credential" or upstream is None or skip.candidate in names:
            continue
        pool = len(upstream.credential_envs)
        tried = {a.credential_index for a in context.attempts if a.candidate == skip.candidate}
        if pool > 1 and tried.issuperset(range(pool)):
            names.append(skip.candidate)
    return names


def _tried_out_remedies(context: RequestContext, reasons: dict[str, None]) -> list[str]:
    """What a pool whose every key this request tried needs (more keys, another upstream);
    the `no_credential` reason leaves `reasons` when no other pool was skipped for it."""
    tried = _tried_out(context)
    if tried and all(s.candidate in tried for s in context.skipped if s.reason == "no_credential"):
        reasons.pop("no_credential", None)
    return [
        f"each of the {len(context.upstreams[name].credential_envs)} keys of {name!r} was "
        f"tried once in this request (a pool's key at most once per request): list more keys "
        f"in its auth_env, or add another upstream to the plan"
        for name in tried
    ]


def _skip_remedy(context: RequestContext) -> str:
    remedies = _skip_remedies(context)
    remedies.append(f"a further upstream in the plan of route {context.route.id!r} would be tried")
    return "; ".join(remedies)


def _skip_remedies(context: RequestContext) -> list[str]:
    """What would bring back each skipped candidate, by what is known of its skip."""
    reasons = dict.fromkeys(s.reason for s in context.skipped)
    tried = _tried_out_remedies(context, reasons)
    unset, retired = _no_credential_candidates(context)
    if unset:
        # No 429 retired these: their variables were empty when the credentials were read
        # (unset under a running gateway after load had checked them).
        reasons.pop("no_credential", None)
    revoked = [name for name in context.revoked if name not in unset]
    if revoked and not retired_for_now(context, unset, revoked):
        reasons.pop("no_credential", None)  # none of them comes back by itself
    # A breaker a game-day fault's outcomes opened: its probe after the cooldown meets the
    # fault again (and reopens it, the cooldown doubled) until the fault ends.
    faulted = {s.candidate: s.fault for s in context.skipped if s.reason == "breaker_open"}
    if all(faulted.values()):
        reasons.pop("breaker_open", None)
    remedies = [_SKIP_REMEDY[r] for r in reasons if r in _SKIP_REMEDY]
    remedies[:0] = [
        f"the breaker of {name!r} was opened by the {fault} fault on it, which its probe "
        f"meets again until the fault ends: `fallback-mw faults clear --upstream {name}` (or "
        "its expiry) closes it"
        for name, fault in faulted.items()
        if fault
    ]
    faults = {s.candidate: s.fault for s in context.skipped if s.reason == "no_credential"}
    for name in reversed(revoked):
        envs = ", ".join(context.upstreams[name].credential_envs)
        fault = faults.get(name)
        remedies.insert(
            0,
            f"every credential of {name!r} was retired by the {fault} fault on it: "
            f"`fallback-mw faults clear --upstream {name}` (or its expiry) gives them back"
            if fault
            else f"every credential of {name!r} answered 401 and is retired, which does not "
            f"end by itself: put valid keys in {envs} and restart the gateway; a shared Redis "
            "state keeps a retirement 24 h across restarts, so there list a working key "
            "under a new variable name in its auth_env (a changed list starts the pool's "
            "health afresh)",
        )
    if unset:
        names = ", ".join(repr(name) for name in unset)
        remedies.insert(0, f"set the auth_env variable of {names} in the gateway's environment")
        if retired:
            remedies.insert(1, _SKIP_REMEDY["no_credential"])
    remedies[:0] = tried
    return remedies


def retired_for_now(context: RequestContext, unset: list[str], revoked: list[str]) -> bool:
    """Whether some `no_credential` candidate is neither unset nor retired for good: its
    credentials come back by themselves (a cool-down, a quota's reset)."""
    gone = {*unset, *revoked}
    return any(s.reason == "no_credential" and s.candidate not in gone for s in context.skipped)


def _no_credential_candidates(context: RequestContext) -> tuple[list[str], bool]:
    """The `no_credential` candidates none of whose variables held a value (names only),
    and whether any other candidate was skipped for want of a credential."""
    found = context.credentials or {}
    unset: dict[str, None] = {}
    retired = False
    for skip in context.skipped:
        if skip.reason == "no_credential":
            if skip.candidate in found and not any(found[skip.candidate]):
                unset[skip.candidate] = None
            else:
                retired = True
    return list(unset), retired


def _route_exhausted(context: RequestContext) -> str:
    skipped = ", ".join(f"{s.candidate} ({s.reason})" for s in context.skipped)
    return f"no candidate could be attempted: {skipped or 'none'} skipped; {_skip_remedy(context)}"


_REPLAY_RULES = frozenset({"not_replayable_method", "no_idempotency_key", "method_override",
                           "not_buffered"})  # fmt: skip
_METHOD_RULES = _REPLAY_RULES - {"not_buffered"}
# Remedies naming replayable_methods, which a store route cannot set.
_STORE_UNSETTABLE = frozenset({"not_replayable_method", "method_override"})
_DEFAULT_REPLAYABLE = RouteConfig.model_fields["replayable_methods"].default
_DEFAULT_TIMERS = tuple(
    UpstreamConfig.model_fields[timer].default
    for timer in ("connect_timeout_ms", "first_byte_timeout_ms")
)


def _remedy(rule: str | None, context: RequestContext) -> str:
    remedy = _rule_remedy(rule, context)
    route = context.route
    body = context.body
    if rule in _METHOD_RULES and body is not None and body.buffered is None:
        # The method rule is checked first; a body that was not buffered would stop the
        # replay too, so the method's remedy alone changes nothing.
        remedy += f"; and {_REMEDY['not_buffered']}"
    if rule in _STORE_UNSETTABLE and _store_shaped(context):
        # A route the admin CLI stored: no verb sets the key named above, so say where it
        # can be set.
        remedy += (
            " (a store route, added with fallback-mw routes add, keeps the default "
            "replayable_methods: define the route in the config file to set them)"
        )
    if rule in _REPLAY_RULES and route.attempt_ceiling == 1:
        # Replayable or not, this route makes one attempt: a replay needs somewhere to go.
        remedy += (
            f"; route {route.id!r} also has no fallback and no retries, so a replayable "
            f"request would not fail over either: add a fallback to its plan with retries = 1 "
            f"(a store route: fallback-mw routes set-fallback --id {route.id} --upstream URL "
            f"--retries 1)"
        )
    return remedy


def _rule_remedy(rule: str | None, context: RequestContext) -> str:
    route, method = context.route, context.method
    if rule == "no_candidate":
        return f"{_REMEDY['no_candidate']}; {_skip_remedy(context)}"
    if rule == "not_replayable_method":
        hint = f'{method} is not replayable on route {route.id!r}: add "{method}" to its '
        hint += "replayable_methods"
        if method == "POST":
            hint += " (or set replay_with_idempotency_key = true and send Idempotency-Key)"
        return hint + " to let it fail over"
    if rule == "no_idempotency_key":
        return (
            f"a POST without an Idempotency-Key header is not replayable on route "
            f"{route.id!r}: send one (replay_with_idempotency_key is on), or add "
            f'"POST" to replayable_methods'
        )
    if rule == "ceiling" and not context.skipped and len(route.plan) == 1:
        # A plan of one: more retries only repeat it; a fallback is what was missing.
        only = route.plan[0]
        return (
            f"route {route.id!r} has no fallback (its plan is {only!r} alone), so there was "
            f"nothing to fail over to: add a fallback to its plan with the retries to reach "
            f"it (a store route: fallback-mw routes set-fallback --id {route.id} --upstream "
            f"URL --retries 1), or raise its retries to repeat {only!r}"
        )
    if rule == "ceiling" and context.skipped:
        # More retries would only repeat what was left: name what was passed over, and why.
        skipped = ", ".join(dict.fromkeys(f"{s.candidate} ({s.reason})" for s in context.skipped))
        remedies = "; ".join(_skip_remedies(context))
        message = f"the attempt ceiling (1 + retries) is reached with {skipped} skipped"
        return f"{message}: {remedies}" if remedies else message
    return _REMEDY.get(rule or "", "")


# The shortest deadline a cut attempt and the attempt after it can share: below it, "lower
# that timeout below N ms" asks for a timer (1 ms at least) that would fail every attempt.
_LEAST_SHARED_DEADLINE_MS = 100


def _deadline_message(context: RequestContext) -> str:
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
        if _store_shaped(context):
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
    store = _store_shaped(context)
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
_STORE_TIMERS = (
    "a store route's upstreams keep their default timers (no admin verb sets them): to "
    "lower one below the deadline, define the route in the config file"
)


def _store_shaped(context: RequestContext) -> bool:
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
        f"not serve it: `fallback-mw faults clear --upstream {last.candidate}` (or its expiry) "
        "ends it"
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


def _last_failed(context: RequestContext) -> AttemptRecord:
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


def _timer_ran_out(record: AttemptRecord, context: RequestContext) -> str:
    """Which of the upstream's own timers ended a `timeout` attempt, with its value: a host
    that drops the connection's SYNs and one that takes the request and never answers are
    told apart, and each by the key that times it."""
    upstream = context.upstreams.get(record.candidate)
    if record.timer is None or record.failure_kind != "timeout" or upstream is None:
        return ""
    waited = "connection" if record.timer == "connect_timeout_ms" else "response head"
    return f": no {waited} within its {record.timer} ({getattr(upstream, record.timer)} ms)"


def error_message(decision: Decision, context: RequestContext) -> str:
    """The local error's message: which rule ended the walk, after how many attempts, and
    what configuration would change it."""
    attempts = context.attempt_count
    remedy = _remedy(decision.rule, context)
    if decision.error == "upstream_failed" and attempts:
        record = _last_failed(context)
        last = record.failure_kind or "status"
        if record.status is not None and last == "status":
            last += f" {record.status}"
        if record.could_not_connect and last == "transport":
            last += " (could not connect)"
        message = f"all {attempts} attempt(s) failed (last failure: {last} at {record.candidate!r}"
        message += f"{_timer_ran_out(record, context)})"
        if decision.rule == "ceiling" and all(a.could_not_connect for a in context.attempts):
            # Nothing answered at all: more retries would not help a wrong url or a stopped
            # upstream (a newcomer's first run, more often than not).
            remedy = (
                "no candidate accepted a connection: check each candidate's url "
                "(`fallback-mw check` prints them) and that the upstream is running"
            )
        if record.unmaskable is not None:
            message += (
                f"; its answer came in {record.unmaskable}, which the gateway cannot "
                "read to mask the credential it sent there: refused, never relayed unchecked"
            )
        elif record.failure_detail is not None:
            message += f"; {record.failure_detail}"
        return f"{message}; {remedy}" if remedy else message
    if decision.rule == "host_limit" and context.attempts:
        # Which resource the host lacked (descriptors, memory, ports), then what to change.
        lacking = _last_failed(context).failure_detail
        return f"{lacking}: {decision.reason}" if lacking else decision.reason
    if decision.error == "deadline_exceeded":
        return _deadline_message(context)
    if decision.error == "route_exhausted":
        return _route_exhausted(context)
    return decision.reason
