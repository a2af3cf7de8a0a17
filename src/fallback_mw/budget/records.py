"""What a routed request cost and who served it (`UsageRecord`), and each candidate as it
met it (`AttemptOutcome`): made once a request, so compiled (scripts/compile.py), each
with its `__init__` written out. budget/ledger.py, which the ledgers read them from,
names them too."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal


# Built on every routed request (the usage record): plain slotted dataclasses, not frozen
# ones, whose __init__ costs several times more (object.__setattr__ per field); nothing
# changes them once built. `init=False`, the `__init__` written out: a dataclass's
# generated one is interpreted under mypyc too (tests/test_written_inits.py holds it to
# the fields' defaults).
@dataclass(slots=True, init=False)
class AttemptOutcome:
    """One candidate as this request met it: attempted (status / failure kind) or skipped."""

    candidate: str
    status: int | None
    failure: str | None  # "transport", "timeout", "status", "fault", ...
    skipped: str | None  # "breaker_open", "no_credential"
    # The game-day fault behind it: the fault that drove the attempt, or the one whose
    # outcomes opened the breaker a `breaker_open` skip met (SPEC §12).
    fault: str | None

    def __init__(
        self,
        candidate: str,
        status: int | None = None,
        failure: str | None = None,
        skipped: str | None = None,
        fault: str | None = None,
    ) -> None:
        self.candidate = candidate
        self.status = status
        self.failure = failure
        self.skipped = skipped
        self.fault = fault

    def as_dict(self) -> dict[str, object]:
        data: dict[str, object] = {"candidate": self.candidate}
        if self.status is not None:
            data["status"] = self.status
        if self.failure is not None:
            data["failure"] = self.failure
        if self.skipped is not None:
            data["skipped"] = self.skipped
        if self.fault is not None:
            data["fault"] = self.fault
        return data

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> AttemptOutcome:
        status = data.get("status")
        failure = data.get("failure")
        skipped = data.get("skipped")
        fault = data.get("fault")
        return cls(
            candidate=str(data.get("candidate", "")),
            status=status if isinstance(status, int) else None,
            failure=failure if isinstance(failure, str) else None,
            skipped=skipped if isinstance(skipped, str) else None,
            fault=fault if isinstance(fault, str) else None,
        )


# As AttemptOutcome's.
@dataclass(slots=True, init=False)
class UsageRecord:
    """What one routed request cost and who served it. Names, numbers and codes only:
    never a body, header value, credential or query string."""

    request_id: str
    route: str
    tenant: str
    at: datetime
    budget_id: str | None
    candidates: tuple[str, ...]  # the planned order
    attempts: tuple[AttemptOutcome, ...]
    chosen: str | None
    outcome: str | None
    status: int | None
    model: str | None
    input_tokens: int | None
    output_tokens: int | None
    cost: Decimal | None  # from reported usage and [prices], when both were known
    charged: Decimal | None  # what the budget was settled with
    duration_ms: float | None  # first byte in to last byte out, when measured
    rule: str | None  # the SPEC §5/§12 rule that ended the walk (the log line's rule=)

    def __init__(
        self,
        request_id: str,
        route: str,
        tenant: str,
        at: datetime | None = None,
        budget_id: str | None = None,
        candidates: tuple[str, ...] = (),
        attempts: tuple[AttemptOutcome, ...] = (),
        chosen: str | None = None,
        outcome: str | None = None,
        status: int | None = None,
        model: str | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        cost: Decimal | None = None,
        charged: Decimal | None = None,
        duration_ms: float | None = None,
        rule: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.route = route
        self.tenant = tenant
        self.at = datetime.now(UTC) if at is None else at
        self.budget_id = budget_id
        self.candidates = candidates
        self.attempts = attempts
        self.chosen = chosen
        self.outcome = outcome
        self.status = status
        self.model = model
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.cost = cost
        self.charged = charged
        self.duration_ms = duration_ms
        self.rule = rule

    @property
    def fault(self) -> bool:
        """A game-day fault drove an attempt of this request, or a breaker its outcomes
        opened made the request skip a candidate (SPEC §12: booked as the fault)."""
        return any(a.fault is not None for a in self.attempts)
