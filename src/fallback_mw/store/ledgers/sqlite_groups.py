"""The SQLite ledger's group commit: one event loop's turn-taking on the file, and one
transaction for the grouped calls ready on one turn, a call whose statements fail undone
alone (a savepoint each) while the others commit (store/ledgers/sqlite_calls.py runs it)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

from fallback_mw.grouping import Failed, Group, Pending
from fallback_mw.store.sqlite_connect import immediate

Work = Callable[[sqlite3.Connection], Any]  # a grouped call's statements


class Turns:
    """One event loop's turn-taking on the ledger: the lock its calls take turns on, and
    the grouped calls waiting for the next commit (handed to `commit`)."""

    __slots__ = ("group", "lock", "loop")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        commit: Callable[[Turns, list[Pending[Work]]], None],
    ) -> None:
        self.loop = loop
        self.lock = asyncio.Lock()
        self.group: Group[Work] = Group(loop, lambda calls: commit(self, calls))


def group_work(calls: Sequence[Pending[Work]]) -> Callable[[sqlite3.Connection], list[object]]:
    """One transaction for the group's calls, in order; a call whose caller was cancelled
    before its group was written is left out (its result `None`, never read). When a
    call's statements fail (anything but an `OperationalError`: the database locked or
    unwritable, which fails the group whole with nothing committed), the group is written
    again, in one transaction still, each call in a savepoint: the failing call's changes
    are undone and its exception is its result; the others commit."""

    def work(conn: sqlite3.Connection) -> list[object]:
        live = [call for call in calls if not call.future.cancelled()]
        try:
            with immediate(conn):
                done = {id(call): call.item(conn) for call in live}
        except sqlite3.OperationalError:
            raise
        except Exception:
            if len(live) == 1:
                raise
            done = {}
            with immediate(conn):
                for call in live:
                    conn.execute("SAVEPOINT fmw_call")
                    try:
                        done[id(call)] = call.item(conn)
                    except sqlite3.OperationalError:
                        raise
                    except Exception as exc:
                        conn.execute("ROLLBACK TO fmw_call")
                        done[id(call)] = Failed(exc)
                    conn.execute("RELEASE fmw_call")
        return [done.get(id(call)) for call in calls]

    return work
