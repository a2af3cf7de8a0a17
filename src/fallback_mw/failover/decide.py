"""The next action after any outcome (`decide`), a pure function of facts the walk
gathers (SPEC §5): whether a further attempt may run (`further_attempt_possible` /
`_allowed`), and what ends the walk. The walker, the hedge, the shadow copy, the docs and
the trace follow; what a local error then says is `failover.messages.error_message`.

Decided elsewhere, each in one place (docs/failover.md, "Where each rule is decided",
a table tests/test_decide.py checks against the imports): what an outcome is, its
failover class and what reaches breakers and credentials (`failover.outcome`);
replayability, the attempt ceiling and whether to hedge (`failover.replay`); the
effective deadline (`routing.effective_deadline_ms`); the plan order
(`plan.candidate_order`); skips, passes and the backoff before a repeat (the walker's
candidate cursor); admission (breaker, declared capacity, repeat allowance:
`failover.attempt.AttemptLifecycle.gate`); the commit point
(`layers.walker.stream.commit`). The deadline is enforced where time passes (the walk
loop checks it before each attempt, the runner bounds each attempt by it); what its
running out means is `decide`'s.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Final, Literal

from fallback_mw.failover.outcome import CREDENTIAL_STATUSES, Outcome, is_failover_class
from fallback_mw.request.refusals import MISFRAMED, SLOW_BODY

Action = Literal["serve", "next_candidate", "next_credential", "local_error", "abort"]


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
_WALK_STATES: Final[dict[tuple[object, ...], WalkState]] = {}


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


_LOCAL_ERRORS: Final[dict[str, tuple[str, str]]] = {
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
_NOT_SENT: Final = frozenset({"not_sent", "host_limit"})
_LOCAL_RULES: Final = {
    "body_too_large": "max_request_body",
    "body_timeout": "body_timeout",
    "body_misframed": "bad_request",
    "unsafe_address": "unsafe_address",
    "not_sent": "not_sent",
    "host_limit": "host_limit",
}


# The two decisions of nearly every attempt, made once (frozen: shared).
_SERVED: Final = Decision("serve", reason="a response outside failover_status is served")
_FAILOVER: Final = Decision("next_candidate", reason="failover-class: the next candidate")


def decide(outcome: Outcome, state: WalkState) -> Decision:
    """The next action after `outcome` (an attempt's, or NO_CANDIDATE)."""
    kind = outcome.kind
    if (
        kind == "status"
        and state.client_connected
        and not state.response_started
        and not outcome.committed
    ):
        # An answer's head, before the commit point, the caller still there (nearly every
        # attempt): none of the rows below that read another kind applies to it.
        return _answered(outcome, state)
    if kind == "client_gone" or not state.client_connected:
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
        return _exhausted(state, "the upstream's repeat allowance is spent", "repeat_budget")
    return _answered(outcome, state)  # a status, a transport failure or a timeout


def _answered(outcome: Outcome, state: WalkState) -> Decision:
    """`decide` for an upstream's answer (a status, or a transport failure or timeout)
    once none of the rows before applies."""
    if not is_failover_class(outcome, state.failover_status):
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
