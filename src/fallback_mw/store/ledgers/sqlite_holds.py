"""How a hold ends in the SQLite ledger, in the caller's transaction: settled or released
exactly once (`DELETE ... RETURNING`), spend saturating and held never below 0; a hold the
reaper settled while its request still ran corrected once; and the stale holds a process
that died left, settled at their amount and kept a while for that correction."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta

from fallback_mw.budget.cost import MAX_UNITS, SPENT_CAP_UNITS
from fallback_mw.store.ledgers.schema import REAPED_KEPT_SECONDS, encode_sqlite_time


def finish_hold(conn: sqlite3.Connection, hold_id: str, spent: int) -> None:
    spent = min(max(spent, 0), MAX_UNITS)
    row = conn.execute(
        "DELETE FROM fmw_budget_holds WHERE hold_id = ? "
        "RETURNING budget_id, window_start, amount_units",
        (hold_id,),
    ).fetchone()
    if row is None:
        _settle_reaped(conn, hold_id, spent)
        return
    # Spend saturates at SPENT_CAP_UNITS: never an integer overflow that loses the row. Held
    # never goes below 0: a hold whose amount was edited up (by hand) left it far below,
    # and every later hold fitted under the limit, whatever the spend.
    conn.execute(
        "UPDATE fmw_budget_windows SET held_units = max(0, held_units - ?), "
        "spent_units = spent_units + min(?, ? - spent_units) "
        "WHERE budget_id = ? AND window_start = ?",
        (row[2], spent, SPENT_CAP_UNITS, row[0], row[1]),
    )


def _settle_reaped(conn: sqlite3.Connection, hold_id: str, spent: int) -> None:
    """A hold no longer held: already settled or released (nothing to do, exactly once),
    or settled at its amount by the reaper while its request still ran (a stream read for
    over an hour): what the request cost replaces what the reaper charged, once."""
    row = conn.execute(
        "DELETE FROM fmw_budget_reaped WHERE hold_id = ? "
        "RETURNING budget_id, window_start, amount_units",
        (hold_id,),
    ).fetchone()
    if row is not None:
        conn.execute(
            "UPDATE fmw_budget_windows SET spent_units = max(0, min(spent_units + ? - ?, ?)) "
            "WHERE budget_id = ? AND window_start = ?",
            (spent, row[2], SPENT_CAP_UNITS, row[0], row[1]),
        )


def settle_stale_holds(conn: sqlite3.Connection, older_than: float) -> None:
    """Holds left by a process that died mid-request are settled at their amount (the
    conservative choice: the upstream may have served and billed), and kept a while in
    fmw_budget_reaped: one whose request still runs (a stream read for over an hour)
    settles what it cost when it ends. In the caller's transaction."""
    now = datetime.now(UTC)
    cutoff = encode_sqlite_time(now - timedelta(seconds=older_than))
    # The amount as SQLite's arithmetic reads it: a hand-edited one ('abc') failed opening
    # the ledger, and every budgeted request was a bare 500.
    rows = conn.execute(
        "SELECT hold_id, budget_id, window_start, CAST(amount_units AS INTEGER) "
        "FROM fmw_budget_holds WHERE created_at < ?",
        (cutoff,),
    ).fetchall()
    for hold_id, budget_id, start, amount in rows:
        finish_hold(conn, hold_id, amount)
        # Kept: a request still running settles what it cost when it ends (_settle_reaped).
        conn.execute(
            "INSERT OR IGNORE INTO fmw_budget_reaped "
            "(hold_id, budget_id, window_start, amount_units, reaped_at) VALUES (?, ?, ?, ?, ?)",
            (hold_id, budget_id, start, amount, encode_sqlite_time(now)),
        )
    forgotten = encode_sqlite_time(now - timedelta(seconds=REAPED_KEPT_SECONDS))
    conn.execute("DELETE FROM fmw_budget_reaped WHERE reaped_at < ?", (forgotten,))
