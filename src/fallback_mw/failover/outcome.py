"""What an attempt's outcome is, as pure functions of facts the walk gathers (SPEC §5):
what an engine error means (`engine_outcome`; after the commit point, `relay_outcome`),
that the caller's own trouble wins over it (`local_or`), who is responsible
(`Outcome.responsible`), failover-class (`is_failover_class`; in a hedge race,
`fails_in_a_race`), and what reaches breakers and credentials (`health_mark`). What the
walk does next with an outcome is `failover.decide.decide`'s.

Only upstream outcomes feed breakers and credential health (`health_mark`, applied only
by `AttemptLifecycle.mark_health`), and only they can be failover-class: one caller can
never open a breaker for everyone else.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Final, Literal

# Within a credential pool these may move to another credential of the same upstream.
CREDENTIAL_STATUSES: Final = frozenset({401, 403, 429})

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
UPSTREAM_KINDS: Final = frozenset({"status", "transport", "timeout"})


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
_STATUS_OUTCOMES: Final[dict[int, Outcome]] = {}


def status_outcome(status: int) -> Outcome:
    """`Outcome("status", status)`: a response head arrived."""
    found = _STATUS_OUTCOMES.get(status)
    if found is None:
        found = Outcome("status", status)
        if len(_STATUS_OUTCOMES) < 1024:
            _STATUS_OUTCOMES[status] = found
    return found


NO_CANDIDATE: Final = Outcome("no_candidate")
# The cursor's answer when the next attempt would go back to an upstream already tried and
# that upstream's budget for repeats and hedges is spent (limits.repeat_allowed): the walk
# ends here, with the local error, rather than add load to an upstream already failing.
REPEAT_ALLOWANCE_SPENT: Final = Outcome("repeat_budget")
# The cursor's answer when a pool's 401/403/429 asked for another credential of the same
# upstream and none could be tried (all unusable, or the repeat allowance refused): that
# answer is served as-is (SPEC §5: those statuses never fail over to another upstream).
NO_OTHER_CREDENTIAL: Final = Outcome("no_other_credential")


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
