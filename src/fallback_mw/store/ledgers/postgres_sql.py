"""What the PostgreSQL ledger says to the database: the hold (one statement: an upsert of the
window row whose update only happens while `spent + held + amount <= limit`, chained to the
insert of the hold row), the settlement with its usage record, the reaper, the reports and
the schema's migration. store/ledgers/postgres.py sends them."""

from __future__ import annotations

from fallback_mw.extras import missing_extra

try:
    import asyncpg
except ImportError:
    raise missing_extra("postgres", 'store = "postgresql://..."') from None
from fallback_mw.budget.ledger import rolling_peaks_sql
from fallback_mw.store.ledgers.schema import (
    COMPONENT,
    LATEST_VERSION,
    REAPED_KEPT_SECONDS,
    SCHEMA_TABLE,
    USAGE_COLUMNS,
    pending_migrations,
)
from fallback_mw.store.model import SCHEMA_TABLE_LOCK

MIGRATION_LOCK = 0x666D775F6C6467  # pg_advisory_xact_lock key: "fmw_ldg"


def window_of(kind: str) -> str:
    """The key of the current window of kind `kind` (a placeholder) on the database's clock,
    as `window_start` makes it: every process sharing the store rolls its windows at the
    same instant, whatever its host's clock says (one a day ahead held in tomorrow's window,
    beside today's: twice the daily limit in one day)."""
    return f"""(CASE {kind}::text WHEN 'total' THEN 'total'
    WHEN 'day' THEN to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD')
    ELSE to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM') END)"""


# $2 is the window kind; the answer is the hold's window key (NULL: refused).
HOLD = f"""
WITH window_row AS (
    INSERT INTO fmw_budget_windows AS w (budget_id, window_start, spent_units, held_units)
    VALUES ($1, {window_of("$2")}, 0, $3)
    ON CONFLICT (budget_id, window_start) DO UPDATE
        SET held_units = w.held_units + EXCLUDED.held_units
        WHERE w.spent_units + w.held_units + $6 <= $4
    RETURNING w.window_start
)
INSERT INTO fmw_budget_holds (hold_id, budget_id, window_start, amount_units, created_at)
SELECT $5, $1, window_start, $3, now() FROM window_row
RETURNING window_start
"""


STATUS = f"""
SELECT period.start, w.spent_units, w.held_units
FROM (SELECT {window_of("$2")} AS start) AS period
LEFT JOIN fmw_budget_windows AS w ON w.budget_id = $1 AND w.window_start = period.start
"""


# A hold's end: settled at $2 (released at 0), once. A hold no longer held was settled or
# released before (nothing to do), or settled at its amount by the reaper while its request
# still ran (a stream read for over an hour): what the request cost then replaces what the
# reaper charged (`credit`, the reaped amount), once. Each argument is a placeholder ($N).
def finished(hold: str) -> str:
    return f"""finished AS (
    DELETE FROM fmw_budget_holds WHERE hold_id = {hold}
    RETURNING budget_id, window_start, amount_units AS held, 0::bigint AS credit
), {reaped(hold)}, ended AS (
    SELECT * FROM finished UNION ALL SELECT * FROM reaped
)"""


def reaped(hold: str) -> str:
    return f"""reaped AS (
    DELETE FROM fmw_budget_reaped WHERE hold_id = {hold}
    RETURNING budget_id, window_start, 0::bigint AS held, amount_units AS credit
)"""


def settle_ended(spent: str, cap: str) -> str:
    return f"""UPDATE fmw_budget_windows AS w
SET held_units = GREATEST(0::bigint, w.held_units - ended.held),
    spent_units = GREATEST(0::bigint, LEAST(w.spent_units + {spent}::bigint - ended.credit,
        {cap}::bigint))
FROM ended
WHERE w.budget_id = ended.budget_id AND w.window_start = ended.window_start"""


# Each answers how many holds it ended (0 or 1): none, see `FINISH_REAPED`.
FINISH = f"""
WITH {finished("$1")}, settled AS (
    {settle_ended("$2", "$3")}
)
SELECT count(*) FROM ended
"""


# A settlement that found its hold neither held nor reaped may have waited for the reaper
# that was deleting it: its statement's snapshot, taken before the reaper committed, did
# not see the row the reaper added to fmw_budget_reaped, and the request was charged the
# hold. A second statement (a new snapshot) settles against that row, once.
FINISH_REAPED = f"""
WITH {reaped("$1")}, ended AS (SELECT * FROM reaped)
{settle_ended("$2", "$3")}
"""


USAGE_COUNT = USAGE_COLUMNS.count(",") + 1  # the usage columns are $1..$N


def insert_usage(row_id: str | None = None) -> str:
    """The usage insert; with `row_id` (a parameter) the row's id is given, and a row
    with that id already there (the same kept record, written before) is left alone."""
    values = ", ".join(f"${i}" for i in range(1, USAGE_COUNT + 1))
    if row_id is None:
        return f"INSERT INTO fmw_usage ({USAGE_COLUMNS}) VALUES ({values})"
    return (
        f"INSERT INTO fmw_usage (id, {USAGE_COLUMNS}) VALUES ({row_id}, {values}) "
        "ON CONFLICT (id) DO NOTHING"
    )


# FINISH and the usage insert as one statement (the hold's id, the spend and the cap
# after the usage columns): PostgreSQL runs a data-modifying WITH exactly once, to
# completion, whether or not the main statement reads it.
_HOLD_ID, _SPENT, _CAP = (f"${USAGE_COUNT + i}" for i in (1, 2, 3))


def settle_and_record(insert: str) -> str:
    return f"""
WITH {finished(_HOLD_ID)}, settled AS (
    {settle_ended(_SPENT, _CAP)}
), recorded AS (
    {insert}
)
SELECT count(*) FROM ended
"""


INSERT_USAGE = insert_usage()


SETTLE_AND_RECORD = settle_and_record(INSERT_USAGE)


# The same for a record kept through an outage: its row id (the table's own sequence,
# given before its batch was first sent) after the other parameters. A batch whose answer
# was lost is sent again; what it committed the first time is not written twice.
INSERT_KEPT = insert_usage(f"${USAGE_COUNT + 1}")


SETTLE_AND_RECORD_KEPT = settle_and_record(insert_usage(f"${USAGE_COUNT + 4}"))


ROW_IDS = "SELECT nextval(pg_get_serial_sequence('fmw_usage', 'id')) FROM generate_series(1, $1)"


REAP = f"""
WITH stale AS (
    DELETE FROM fmw_budget_holds WHERE created_at < now() - make_interval(secs => $1)
    RETURNING hold_id, budget_id, window_start, amount_units
), kept AS (
    -- A request still running settles what it cost when it ends (`finished`).
    INSERT INTO fmw_budget_reaped (hold_id, budget_id, window_start, amount_units, reaped_at)
    SELECT hold_id, budget_id, window_start, amount_units, now() FROM stale
    ON CONFLICT (hold_id) DO NOTHING
), forgotten AS (
    DELETE FROM fmw_budget_reaped
    WHERE reaped_at < now() - make_interval(secs => {REAPED_KEPT_SECONDS})
), totals AS (
    SELECT budget_id, window_start, sum(amount_units) AS units FROM stale
    GROUP BY budget_id, window_start
)
UPDATE fmw_budget_windows AS w
SET held_units = GREATEST(0::bigint, w.held_units - totals.units),
    spent_units = w.spent_units + LEAST(totals.units, $2::bigint - w.spent_units)
FROM totals
WHERE w.budget_id = totals.budget_id AND w.window_start = totals.window_start
"""


# A settlement whose answer was lost was not written while its hold is there: still held,
# or settled at its amount by the reaper meanwhile (an outage longer than the stale age),
# which a written settlement would have left nothing to reap. Locked against a reap.
HOLD_THERE = """
SELECT COALESCE(
    (SELECT 1 FROM fmw_budget_holds WHERE hold_id = $1 FOR UPDATE),
    (SELECT 1 FROM fmw_budget_reaped WHERE hold_id = $1 FOR UPDATE)
)"""


async def migrate(conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy) -> None:
    async with conn.transaction():
        # One migrator at a time across every process sharing the database.
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
        await conn.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_TABLE_LOCK)
        await conn.execute(SCHEMA_TABLE)
        current = await conn.fetchval(
            "SELECT version FROM fmw_schema WHERE component = $1", COMPONENT
        )
        current = 0 if current is None else int(current)
        for statement in pending_migrations(current, "postgresql"):
            await conn.execute(statement)
        if current != LATEST_VERSION:
            await conn.execute(
                "INSERT INTO fmw_schema (component, version) VALUES ($1, $2) "
                "ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version",
                COMPONENT,
                LATEST_VERSION,
            )


# The epoch second of `at` (a timestamptz: the same instant whatever the session's zone).
# A record's tokens in numeric: two counts edited near 2^63 passed bigint's range.
ROLLING_PEAKS = rolling_peaks_sql(
    "EXTRACT(EPOCH FROM date_trunc('second', at))::bigint",
    "$1",
    tokens="COALESCE(input_tokens, 0)::numeric + COALESCE(output_tokens, 0)",
    total="SUM",
)
