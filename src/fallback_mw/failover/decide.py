"""The failover rules of SPEC §5, as pure functions of facts the walk gathers.

Decided here: what an engine error means (`engine_outcome`; after the commit point,
`relay_outcome`), that the caller's own trouble
wins over it (`local_or`), who is responsible (`Outcome.responsible`), failover-class
(`is_failover_class`), what reaches breakers and credentials (`health_mark`),
replayability (`is_replayable`), the attempt ceiling (`attempt_ceiling`), whether a
further attempt may run (`further_attempt_possible` / `_allowed`), whether to hedge
(`may_hedge`), and the next action after any outcome (`decide`) with its local error
(`error_message`). The walker, the hedge, the shadow copy, the docs and the trace follow.

Decided elsewhere, each in one place (docs/failover.md, "Where each rule is decided",
a table tests/test_decide.py checks against the imports): the effective deadline
(`routing.effective_deadline_ms`); the plan order (`plan.candidate_order`); skips,
passes and the backoff before a repeat (the walker's candidate cursor); admission
(breaker, declared capacity, repeat allowance: `failover.attempt.AttemptLifecycle.gate`);
the commit point (`layers.walker.stream.commit`). The deadline is enforced where time
passes (the walk loop checks it before each attempt, the runner bounds each attempt by
it); what its running out means is `decide`'s.

Only upstream outcomes feed breakers and credential health (`health_mark`, applied only
by `AttemptLifecycle.mark_health`), and only they can be failover-class: one caller can
never open a breaker for everyone else.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from fallback_mw.config import RouteConfig
from fallback_mw.request.context import RequestContext
from fallback_mw.request.refusals import MISFRAMED, SLOW_BODY
from fallback_mw.security import override_methods

# Within a credential pool these may move to another credential of the same upstream.
CREDENTIAL_STATUSES = frozenset({401, 403, 429})

OutcomeKind = Literal[
    # the upstream's doing
    "status",  # a response head arrived (any status)
    "transport",  # refused, reset or a protocol error before the response head
    "timeout",  # the upstream's own connect or first-byte timeout
    # the gateway's side of the request (never recorded against an upstream)
    "deadline",  # the walk deadline ran out (the route's, or the caller's shorter one)
    "client_gone",  # the caller hung up
    "body_too_large",  # the streamed request body went over max_request_body
    "body_timeout",  # the request body did not arrive before the deadline
    "body_misframed",  # the streamed request body was not the length it declared
    "unsafe_address",  # the connect-time guard refused the upstream's address
    "not_sent",  # the client library refused to build or send the request (nothing sent)
    "no_candidate",  # the cursor ran dry: every remaining candidate was skipped
    "repeat_budget",  # a repeat (or hedge) at an upstream whose repeat budget is spent
    "no_other_credential",  # after a pool's 401/403/429, no other credential could be tried
    "response_too_large",  # the relayed body went over max_response_body (after the commit)
]
UPSTREAM_KINDS = frozenset({"status", "transport", "timeout"})

Action = Literal["serve", "next_candidate", "next_credential", "local_error", "abort"]


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: OutcomeKind
    status: int | None = None
    # "fail" / "hang": an injected upstream failure. It feeds health like the real thing,
    # even when the walk deadline is what ended a hang (game days exercise the breaker).
    fault: str | None = None
    # A transport failure named more precisely for the trace (`tls`: the certificate did
    # not verify); the rules treat it as its kind.
    detail: str | None = None
    # It came after the commit point (the response had started): the client's response is
    # aborted, never failed over, and nothing more reaches health (`relay_outcome`).
    committed: bool = False

    @property
    def responsible(self) -> Literal["upstream", "gateway"]:
        # An injected fault stands for the upstream, whatever ended the attempt.
        upstream = self.kind in UPSTREAM_KINDS or self.fault is not None
        return "upstream" if upstream else "gateway"

    @property
    def failure_kind(self) -> str | None:
        """SPEC §9 `gateway.failure.kind` for the attempt span (None: no failure)."""
        if self.fault is not None:
            return "fault"
        if self.detail is not None:
            return self.detail
        if self.kind == "status":
            return None
        if self.kind == "timeout":
            return "timeout"
        if self.kind == "deadline":  # the walk's (or the caller's) deadline, not the upstream
            return "deadline"
        if self.kind == "body_timeout":  # the caller's body stalled: the caller's doing
            return "request_timeout"
        if self.kind == "client_gone":
            return "cancelled"
        if self.kind == "body_too_large":
            return "request_too_large"
        if self.kind == "response_too_large":
            return "response_too_large"
        if self.kind == "body_misframed":
            return "bad_request"
        if self.kind in ("unsafe_address", "not_sent"):
            return self.kind  # the gateway refused to send it: nothing of the upstream's
        return "transport"


NO_CANDIDATE = Outcome("no_candidate")
# The cursor's answer when the next attempt would go back to an upstream already tried and
# that upstream's budget for repeats and hedges is spent (limits.repeat_allowed): the walk
# ends here, with the local error, rather than add load to an upstream already failing.
REPEAT_ALLOWANCE_SPENT = Outcome("repeat_budget")
# The cursor's answer when a pool's 401/403/429 asked for another credential of the same
# upstream and none could be tried (all unusable, or the repeat allowance refused): that
# answer is served as-is (SPEC §5: those statuses never fail over to another upstream).
NO_OTHER_CREDENTIAL = Outcome("no_other_credential")


@dataclass(frozen=True, slots=True)
class WalkState:
    replayable: bool  # method replayable and the whole body buffered (≤ replay_buffer)
    client_connected: bool
    deadline_left: bool
    response_started: bool  # any byte, even http.response.start, sent to the client
    attempts_made: int
    attempt_ceiling: int
    failover_status: Collection[int]
    on_exhausted: Literal["error", "last_response"] = "error"
    other_credential: bool = False  # the upstream just tried has an unused usable credential
    has_last_response: bool = False  # a failover-class response is kept (last_response)
    # Why the request is not replayable (`replay_rule`), None when it is: named by the
    # local error that ends its walk.
    unreplayable: str | None = None
    # The caller's x-gateway-deadline-ms shortened the walk: a deadline that passes is
    # theirs, not the route's (the trace's reason says which, as the error message does).
    caller_deadline: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    error: str | None = None  # the local error code, for "local_error"
    reason: str = ""  # one short phrase for the trace and the docs
    # The rule that ended the walk (SPEC §12: `not_replayable_method`, `not_buffered`,
    # `no_idempotency_key`, `method_override`, `deadline`, `ceiling`, `client_gone`, ...),
    # for a local error body, the log line and `on_exhausted = "last_response"`.
    rule: str | None = None


def is_failover_class(outcome: Outcome, failover_status: Collection[int]) -> bool:
    """A transport error or upstream timeout before response headers, or a status listed
    in `failover_status`. Local outcomes never are, nor anything after the commit point."""
    if outcome.committed:
        return False
    if outcome.kind == "status":
        return outcome.status is not None and outcome.status in failover_status
    return outcome.kind in ("transport", "timeout")


def health_mark(outcome: Outcome, failover_status: Collection[int]) -> bool | None:
    """What the outcome does to the upstream's breaker and credential: True a failure,
    False a success, None nothing at all (the gateway's side of the request, or a failure
    after the commit point: the head was recorded then, as a success, and what follows is
    not failover-class, SPEC §6; an attempt is booked once)."""
    if outcome.responsible != "upstream" or outcome.committed:
        return None
    if outcome.fault is not None and outcome.kind != "status":
        return True  # a hang, even when the walk deadline is what ended it
    return is_failover_class(outcome, failover_status)


def engine_outcome(kind: str, phase: str, *, fault: str | None = None) -> Outcome:
    """What an engine error (`UpstreamError.kind` / `.phase`) says about the attempt: the
    connect-time address guard's refusal; a request the client library would not send
    (`local`: nothing left, SPEC §12); else a transport error or the upstream's own
    timeout. An injected fault that drove the attempt (`blackhole`) stays on it."""
    if kind == "unsafe_address":
        return Outcome("unsafe_address")
    if kind == "local":
        return Outcome("not_sent")
    if kind == "timeout" and phase != "body":
        return Outcome("timeout", fault=fault)
    if kind == "tls":
        return Outcome("transport", fault=fault, detail="tls")
    return Outcome("transport", fault=fault)


def relay_outcome(kind: str | None) -> Outcome:
    """What ended a relay after the commit point: an engine error (`UpstreamError.kind`:
    the upstream's idle timeout, a reset, a body that breaks its own framing), or None for
    a body that went over max_response_body."""
    if kind is None:
        return Outcome("response_too_large", committed=True)
    return Outcome("timeout" if kind == "timeout" else "transport", committed=True)


def local_or(
    outcome: Outcome,
    *,
    client_gone: bool,
    body_too_large: bool,
    body_timed_out: bool,
    body_misframed: bool,
    body_unfinished: bool,
) -> Outcome:
    """SPEC §5 "local conditions are not upstream failures": the request body's own trouble
    wins over whatever the engine made of it. A caller that hung up, sent too much, too
    slowly (an idle gap, or a deadline that ran out while its body was still streaming),
    or not the length it declared, is never the upstream's fault."""
    if client_gone:
        return Outcome("client_gone")
    if body_too_large:
        return Outcome("body_too_large")
    if body_misframed:
        return Outcome("body_misframed")
    if body_timed_out:
        return Outcome("body_timeout")
    if outcome.kind == "deadline" and body_unfinished:
        return Outcome("body_timeout")
    return outcome


IDEMPOTENCY_KEY = b"idempotency-key"


def is_replayable(
    route: RouteConfig,
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
    route: RouteConfig,
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


def attempt_ceiling(route: RouteConfig, *, replayable: bool) -> int:
    """The most upstream requests one walk may make: `1 + retries`, and 1 for a request
    that cannot be repeated. The first of two guards (SPEC §12): `further_attempt_possible`
    still checks `replayable`, so either guard alone stops a replay."""
    if not replayable:
        return 1
    return route.attempt_ceiling


def further_attempt_possible(state: WalkState) -> bool:
    """The conditions of SPEC §5 that do not depend on the last outcome; a hedge needs
    exactly these."""
    return (
        state.replayable
        and state.client_connected
        and state.deadline_left
        and not state.response_started
        and state.attempts_made < state.attempt_ceiling
    )


def further_attempt_allowed(state: WalkState, outcome: Outcome) -> bool:
    """SPEC §5: a further attempt happens only when all of these hold."""
    return further_attempt_possible(state) and is_failover_class(outcome, state.failover_status)


def may_hedge(
    route: RouteConfig,
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


_LOCAL_ERRORS: dict[str, tuple[str, str]] = {
    "body_too_large": ("request_too_large", "the request body went over max_request_body"),
    "body_timeout": ("request_timeout", SLOW_BODY),  # one wording, mid-stream or before
    "body_misframed": ("bad_request", MISFRAMED),  # one wording, mid-stream or in the head
    "unsafe_address": ("upstream_failed", "the upstream address was refused at connect time"),
    "not_sent": (
        "upstream_failed",
        "the client library refused to build the upstream request (a header value, the URL,"
        " an encoding); nothing was sent",
    ),
}
_LOCAL_RULES = {
    "body_too_large": "max_request_body",
    "body_timeout": "body_timeout",
    "body_misframed": "bad_request",
    "unsafe_address": "unsafe_address",
    "not_sent": "not_sent",
}


def decide(outcome: Outcome, state: WalkState) -> Decision:
    """The next action after `outcome` (an attempt's, or NO_CANDIDATE)."""
    if outcome.kind == "client_gone" or not state.client_connected:
        return Decision(
            "abort", reason="the client hung up: nothing more is sent or started",
            rule="client_gone",
        )  # fmt: skip
    if outcome.committed or state.response_started:
        return Decision(
            "abort", rule="response_started",
            reason="failed after the commit point: the response had started, so it is "
            "aborted, never failed over",
        )  # fmt: skip
    if outcome.kind == "no_other_credential":
        return Decision("serve", reason="no other credential of the pool could be tried")
    if outcome.kind == "not_sent" and further_attempt_possible(state):
        # Nothing reached that upstream (e.g. its credential went bad under a running
        # gateway): the next candidate may be sent, and no breaker is marked.
        return Decision("next_candidate", reason="the request could not be sent: the next one")
    if outcome.kind == "deadline":
        return _deadline_passed(state)
    if outcome.kind in _LOCAL_ERRORS:
        code, reason = _LOCAL_ERRORS[outcome.kind]
        return Decision("local_error", code, reason, rule=_LOCAL_RULES[outcome.kind])
    if outcome.kind == "no_candidate":
        if state.attempts_made == 0:
            return Decision(
                "local_error", "route_exhausted", "no candidate could be attempted",
                rule="no_candidate",
            )  # fmt: skip
        return _exhausted(state, "no further candidate could be attempted", "no_candidate")
    if outcome.kind == "repeat_budget":
        return _exhausted(state, "the upstream's budget for repeats is spent", "repeat_budget")
    if not is_failover_class(outcome, state.failover_status):  # a status: all else is above
        if (
            outcome.status in CREDENTIAL_STATUSES
            and state.other_credential
            and further_attempt_possible(state)
        ):
            return Decision(
                "next_credential",
                reason=f"{outcome.status} within a credential pool: another credential",
            )
        return Decision("serve", reason="a response outside failover_status is served")
    if further_attempt_allowed(state, outcome):
        return Decision("next_candidate", reason="failover-class: the next candidate")
    return _exhausted(state, *_why_no_further_attempt(state))


def _deadline_passed(state: WalkState) -> Decision:
    reason = "the route deadline passed"
    if state.caller_deadline:
        reason = "the deadline the caller set with x-gateway-deadline-ms passed"
    return Decision("local_error", "deadline_exceeded", reason, rule="deadline")


def _exhausted(state: WalkState, reason: str, rule: str) -> Decision:
    if not state.deadline_left:
        return _deadline_passed(state)
    if state.on_exhausted == "last_response" and state.has_last_response:
        return Decision("serve", reason=f"{reason}; on_exhausted = last_response", rule=rule)
    return Decision("local_error", "upstream_failed", reason, rule=rule)


def _why_no_further_attempt(state: WalkState) -> tuple[str, str]:
    if not state.replayable:
        return "failover-class, but the request is not replayable", (
            state.unreplayable or "not_replayable_method"
        )
    if state.attempts_made >= state.attempt_ceiling:
        return "failover-class, and the attempt ceiling is reached", "ceiling"
    return "failover-class, and no further attempt is allowed", "not_allowed"


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


def _skip_remedy(context: RequestContext) -> str:
    reasons = dict.fromkeys(s.reason for s in context.skipped)
    unset, retired = _no_credential_candidates(context)
    if unset:
        # No 429 retired these: their variables were empty when the credentials were read
        # (unset under a running gateway after load had checked them).
        reasons.pop("no_credential", None)
    revoked = [name for name in context.revoked if name not in unset]
    if revoked and not retired_for_now(context, unset, revoked):
        reasons.pop("no_credential", None)  # none of them comes back by itself
    remedies = [_SKIP_REMEDY[r] for r in reasons if r in _SKIP_REMEDY]
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
    remedies.append(f"a further upstream in the plan of route {context.route.id!r} would be tried")
    return "; ".join(remedies)


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


def _remedy(rule: str | None, context: RequestContext) -> str:
    remedy = _rule_remedy(rule, context)
    route = context.route
    body = context.body
    if rule in _METHOD_RULES and body is not None and body.buffered is None:
        # The method rule is checked first; a body that was not buffered would stop the
        # replay too, so the method's remedy alone changes nothing.
        remedy += f"; and {_REMEDY['not_buffered']}"
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
        reasons = dict.fromkeys(s.reason for s in context.skipped)
        remedies = "; ".join(_SKIP_REMEDY[r] for r in reasons if r in _SKIP_REMEDY)
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
    backoff = None
    if context.backoff_cut is not None:
        backoff = (
            f"while the walk waited the route's backoff_ms ({context.route.backoff_ms} ms) "
            f"before repeating {context.backoff_cut!r}"
        )
    if caller is not None:
        passed = (
            f"the deadline of {caller} ms the caller set with x-gateway-deadline-ms (the "
            f"route's is {configured} ms) passed after {attempts} attempt(s)"
        )
        if backoff is not None:
            return (
                f"{passed}, {backoff}: the caller may send a larger x-gateway-deadline-ms, or "
                f"none; or lower the route's backoff_ms"
            )
        if waiting is None:
            return f"{passed}; the caller may send a larger x-gateway-deadline-ms, or none"
        name, timer, timeout_ms = waiting
        inside = _inside(name, timer, timeout_ms)
        remedy = f"lower that timeout below {caller} ms so that a hang ends in time for the "
        remedy += "next attempt"
        alone = _no_next_attempt(context, timer)
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
        if configured is not None and timeout_ms < configured:
            remedy = (
                f"the caller may send a larger x-gateway-deadline-ms (above {timeout_ms} ms), "
                f"or none; or {remedy}"
            )
        return f"{passed}, {inside}: {remedy}"
    key = "the route's deadline_ms"
    if context.route.deadline_ms is None:
        key = "[gateway] deadline_ms (or set the route's deadline_ms)"
    passed = f"the route deadline ({configured} ms) passed after {attempts} attempt(s)"
    if backoff is not None:
        return f"{passed}, {backoff}: lower the route's backoff_ms, or raise {key}"
    if waiting is None:
        return f"{passed}; raise {key}"
    name, timer, timeout_ms = waiting
    inside = _inside(name, timer, timeout_ms)
    alone = _no_next_attempt(context, timer)
    if alone is not None:
        return (
            f"{passed}, {inside}; {alone}: raise {key} to wait longer for it (up to "
            f"{timeout_ms} ms)"
        )
    if configured is None or configured < _LEAST_SHARED_DEADLINE_MS:
        return f"{passed}, {inside}: raise {key} above {timeout_ms} ms"
    return (
        f"{passed}, {inside}: lower that below {configured} ms so that a hang ends in time "
        f"for the next attempt, or raise {key} above {timeout_ms} ms"
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


def error_message(decision: Decision, context: RequestContext) -> str:
    """The local error's message: which rule ended the walk, after how many attempts, and
    what configuration would change it."""
    attempts = context.attempt_count
    remedy = _remedy(decision.rule, context)
    if decision.error == "upstream_failed" and attempts:
        record = context.attempts[-1]
        last = record.failure_kind or "status"
        if record.status is not None and last == "status":
            last += f" {record.status}"
        if record.could_not_connect and last == "transport":
            last += " (could not connect)"
        message = f"all {attempts} attempt(s) failed (last failure: {last} at {record.candidate!r})"
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
        elif last == "tls" and record.unverified_certificate:
            message += (
                "; the upstream's TLS certificate did not verify: set ca_file (under "
                "[gateway] or the upstream) to the CA that signed it"
            )
        elif last == "tls":
            message += (
                "; the TLS handshake with it failed before any certificate was checked: "
                "check the url's scheme and port (an https:// url for an upstream that "
                "speaks plain http, or another service's port)"
            )
        return f"{message}; {remedy}" if remedy else message
    if decision.error == "deadline_exceeded":
        return _deadline_message(context)
    if decision.error == "route_exhausted":
        return _route_exhausted(context)
    return decision.reason
