"""The ledger's tables, versioned in the shared `fmw_schema` table (component "ledger"),
and what the SQL ledgers share: row encoding and a short cache of stored budgets.

Money columns are integer nano-units (see cost.py). Every table is prefixed `fmw_`."""

from __future__ import annotations

import json
import math
import time
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, TypeGuard

from fallback_mw.budget.cost import from_units, to_units
from fallback_mw.budget.ledger import AttemptOutcome, BudgetUnreadable, Hold, UsageRecord
from fallback_mw.config import BudgetConfig
from fallback_mw.request.context import MAX_NAME
from fallback_mw.store.versions import unwritten_version, written_version

SCHEMA_TABLE = (
    "CREATE TABLE IF NOT EXISTS fmw_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL)"
)
COMPONENT = "ledger"
STALE_HOLD_SECONDS = 3600  # a hold this old was left by a process that died mid-request
# ... or belongs to a stream still running (bounded by its idle timeouts, not the deadline):
# a reaped hold is kept this long in fmw_budget_reaped, so a settlement that comes after all
# charges what its request cost, not the hold.
REAPED_KEPT_SECONDS = 7 * 86400
# A running ledger looks for stale holds this often (on a hold), not only when it opens:
# under `serve --workers N` a dead worker's replacement opens its ledger while the hold
# the dead one left is still fresh.
REAP_INTERVAL = 60.0

# version -> statements, per dialect. Add a version; never edit a shipped one.
_V1 = [
    "CREATE TABLE fmw_budgets (budget_id TEXT PRIMARY KEY, limit_units BIGINT NOT NULL, "
    "window_kind TEXT NOT NULL, default_hold_units BIGINT NOT NULL, updated_at {ts} NOT NULL)",
    "CREATE TABLE fmw_budget_windows (budget_id TEXT NOT NULL, window_start TEXT NOT NULL, "
    "spent_units BIGINT NOT NULL DEFAULT 0, held_units BIGINT NOT NULL DEFAULT 0, "
    "PRIMARY KEY (budget_id, window_start))",
    "CREATE TABLE fmw_budget_holds (hold_id TEXT PRIMARY KEY, budget_id TEXT NOT NULL, "
    "window_start TEXT NOT NULL, amount_units BIGINT NOT NULL, created_at {ts} NOT NULL)",
    "CREATE INDEX fmw_budget_holds_created ON fmw_budget_holds (created_at)",
    "CREATE TABLE fmw_usage (id {serial} PRIMARY KEY, at {ts} NOT NULL, "
    "request_id TEXT NOT NULL, route TEXT NOT NULL, tenant TEXT NOT NULL, budget_id TEXT, "
    "candidates TEXT NOT NULL, attempts TEXT NOT NULL, chosen TEXT, outcome TEXT, "
    "status INTEGER, model TEXT, input_tokens BIGINT, output_tokens BIGINT, "
    "cost_units BIGINT, charged_units BIGINT)",
    "CREATE INDEX fmw_usage_at ON fmw_usage (at)",
]
# v2: how long each routed request took (`fallback-mw gameday` reads its p99 from these);
# NULL in rows written before, or by a gateway that does not measure it.
_V2 = ["ALTER TABLE fmw_usage ADD COLUMN duration_ms {real}"]
# v3: the rule that ended the walk (`fallback-mw usage --incidents`, as the log line's
# `rule=`); NULL in rows written before, and for a walk no rule ended.
_V3 = ["ALTER TABLE fmw_usage ADD COLUMN rule TEXT"]
# v4: the holds the reaper settled at their amount, kept a while (REAPED_KEPT_SECONDS): a
# request still running when its hold went stale (a stream read slowly for over an hour)
# settles the difference between what it cost and what the reaper charged.
_V4 = [
    "CREATE TABLE fmw_budget_reaped (hold_id TEXT PRIMARY KEY, budget_id TEXT NOT NULL, "
    "window_start TEXT NOT NULL, amount_units BIGINT NOT NULL, reaped_at {ts} NOT NULL)",
    "CREATE INDEX fmw_budget_reaped_at ON fmw_budget_reaped (reaped_at)",
]
_TYPES = {
    "sqlite": {"ts": "TEXT", "serial": "INTEGER", "real": "REAL"},
    "postgresql": {"ts": "TIMESTAMPTZ", "serial": "BIGSERIAL", "real": "DOUBLE PRECISION"},
}


def migrations(dialect: str) -> dict[int, list[str]]:
    types = _TYPES[dialect]
    return {
        version: [s.format(**types) for s in steps]
        for version, steps in ((1, _V1), (2, _V2), (3, _V3), (4, _V4))
    }


LATEST_VERSION = max(migrations("sqlite"))


class SchemaTooNew(Exception):
    pass


def check_version(current: object) -> int:
    """`current`, the ledger's version as `fmw_schema` holds it, when this package can use
    it. One no version writes (text, a fraction, a negative number: edited by hand) failed
    `budgets` verbs and every budgeted request with an internal error."""
    version = written_version(current)
    if version is None:
        raise SchemaTooNew(unwritten_version(current, "the store's ledger schema"))
    if version > LATEST_VERSION:
        raise SchemaTooNew(
            f"the store's ledger schema is version {version}; this fallback_mw knows "
            f"up to {LATEST_VERSION} (upgrade the package)"
        )
    return version


def pending_migrations(current: int, dialect: str) -> list[str]:
    """The statements taking a ledger schema at version `current` to LATEST_VERSION."""
    current = check_version(current)
    steps = migrations(dialect)
    return [s for version in range(current + 1, LATEST_VERSION + 1) for s in steps[version]]


# --- row encoding --------------------------------------------------------------------


def encode_sqlite_time(moment: datetime) -> str:
    """`2026-11-30T12:34:56.123456Z`: UTC, the microseconds always written. The year in
    four digits, as the stored times have it: strftime's %Y wrote 999, so `usage --since
    0999-12-31` compared "999-" with "2026-" as text and found nothing (PostgreSQL compares
    instants and found every record). `isoformat` writes the same (four digits, the offset
    of UTC cut) for about half of strftime's cost: a budgeted request writes two."""
    return moment.astimezone(UTC).isoformat(timespec="microseconds")[:-6] + "Z"


def decode_sqlite_time(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)


def usage_values(record: UsageRecord) -> tuple[object, ...]:
    """The columns after `at`, in table order."""
    return (
        record.request_id,
        record.route,
        record.tenant[:MAX_NAME],
        record.budget_id,
        candidates_json(record.candidates),
        attempts_json(record.attempts),
        record.chosen,
        record.outcome,
        record.status,
        record.model,
        record.input_tokens,
        record.output_tokens,
        None if record.cost is None else to_units(record.cost),
        None if record.charged is None else to_units(record.charged),
        record.duration_ms,
        record.rule,
    )


# A record's candidates and attempts as JSON text, kept by their values: a route's plan and
# the attempts of a served request repeat from record to record, and `json.dumps` costs
# a few µs each (two per usage record). Kept only for values whose equality decides their
# text: names that are str, a status that is an int or None (True == 1 dumps as `true`).
_JSON_KEPT = 1024
_CANDIDATES: dict[tuple[str, ...], str] = {}
_ATTEMPTS: dict[tuple[tuple[object, ...], ...], str] = {}


def candidates_json(candidates: tuple[str, ...]) -> str:
    plain = type(candidates) is tuple and all(type(name) is str for name in candidates)
    text = _CANDIDATES.get(candidates) if plain else None
    if text is None:
        text = json.dumps(list(candidates))
        if plain:
            _keep(_CANDIDATES, candidates, text)
    return text


def attempts_json(attempts: tuple[AttemptOutcome, ...]) -> str:
    key = _attempts_key(attempts)
    text = None if key is None else _ATTEMPTS.get(key)
    if text is None:
        text = json.dumps([a.as_dict() for a in attempts])
        if key is not None:
            _keep(_ATTEMPTS, key, text)
    return text


def _keep(table: dict[Any, str], key: Any, text: str) -> None:
    """`text` kept under `key`, the table emptied first when it holds _JSON_KEPT."""
    if len(table) >= _JSON_KEPT:
        table.clear()
    table[key] = text


def _attempts_key(attempts: tuple[AttemptOutcome, ...]) -> tuple[tuple[object, ...], ...] | None:
    """What decides the attempts' text; None where equality would not (above)."""
    key = []
    for attempt in attempts:
        candidate, status, failure, skipped, fault = found = (
            attempt.candidate, attempt.status, attempt.failure, attempt.skipped, attempt.fault
        )  # fmt: skip
        if not (
            type(candidate) is str
            and (status is None or type(status) is int)
            and (failure is None or type(failure) is str)
            and (skipped is None or type(skipped) is str)
            and (fault is None or type(fault) is str)
        ):
            return None
        key.append(found)
    return tuple(key)


USAGE_COLUMNS = (
    "at, request_id, route, tenant, budget_id, candidates, attempts, chosen, outcome, "
    "status, model, input_tokens, output_tokens, cost_units, charged_units, duration_ms, rule"
)


def usage_from_row(at: datetime, row: tuple[object, ...] | list[object]) -> UsageRecord:
    (
        request_id,
        route,
        tenant,
        budget_id,
        candidates,
        attempts,
        chosen,
        outcome,
        status,
        model,
        input_tokens,
        output_tokens,
        cost_units,
        charged_units,
        duration_ms,
        rule,
    ) = row
    # A column this version did not write (a record written by hand, or by another tool)
    # reads as unknown: one such row must not make `usage`, `--incidents` or a game day's
    # observation fail on every other record.
    cost, charged = _read_int(cost_units), _read_int(charged_units)
    return UsageRecord(
        request_id=_text(request_id),
        route=_text(route),
        tenant=_text(tenant),
        at=at,
        budget_id=_opt_str(budget_id),
        candidates=tuple(str(c) for c in _json_list(candidates)),
        attempts=tuple(AttemptOutcome.from_dict(a) for a in _json_list(attempts) if _is_dict(a)),
        chosen=_opt_str(chosen),
        outcome=_opt_str(outcome),
        status=_read_int(status),
        model=_opt_str(model),
        input_tokens=_read_int(input_tokens),
        output_tokens=_read_int(output_tokens),
        cost=None if cost is None else from_units(cost),
        charged=None if charged is None else from_units(charged),
        duration_ms=_read_float(duration_ms),
        rule=_opt_str(rule),
    )


def _json_list(text: object) -> list[object]:
    """A JSON array column, or [] for text that is not one."""
    try:
        value = json.loads(_text(text))
    except ValueError:
        return []
    return value if isinstance(value, list) else []


def _is_dict(value: object) -> TypeGuard[dict[str, object]]:
    return isinstance(value, dict)


def _read_int(value: object) -> int | None:
    """An integer column; None when absent or not an integer."""
    try:
        return _opt_int(value)
    except (TypeError, ValueError, ArithmeticError):
        return None


def _read_float(value: object) -> float | None:
    try:
        number = _opt_float(value)
    except TypeError:
        return None
    return number if number is None or math.isfinite(number) else None


def budget_from_row(
    limit_units: object, window: object, default_hold_units: object
) -> BudgetConfig:
    try:
        return BudgetConfig(
            limit=from_units(_int(limit_units)),
            window=str(window),
            default_hold=from_units(_int(default_hold_units)),
        )
    except (TypeError, ValueError, ArithmeticError):  # pydantic's ValidationError included
        # Not this version's row (a window a newer version added, a hand edit): the routes
        # that spend it refuse (fail closed), never a bare 500 per request. The row's values
        # are not quoted.
        raise BudgetUnreadable("a stored budget row this version cannot read") from None


def budgets_from_rows(rows: list[tuple[object, object, object, object]]) -> dict[str, BudgetConfig]:
    """`(budget_id, limit_units, window, default_hold_units)` rows as budgets; an unreadable
    one is named (its values are not)."""
    budgets = {}
    for budget_id, limit_units, window, default_hold_units in rows:
        try:
            budgets[str(budget_id)] = budget_from_row(limit_units, window, default_hold_units)
        except BudgetUnreadable:
            raise BudgetUnreadable.named(str(budget_id)) from None
    return budgets


def _int(value: object) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, Decimal | str):
        return int(value)
    raise TypeError("expected an integer column")


def _opt_int(value: object) -> int | None:
    return None if value is None else _int(value)


def _opt_float(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float | Decimal):
        return float(value)
    raise TypeError("expected a number column")


def _opt_str(value: object) -> str | None:
    return None if value is None else _text(value)


def _text(value: object) -> str:
    """A text column as text; a BLOB written there (by hand, by another tool) as its bytes
    decoded, U+FFFD for what is not UTF-8 (not Python's `b'...'` spelling of them)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


# Budget ids with any window row, and their newest window key ("total" sorts after dates).
RECORDED_WINDOWS = "SELECT budget_id, MAX(window_start) FROM fmw_budget_windows GROUP BY budget_id"
# SQLite's, the id as its bytes: one written by hand as a BLOB, or as text that is not UTF-8,
# failed `budgets show` ("unexpected internal error"); it is named leniently.
RECORDED_WINDOWS_BYTES = RECORDED_WINDOWS.replace("budget_id,", "CAST(budget_id AS BLOB),", 1)


class BudgetCache:
    """Stored budgets are read on the request path; cache each for a few seconds so
    `budgets set` reaches every process quickly without a query per request."""

    def __init__(self, ttl: float = 2.0) -> None:
        self.ttl = ttl
        self._entries: dict[str, tuple[float, BudgetConfig | None]] = {}

    def get(self, budget_id: str) -> tuple[bool, BudgetConfig | None]:
        entry = self._entries.get(budget_id)
        if entry is None or time.monotonic() - entry[0] > self.ttl:
            return False, None
        return True, entry[1]

    def put(self, budget_id: str, budget: BudgetConfig | None) -> None:
        if len(self._entries) > 10_000:
            self._entries.clear()
        self._entries[budget_id] = (time.monotonic(), budget)


class SQLLedgerBase:
    """What the SQL ledgers do alike around their own SQL: settle and release through one
    `_finish(hold_id, spent_units)`, and stored budgets read through the short cache."""

    _cache: BudgetCache
    reap_interval: float = REAP_INTERVAL
    _reap_at: float = 0.0  # monotonic; 0 until the ledger has opened (and reaped)

    def _reap_due(self) -> bool:
        """Whether this hold also settles the stale holds (once per `reap_interval`)."""
        now = time.monotonic()
        if now < self._reap_at:
            return False
        self._reap_at = now + self.reap_interval
        return True

    async def _finish(self, hold_id: str, spent: int) -> None:
        raise NotImplementedError

    async def _load_budget(self, budget_id: str) -> BudgetConfig | None:
        raise NotImplementedError

    async def settle(self, hold: Hold, amount: Decimal) -> None:
        await self._finish(hold.hold_id, to_units(amount))

    async def release(self, hold: Hold) -> None:
        await self._finish(hold.hold_id, 0)

    async def stored_budget(self, budget_id: str) -> BudgetConfig | None:
        cached, budget = self._cache.get(budget_id)
        if cached:
            return budget
        budget = await self._load_budget(budget_id)
        self._cache.put(budget_id, budget)
        return budget
