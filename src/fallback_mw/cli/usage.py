"""`fallback-mw usage`: what each routed request cost and who served it (SPEC §7).
`--incidents`: only the requests that failed over, skipped a candidate, ended in a local
error, were served an upstream's 5xx or were cut short after the commit point, each with
its trail (every attempt and skip, in the walk's order)."""

from __future__ import annotations

import argparse
import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

from fallback_mw.budget import Ledger, UsageRecord
from fallback_mw.budget.cost import format_money
from fallback_mw.cli.app import Console, Refused
from fallback_mw.cli.budgets import with_ledger
from fallback_mw.cli.show import one_line, print_table
from fallback_mw.cli.target import StoreTarget
from fallback_mw.cli.verbs.shared import INCIDENT_SCAN

_RELATIVE = re.compile(r"^(\d{1,9})([smhdw])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
COLUMNS = ("TIME", "ROUTE", "TENANT", "ATTEMPTS", "CHOSEN", "OUTCOME", "TOKENS", "COST", "CHARGED")
INCIDENT_COLUMNS = (
    "TIME", "REQUEST", "ROUTE", "TENANT", "INCIDENT", "TRAIL", "OUTCOME", "RULE", "STATUS"
)  # fmt: skip
# Outcomes that are not the gateway answering itself (served, cut short after the commit,
# the caller gone). Not `response_too_large`: with no chosen candidate it is the local 502
# refused before the commit point; with one, an `aborted` incident (`_CUT_SHORT`).
_NOT_LOCAL = frozenset({"served", "aborted", "client_disconnected"})


# A candidate's response failed after the commit point: aborted, never failed over.
_CUT_SHORT = frozenset({"aborted", "response_too_large"})


def incident_kinds(record: UsageRecord) -> list[str]:
    """Why a request is an incident: `failed_over` (more than one attempt: another
    candidate or another credential), `skipped` (a candidate skipped: breaker, credential,
    capacity, repeat budget), `local_error` (the gateway answered itself), `aborted` (the
    chosen response failed after the commit point: rule `response_started`), `cancelled`
    (the host cancelled the request after the chosen response started, e.g. a deploy's
    `--timeout-graceful-shutdown`: the client's answer was cut), `server_error` (an
    upstream's 5xx served as it is: outside failover_status, or the last answer under
    on_exhausted = "last_response"; the alert rules count it too), then `fault` when a
    game-day fault caused it (SPEC §12: booked as the fault, not as an outage). Empty:
    none. A body the host app's own middleware refused and answered (rule `host_refused`,
    outcome `cancelled`) is the caller's doing: no incident of its own."""
    kinds = []
    if sum(1 for a in record.attempts if a.skipped is None) > 1:
        kinds.append("failed_over")
    if any(a.skipped is not None for a in record.attempts):
        kinds.append("skipped")
    if (
        record.chosen is None
        and record.outcome is not None
        and record.outcome not in _NOT_LOCAL
        and record.rule != "host_refused"  # the host's own answer to the caller's body
    ):
        kinds.append("local_error")
    if record.chosen is not None and record.outcome in _CUT_SHORT:
        kinds.append("aborted")
    if record.chosen is not None and record.outcome == "cancelled":
        kinds.append("cancelled")
    if record.outcome == "served" and record.status is not None and record.status >= 500:
        kinds.append("server_error")
    if kinds and record.fault:
        # Game-day traffic: a fault drove an attempt or emptied the way (a breaker its
        # outcomes opened). Marked, so a review of real outages can leave it out.
        kinds.append("fault")
    return kinds


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """`90s`, `30m`, `1h`, `2d`, `1w` ago, or an ISO date / time (UTC when naive)."""
    match = _RELATIVE.match(value.strip())
    try:
        if match:
            seconds = int(match.group(1)) * _SECONDS[match.group(2)]
            return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
        moment = datetime.fromisoformat(value.strip())
        # In UTC here: a time whose zone takes it past year 1 or 9999 (0001-01-01T00:00+01:00)
        # was an OverflowError in the ledger's query, an "unexpected internal error".
        return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except (ValueError, OverflowError):
        raise Refused(f"--since {value!r}: use e.g. 1h, 2d or 2026-11-30T12:00") from None


def usage_json(record: UsageRecord) -> dict[str, Any]:
    return {
        "at": record.at.astimezone(UTC).isoformat(),
        "request_id": record.request_id,
        "route": record.route,
        "tenant": record.tenant,
        "budget": record.budget_id,
        "candidates": list(record.candidates),
        "attempts": [a.as_dict() for a in record.attempts],
        "chosen": record.chosen,
        "outcome": record.outcome,
        "status": record.status,
        "model": record.model,
        "input_tokens": record.input_tokens,
        "output_tokens": record.output_tokens,
        "cost": None if record.cost is None else format_money(record.cost),
        "charged": None if record.charged is None else format_money(record.charged),
        "rule": record.rule,
    }


def _attempts_text(record: UsageRecord) -> str:
    parts = []
    for attempt in record.attempts:
        if attempt.fault is not None:
            # The fault's doing, never to be read as the upstream's: `primary:503(fault:fail)`
            # (a synthetic answer), `primary:fault:hang`, `primary:skipped(breaker_open,
            # fault:fail)` (a breaker the fault's outcomes opened).
            if attempt.skipped:
                parts.append(
                    f"{attempt.candidate}:skipped({attempt.skipped},fault:{attempt.fault})"
                )
            elif attempt.status is None and attempt.failure in (None, "fault"):
                parts.append(f"{attempt.candidate}:fault:{attempt.fault}")
            else:
                seen = attempt.status if attempt.status is not None else attempt.failure
                parts.append(f"{attempt.candidate}:{seen}(fault:{attempt.fault})")
        elif attempt.skipped:
            parts.append(f"{attempt.candidate}:skipped({attempt.skipped})")
        elif attempt.status is not None and attempt.failure == "cancelled":
            # A hedge that lost the race with its head in hand: closed unused, not aborted.
            parts.append(f"{attempt.candidate}:{attempt.status}(cancelled)")
        elif attempt.status is not None and attempt.failure not in (None, "status", "fault"):
            # A head, then a failure after the commit point (rule response_started).
            parts.append(f"{attempt.candidate}:{attempt.status}(aborted:{attempt.failure})")
        elif attempt.status is not None:
            parts.append(f"{attempt.candidate}:{attempt.status}")
        else:
            parts.append(f"{attempt.candidate}:{attempt.failure or '?'}")
    return ",".join(parts) or "-"


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def _row(record: UsageRecord) -> tuple[str, ...]:
    return (
        record.at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        record.route,
        record.tenant,  # the caller's text: print_table makes every cell one printable line
        _attempts_text(record),
        record.chosen or "-",
        record.outcome or "-",
        f"{_n(record.input_tokens)}/{_n(record.output_tokens)}",
        "-" if record.cost is None else format_money(record.cost),
        "-" if record.charged is None else format_money(record.charged),
    )


def _incident_row(record: UsageRecord) -> tuple[str, ...]:
    return (
        record.at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        record.request_id,
        record.route,
        record.tenant,  # the caller's text: print_table makes every cell one printable line
        ",".join(incident_kinds(record)),
        _attempts_text(record),
        record.outcome or "-",
        record.rule or "-",  # what ended the walk, as the request log line's rule=
        _n(record.status),
    )


def _filters(args: argparse.Namespace) -> str:
    given = (("since", args.since), ("route", args.route), ("tenant", args.tenant))
    parts = [f"{flag} {one_line(value)}" for flag, value in given if value]
    return f" ({', '.join(parts)})" if parts else ""


def usage(args: argparse.Namespace, console: Console) -> None:
    since = parse_since(args.since) if args.since else None
    if not 1 <= args.limit <= 1_000_000:
        raise Refused("--limit must be between 1 and 1000000")

    incidents = bool(args.incidents)
    scan = max(args.limit, INCIDENT_SCAN) if incidents else args.limit

    async def action(ledger: Ledger, target: StoreTarget) -> list[UsageRecord]:
        return await ledger.usage(since=since, route=args.route, tenant=args.tenant, limit=scan)

    records = with_ledger(args, console, action)
    if incidents:
        # The records come oldest first: the newest `--limit` incidents are the last ones.
        records = [record for record in records if incident_kinds(record)][-args.limit :]
    if not records and not args.json:
        what = "incidents" if incidents else "usage records"
        console.print(f"no {what}{_filters(args)}")
        return
    if args.json:
        for record in records:
            data = usage_json(record)
            if incidents:
                data["incident"] = incident_kinds(record)
            console.print(json.dumps(data, separators=(",", ":")))
        return
    if incidents:
        print_table(console, [INCIDENT_COLUMNS, *(_incident_row(r) for r in records)])
        return
    print_table(console, [COLUMNS, *(_row(record) for record in records)])
