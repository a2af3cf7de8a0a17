"""What a local error says (SPEC §12: every local error's message names the rule that
ended the walk and what configuration would change it): `error_message`, from the
decision `failover.decide.decide` made and the facts the walk gathered. Nothing here
decides what happens to a request; it only explains it."""

from __future__ import annotations

from typing import Final

from fallback_mw.config import command_option
from fallback_mw.failover.deadline_messages import (
    deadline_message,
    last_failed,
    store_shaped,
    timer_ran_out,
)
from fallback_mw.failover.decide import Decision
from fallback_mw.request.context import RequestContext

# What would change each rule's answer: the configuration key (or caller header) to use.
_REMEDY: Final = {
    "not_buffered": "the body is larger than [gateway] replay_buffer, so it cannot be "
    "replayed; raise replay_buffer to let it fail over",
    "ceiling": "the attempt ceiling (1 + retries) is reached; raise the route's retries",
    "method_override": "a method-override header (X-HTTP-Method-Override and its kin), a "
    "_method query parameter or a form body's _method field names a "
    "method the route's replayable_methods leave out; add it there to let it fail over",
    "no_candidate": "every other candidate was skipped (see x-gateway-skipped)",
    "repeat_budget": "the upstream's repeat allowance is spent "
    "([gateway.repeat_budget] percent / min_per_second)",
    "unsafe_address": "the connect-time guard refused the address its host resolved to when "
    "the request was sent (a listed name may reach only public addresses; link-local and "
    "metadata addresses never): if that address is the upstream's own, add it or its "
    "network (CIDR) to [gateway] allow_hosts; nothing was sent to it",
}


# What would bring a skipped candidate back, by skip reason (route_exhausted's message).
_SKIP_REMEDY: Final = {
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
        "meets again until the fault ends: `fallback-mw faults clear "
        f"{command_option('--upstream', name)}` (or its expiry) closes it"
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
            f"`fallback-mw faults clear {command_option('--upstream', name)}` (or its expiry) "
            "gives them back"
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


_REPLAY_RULES: Final = frozenset({"not_replayable_method", "no_idempotency_key", "method_override",
                           "not_buffered"})  # fmt: skip


_METHOD_RULES: Final = _REPLAY_RULES - {"not_buffered"}


# Remedies naming replayable_methods, which a store route cannot set.
_STORE_UNSETTABLE: Final = frozenset({"not_replayable_method", "method_override"})


def _remedy(rule: str | None, context: RequestContext) -> str:
    remedy = _rule_remedy(rule, context)
    route = context.route
    body = context.body
    if rule in _METHOD_RULES and body is not None and body.buffered is None:
        # The method rule is checked first; a body that was not buffered would stop the
        # replay too, so the method's remedy alone changes nothing.
        remedy += f"; and {_REMEDY['not_buffered']}"
    if rule in _STORE_UNSETTABLE and store_shaped(context):
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
            "(a store route: fallback-mw routes set-fallback "
            f"{command_option('--id', route.id)} --upstream URL --retries 1)"
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
            "it (a store route: fallback-mw routes set-fallback "
            f"{command_option('--id', route.id)} --upstream URL --retries 1), or raise its "
            f"retries to repeat {only!r}"
        )
    if rule == "ceiling" and context.skipped:
        # More retries would only repeat what was left: name what was passed over, and why.
        skipped = ", ".join(dict.fromkeys(f"{s.candidate} ({s.reason})" for s in context.skipped))
        remedies = "; ".join(_skip_remedies(context))
        message = f"the attempt ceiling (1 + retries) is reached with {skipped} skipped"
        return f"{message}: {remedies}" if remedies else message
    return _REMEDY.get(rule or "", "")


def _ceiling_under_faults(context: RequestContext, remedy: str) -> str:
    """A ceiling game-day faults reached (some attempts answered by a `fail` / `hang` /
    `blackhole` fault): more retries would meet the fault again, so what ends it comes
    first; when the faults answered every attempt it is all there is to say."""
    faulted: dict[str, str] = {}
    for attempt in context.attempts:
        if attempt.fault:
            faulted.setdefault(attempt.candidate, attempt.fault)
    if not faulted:
        return remedy
    kinds = "/".join(dict.fromkeys(faulted.values()))
    names = ", ".join(repr(name) for name in faulted)
    many = len(faulted) > 1
    what = f"the {kinds} fault{'s' if many else ''} on {names}"
    ends = " and ".join(
        f"`fallback-mw faults clear {command_option('--upstream', name)}`" for name in faulted
    )
    ends += " (or their expiry) end them" if many else " (or its expiry) ends it"
    attempts = context.attempts
    count = sum(1 for attempt in attempts if attempt.fault)
    if count < len(attempts):
        return f"{what} answered {count} of the {len(attempts)} attempts: {ends}; {remedy}"
    message = f"{what} answered every attempt, as {'they' if many else 'it'} would any further "
    message += f"one: {ends}"
    route = context.route
    if len(route.plan) == 1 and not context.skipped:
        message += (
            f"; route {route.id!r} has no fallback to serve while it lasts: add one to its "
            "plan with retries = 1"
        )
    return message


def error_message(decision: Decision, context: RequestContext) -> str:
    """The local error's message: which rule ended the walk, after how many attempts, and
    what configuration would change it."""
    attempts = context.attempt_count
    remedy = _remedy(decision.rule, context)
    if decision.error == "upstream_failed" and attempts:
        record = last_failed(context)
        last = record.failure_kind or "status"
        if record.status is not None and last == "status":
            last += f" {record.status}"
        if record.could_not_connect and last == "transport":
            last += " (could not connect)"
        message = f"all {attempts} attempt(s) failed (last failure: {last} at {record.candidate!r}"
        message += f"{timer_ran_out(record, context)})"
        if decision.rule == "ceiling" and all(a.could_not_connect for a in context.attempts):
            # Nothing answered at all: more retries would not help a wrong url or a stopped
            # upstream (a newcomer's first run, more often than not).
            remedy = (
                "no candidate accepted a connection: check each candidate's url "
                "(`fallback-mw check` prints them) and that the upstream is running"
            )
        if decision.rule == "ceiling":
            remedy = _ceiling_under_faults(context, remedy)
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
        lacking = last_failed(context).failure_detail
        return f"{lacking}: {decision.reason}" if lacking else decision.reason
    if decision.error == "deadline_exceeded":
        return deadline_message(context)
    if decision.error == "route_exhausted":
        return _route_exhausted(context)
    return decision.reason
