"""The SQLite route store's change counters (`fmw_route_changes`), which its triggers bump
on every change of routes and of faults: what a gateway polls to notice changes, read as
the triggers' arithmetic reads them, and a counter stuck past counting started again."""

from __future__ import annotations

import logging
import secrets
import sqlite3

from fallback_mw.store.sqlite_connect import is_read_only, write_transaction

logger = logging.getLogger("fallback_mw.store")


# A change counter at or past this (edited by hand: 1e300, 2^63 - 1) never moves again: the
# triggers' `serial + 1` is the same float, or overflows to one that reads back the same.
SERIAL_CAP = 2**62


def _restart_serial() -> int:
    """Where a stuck counter starts again: a value no gateway has seen (a random one far
    from 0 and below the cap), so every gateway reloads, whatever it last read; 0 read as
    "no change" to a gateway that had last seen 0, and it missed what changed meanwhile."""
    return 2**40 + secrets.randbelow(SERIAL_CAP // 2)


def _restart_stuck(conn: sqlite3.Connection, names: list[str]) -> dict[str, int] | None:
    """Start the change counters `names` again at a value no gateway has seen, unless a
    process that may not write the file reads them; the counters as they then read (None
    when they were not reset)."""
    if is_read_only(conn):
        return None
    with write_transaction(conn):
        for name in names:
            conn.execute(
                "UPDATE fmw_route_changes SET serial = ? WHERE name = ? AND "
                "(typeof(serial) = 'real' OR CAST(serial AS INTEGER) >= ?)",
                (_restart_serial(), name, SERIAL_CAP),
            )
        # Another gateway may have restarted them first: what is stored now is the answer.
        rows = conn.execute(
            "SELECT name, CAST(serial AS INTEGER) FROM fmw_route_changes"
        ).fetchall()
    logger.warning(
        "the store's %s change counter was past counting (edited by hand?): restarted",
        " and ".join(sorted(names)),
    )
    return {name: int(serial) for name, serial in rows}


def read_serials(conn: sqlite3.Connection) -> tuple[int, int]:
    """The routes' and the faults' change counters."""
    # As the triggers' arithmetic reads it: a counter edited to text (by hand, a
    # script) stopped `serve` at its start as an internal error (ValueError), and a
    # running gateway's reloads (routes and faults) as "route store unreachable".
    rows = conn.execute(
        "SELECT name, CAST(serial AS INTEGER), typeof(serial) FROM fmw_route_changes"
    ).fetchall()
    serials = {name: serial for name, serial, _ in rows}
    stuck = [name for name, serial, kind in rows if kind == "real" or serial >= SERIAL_CAP]
    restarted = _restart_stuck(conn, stuck) if stuck else None
    if restarted is not None:
        serials.update(restarted)
    return int(serials.get("routes", 0)), int(serials.get("faults", 0))
