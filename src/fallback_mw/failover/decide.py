"""The failover rules of SPEC §5, as pure functions of facts the walk gathers.

Decided here: what an engine error means (`engine_outcome`; after the commit point,
`relay_outcome`), that the caller's own trouble
wins over it (`local_or`), who is responsible (`Outcome.responsible`), failover-class
(`is_failover_class`), what reaches breakers and credentials (`health_mark`),
replayability (`is_replayable`), the attempt ceiling (`attempt_ceiling`), whether a
further attempt may run (`further_attempt_possible` / `_allowed`), whether to hedge
(`may_hedge`), and the next action after any outcome (`decide`). The walker, the hedge,
the shadow copy, the docs and the trace follow; what a local error then says is
`failover.messages.error_message`.

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

from fallback_mw.config.views import AnyRoute
from fallback_mw.request.refusals import MISFRAMED, SLOW_BODY
from fallback_mw.security.fields import override_methods

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
    "host_refused",  # the host's receive raised while the body streamed (its middleware)
    "body_too_large",  # the streamed request body went over max_request_body
    "body_timeout",  # the request body did not arrive before the deadline
    "body_misframed",  # the streamed request body was not the length it declared
    "unsafe_address",  # the connect-time guard refused the upstream's address
    "not_sent",  # the client library refused to build or send the request (nothing sent)
    "host_limit",  # the gateway's host had no descriptor, memory or port for it (nothing sent)
    # the caller's own Range request answered with a range of a coded body, which the echo
    # mask cannot read: refused unread, and not the upstream's failure (it did as asked)
    "unreadable_range",
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
        if self.kind in ("client_gone", "host_refused"):
            return "cancelled"
        if self.kind == "body_too_large":
            return "request_too_large"
        if self.kind == "response_too_large":
            return "response_too_large"
        if self.kind == "body_misframed":
            return "bad_request"
        if self.kind in ("unsafe_address", "not_sent", "host_limit", "unreadable_range"):
            return self.kind  # the gateway refused it: nothing of the upstream's
        return "transport"


# An upstream's answer, one Outcome per status: frozen, so shared (building a frozen
# dataclass costs about 9k instructions, every attempt made one). Bounded: an upstream may
# answer with any three digits.
_STATUS_OUTCOMES: dict[int, Outcome] = {}


def status_outcome(status: int) -> Outcome:
    """`Outcome("status", status)`: a response head arrived."""
    found = _STATUS_OUTCOMES.get(status)
    if found is None:
        found = Outcome("status", status)
        if len(_STATUS_OUTCOMES) < 1024:
            _STATUS_OUTCOMES[status] = found
    return found


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


# A walk's states, one WalkState per distinct set of fields: frozen, so shared. Building a
# frozen dataclass of twelve fields costs about 24k instructions (each field set through
# object.__setattr__), every decision made one; a walk's states are few (booleans, small
# counts, the route's settings). Bounded for configs reloaded with ever new settings.
_WALK_STATES: dict[tuple[object, ...], WalkState] = {}


def walk_state(
    *,
    replayable: bool,
    client_connected: bool,
    deadline_left: bool,
    response_started: bool,
    attempts_made: int,
    attempt_ceiling: int,
    failover_status: Collection[int],
    on_exhausted: Literal["error", "last_response"],
    other_credential: bool,
    has_last_response: bool,
    unreplayable: str | None,
    caller_deadline: bool,
) -> WalkState:
    """`WalkState(...)` of these fields (`failover_status` hashable: a route's tuple)."""
    key = (
        replayable, client_connected, deadline_left, response_started, attempts_made,
        attempt_ceiling, failover_status, on_exhausted, other_credential, has_last_response,
        unreplayable, caller_deadline,
    )  # fmt: skip
    found = _WALK_STATES.get(key)
    if found is None:
        found = WalkState(
            replayable, client_connected, deadline_left, response_started, attempts_made,
            attempt_ceiling, failover_status, on_exhausted, other_credential,
            has_last_response, unreplayable, caller_deadline,
        )  # fmt: skip
        if len(_WALK_STATES) < 4096:
            _WALK_STATES[key] = found
    return found


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


def fails_in_a_race(outcome: Outcome, failover_status: Collection[int], *, pooled: bool) -> bool:
    """An answer that does not win a hedge race while the other attempt still runs: a
    failover-class one, or within a credential pool (`pooled`) that credential's own
    refusal (401/403/429: the walk moves to another credential of the pool, SPEC §6).
    Either is finished as the failure it is; the other attempt may yet answer well."""
    if is_failover_class(outcome, failover_status):
        return True
    return pooled and outcome.kind == "status" and outcome.status in CREDENTIAL_STATUSES


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
    if kind == "host_limit":
        return Outcome("host_limit")
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
    host_refused: bool = False,
) -> Outcome:
    """SPEC §5 "local conditions are not upstream failures": the request body's own trouble
    wins over whatever the engine made of it. A caller that hung up, sent too much, too
    slowly (an idle gap, or a deadline that ran out while its body was still streaming),
    or not the length it declared, or a host whose middleware in front refused the body
    as it streamed, is never the upstream's fault."""
    if client_gone:
        return Outcome("client_gone")
    if host_refused:
        return Outcome("host_refused")
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
    "host_limit": (
        "overloaded",
        "the gateway's own host could not open a connection to the upstream; nothing was "
        "sent and no upstream is blamed: raise the gateway process's open-file limit "
        "(ulimit -n, systemd LimitNOFILE) or set [gateway] max_concurrency below what the "
        "host can carry",
    ),
}
# What ended an attempt before anything was sent, where another candidate may still be sent.
_NOT_SENT = frozenset({"not_sent", "host_limit"})
_LOCAL_RULES = {
    "body_too_large": "max_request_body",
    "body_timeout": "body_timeout",
    "body_misframed": "bad_request",
    "unsafe_address": "unsafe_address",
    "not_sent": "not_sent",
    "host_limit": "host_limit",
}


# The two decisions of nearly every attempt, made once (frozen: shared).
_SERVED = Decision("serve", reason="a response outside failover_status is served")
_FAILOVER = Decision("next_candidate", reason="failover-class: the next candidate")


def decide(outcome: Outcome, state: WalkState) -> Decision:
    """The next action after `outcome` (an attempt's, or NO_CANDIDATE)."""
    if outcome.kind == "client_gone" or not state.client_connected:
        return Decision(
            "abort", reason="the client hung up: nothing more is sent or started",
            rule="client_gone",
        )  # fmt: skip
    if outcome.kind == "host_refused" and not state.response_started:
        return Decision(
            "abort", rule="host_refused",
            reason="a middleware in front of the gateway refused the request body: nothing"
            " is sent, its error goes back to it to answer",
        )  # fmt: skip
    if outcome.committed or state.response_started:
        return Decision(
            "abort", rule="response_started",
            reason="failed after the commit point: the response had started, so it is "
            "aborted, never failed over",
        )  # fmt: skip
    if outcome.kind == "no_other_credential":
        return Decision("serve", reason="no other credential of the pool could be tried")
    if outcome.kind in _NOT_SENT and further_attempt_possible(state):
        # Nothing reached that upstream (e.g. its credential went bad under a running
        # gateway; this host could not open a connection to it: out of descriptors, or an
        # address it cannot reach, EADDRNOTAVAIL, as an IPv6 literal where IPv6 is off):
        # the next candidate may be sent (a pooled connection may serve it), and no
        # breaker is marked.
        return Decision("next_candidate", reason="the request could not be sent: the next one")
    if outcome.kind == "unreadable_range":
        # The upstream answered the caller's own Range request as asked; the gateway cannot
        # relay that range (its mask cannot read it). No upstream is blamed: one caller's
        # ranges must not open a breaker for everyone else. The walk goes on as it would.
        if further_attempt_possible(state):
            return Decision(
                "next_candidate",
                reason="a range of a coded body the caller asked for, which the gateway "
                "cannot mask: the next candidate",
            )
        why, rule = _why_no_further_attempt(state)
        return _exhausted(state, why.replace("failover-class", "an unreadable range", 1), rule)
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
        if outcome.status in CREDENTIAL_STATUSES and state.other_credential:
            if further_attempt_possible(state):
                return Decision(
                    "next_credential",
                    reason=f"{outcome.status} within a credential pool: another credential",
                )
            # The pool had a key left, and the walk could not try it: say why (the trace).
            return Decision(
                "serve",
                reason=f"{outcome.status} within a credential pool, served as-is: "
                f"{_why_no_other_credential(state)}",
            )
        return _SERVED
    if further_attempt_allowed(state, outcome):
        return _FAILOVER
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


def _why_no_other_credential(state: WalkState) -> str:
    """Why a pool's unused key was not tried after its 401/403/429 (the trace's reason)."""
    if not state.replayable:
        return f"the request is not replayable ({state.unreplayable or 'not_replayable_method'})"
    if state.attempts_made >= state.attempt_ceiling:
        return "the attempt ceiling (1 + retries) is reached"
    return "the deadline has passed"


def _why_no_further_attempt(state: WalkState) -> tuple[str, str]:
    if not state.replayable:
        return "failover-class, but the request is not replayable", (
            state.unreplayable or "not_replayable_method"
        )
    if state.attempts_made >= state.attempt_ceiling:
        return "failover-class, and the attempt ceiling is reached", "ceiling"
    return "failover-class, and no further attempt is allowed", "not_allowed"
