"""What a request's walk records of each candidate: an attempt made (`AttemptRecord`) or
a candidate passed over without one (`SkipRecord`). Kept in the request's context
(request/context.py, which names them too)."""

from __future__ import annotations

from dataclasses import dataclass

from fallback_mw.timers import monotonic


# `init=False` and the `__init__` written out: a dataclass's generated `__init__` is
# interpreted Python under mypyc too (the compiled core's constructor calls it through
# `tp_init`: some 6,600 instructions an attempt), a written one is compiled (a third of
# that). The same parameters, in the same order, with the same defaults
# (tests/test_written_inits.py holds that; `dataclasses.replace` calls it with every field).
@dataclass(slots=True, init=False)
class AttemptRecord:
    candidate: str
    number: int
    server_address: str
    server_port: int | None  # the URL's port, or its scheme's default
    started: float
    duration: float | None
    status: int | None
    failure_kind: str | None  # "transport", "timeout", "status", "fault", ...
    could_not_connect: bool  # the engine made no connection (refused, no route, DNS)
    # What failed and what would change it, for the local error's message (a `tls`
    # failure: upstream/tls.tls_problem; an egress proxy that refused the tunnel).
    failure_detail: str | None
    # The upstream's own timer that ended it (a `timeout`): `connect_timeout_ms` or
    # `first_byte_timeout_ms`, named with its value by the local error's message.
    timer: str | None
    fault: str | None  # "fail" / "hang" when a game-day fault drove the attempt
    # It waited for a connection slot (`max_connections`) and ended before getting one:
    # nothing was sent (its declared-capacity count is taken back).
    queued_only: bool
    hedge: bool
    credential_index: int | None  # position in the pool, never the value or name
    responsible: str | None  # "upstream" or "gateway": who the outcome is down to
    decision: str | None  # what the walk did next ("next_candidate", "serve", ...)
    reason: str | None  # why, in one phrase (the rule of SPEC §5 that applied)
    # The answer's Content-Type and Content-Encoding, read once as its head arrived (the
    # relay reads them from here: layers.walker.stream.commit).
    coding: tuple[bytes | None, bytes | None] | None
    # Why its answer was refused unread (credentials.unmaskable_answer), for the message.
    unmaskable: str | None

    def __init__(
        self,
        candidate: str,
        number: int,
        server_address: str,
        server_port: int | None = None,
        started: float | None = None,  # now (time.monotonic)
        duration: float | None = None,
        status: int | None = None,
        failure_kind: str | None = None,
        could_not_connect: bool = False,
        failure_detail: str | None = None,
        timer: str | None = None,
        fault: str | None = None,
        queued_only: bool = False,
        hedge: bool = False,
        credential_index: int | None = None,
        responsible: str | None = None,
        decision: str | None = None,
        reason: str | None = None,
        coding: tuple[bytes | None, bytes | None] | None = None,
        unmaskable: str | None = None,
    ) -> None:
        self.candidate = candidate
        self.number = number
        self.server_address = server_address
        self.server_port = server_port
        self.started = monotonic() if started is None else started
        self.duration = duration
        self.status = status
        self.failure_kind = failure_kind
        self.could_not_connect = could_not_connect
        self.failure_detail = failure_detail
        self.timer = timer
        self.fault = fault
        self.queued_only = queued_only
        self.hedge = hedge
        self.credential_index = credential_index
        self.responsible = responsible
        self.decision = decision
        self.reason = reason
        self.coding = coding
        self.unmaskable = unmaskable


@dataclass(slots=True)
class SkipRecord:
    candidate: str
    reason: str  # one of SKIP_REASONS (request/context.py)
    after_attempts: int = 0  # attempts made before it: places the skip in the walk's order
    fault: str | None = None  # breaker_open: the fault whose outcomes opened that breaker
