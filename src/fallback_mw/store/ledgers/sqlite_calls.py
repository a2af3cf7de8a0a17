"""How the SQLite ledger's calls reach the file: one at a time per ledger, on the event
loop's thread when that cannot block (`_inline`: about a quarter of a thread hop's CPU),
else in a worker thread; a request's calls (the hold; the settlement with its usage
record) committed in groups (`grouped`): every such call of this process that is ready on
one turn of the event loop shares one transaction. What the calls say is the ledger's
(store/ledgers/sqlite.py); this module only runs them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio.to_thread

from fallback_mw.budget.ledger import LedgerUnavailable
from fallback_mw.grouping import Pending, fail, settle
from fallback_mw.store.ledgers.schema import SchemaTooNew
from fallback_mw.store.ledgers.sqlite_groups import Turns, Work, group_work
from fallback_mw.store.outage import OutageLog
from fallback_mw.store.sqlite_connect import (
    OpenedFile,
    WalHandover,
    connect_wal,
    disk_full,
    immediate,
    read_only_reason,
    read_steadily,
    with_wal_room,
)

T = TypeVar("T")
# One ledger call in this many runs on the worker thread (which checkpoints the WAL).
CHECKPOINT_EVERY = 128
logger = logging.getLogger("fallback_mw.budget")


class SQLiteCalls:
    """One ledger file's connections (the worker thread's, and the event loop thread's for
    `_inline`) and the turns its calls take. `opened` runs once on the worker connection
    when it opens (the schema's migration, the stale holds' settlement)."""

    def __init__(
        self,
        path: str,
        *,
        busy_timeout: float,
        opened: Callable[[sqlite3.Connection], None],
    ) -> None:
        self.path = path
        self.busy_timeout = busy_timeout
        self._opened = opened
        self._conn: sqlite3.Connection | None = None
        self._file: OpenedFile | None = None  # the file `_conn` has open
        self._handover: WalHandover | None = None  # removed files others may still use
        self._busy_ms = int(busy_timeout * 1000)  # the worker connection's busy timeout
        self._fast: sqlite3.Connection | None = None  # the event loop thread's (_inline)
        self._calls = 0
        self._turns: Turns | None = None
        self._writers: set[asyncio.Task[None]] = set()  # groups gone to the worker thread
        self._lock = threading.Lock()
        self._outage = OutageLog(logger, "SQLite ledger")  # one WARNING each way

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            if self._handover is not None and self._handover.waiting():
                raise sqlite3.OperationalError("removed while other processes still use it")
            # Autocommit (explicit BEGIN IMMEDIATE / COMMIT below); used from worker
            # threads, under self._lock.
            conn = connect_wal(self.path, timeout=self.busy_timeout, check_same_thread=False)
            try:
                conn.execute("PRAGMA synchronous=NORMAL")
                self._opened(conn)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
            self._busy_ms = int(self.busy_timeout * 1000)
            self._file = OpenedFile(self.path, interval=1.0)
        return self._conn

    def _read_only(self) -> sqlite3.Connection:
        """A connection for one call to a file this user may not write (`_in_thread`)."""
        conn = connect_wal(self.path, timeout=self.busy_timeout, check_same_thread=False)
        try:
            self._opened(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _reopen_if_moved(self) -> None:
        """The file at the path, not one removed or replaced under the open connections."""
        if self._conn is None or self._file is None or not self._file.moved():
            return
        logger.warning(
            "SQLite ledger %s: it or its -wal was removed or replaced; reopening", self.path
        )
        with contextlib.suppress(sqlite3.Error):  # the open WAL's pages into the database
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")  # (a last close does it too)
        self._handover = WalHandover(self.path, self._file.index, bound=2.5)
        with contextlib.suppress(sqlite3.Error):
            self._close()

    def _close(self) -> None:  # under self._lock
        conns, self._conn, self._fast, self._file = (self._conn, self._fast), None, None, None
        for conn in conns:
            if conn is not None:
                conn.close()

    def _inline(self, work: Callable[[sqlite3.Connection], T]) -> tuple[bool, T | None]:
        """`work` on the event loop's thread, when that cannot block it: the ledger is
        free in this process (nobody in a worker thread), the connection waits for no
        lock (busy timeout 0: another process holding the write lock is an immediate
        "database is locked") and never checkpoints (wal_autocheckpoint off: the worker
        thread's connection checkpoints, see `_run`). A WAL commit with
        synchronous=NORMAL is a write to the page cache, no fsync. (True, result) when
        done; (False, None) when the worker thread must do it (nothing was committed)."""
        conn, file = self._fast, self._file  # a file moved: the worker thread reopens it
        if conn is None or (file and file.moved()) or not self._lock.acquire(blocking=False):
            return False, None
        try:
            changes = conn.total_changes
            found = work(conn)
            wrote = conn.total_changes != changes
        except sqlite3.OperationalError:
            # Locked by another process, or a real failure the worker thread will meet
            # again (and report): either way nothing was committed.
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            return False, None
        finally:
            self._lock.release()
        if wrote:
            self._outage.recovered()  # see `_in_thread`
        return True, found

    def _open_fast(self) -> None:
        """The loop thread's connection, opened (from the worker thread) once the main
        one has migrated the schema."""
        if self._fast is None:
            try:
                fast = connect_wal(self.path, timeout=0.0, check_same_thread=False)
            except sqlite3.Error:
                return  # e.g. locked right now: the next call tries again
            try:
                fast.execute("PRAGMA synchronous=NORMAL")
                fast.execute("PRAGMA wal_autocheckpoint=0")
            except sqlite3.Error:
                fast.close()
                return
            self._fast = fast

    def loop_turns(self) -> Turns | None:
        """This process's calls take turns on an asyncio lock (one per event loop), so a
        call waits for one running in the worker thread instead of hopping to a thread
        behind it; its grouped calls (`_grouped`) wait with it. None outside asyncio (then
        every call hops, as before)."""
        loop = _running_loop()
        if loop is None:
            return None
        if self._turns is None or self._turns.loop is not loop:
            self._turns = Turns(loop, self._commit_group)
        return self._turns

    async def run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        turns = self.loop_turns()
        if turns is None:
            return await self._in_thread(work)
        deadline = turns.loop.time() + self.busy_timeout
        await self._take_turn(turns, deadline)
        try:
            self._calls += 1
            inline = self._calls % CHECKPOINT_EVERY != 0
            return await self._write(work, inline=inline, deadline=deadline)
        finally:
            turns.lock.release()

    async def _take_turn(self, turns: Turns, deadline: float) -> None:
        """This loop's turn, by `deadline` (the loop's clock): the wait behind the calls
        ahead, each waiting for another process's write lock, counts against the busy
        timeout, so each call is refused within it (as on PostgreSQL), not after the
        timeouts of every call queued before it."""
        lock = turns.lock
        if not lock.locked():
            await lock.acquire()  # free: taken at once
            return
        try:
            async with asyncio.timeout_at(deadline):
                await lock.acquire()
        except TimeoutError:
            raise self._unavailable("locked", "database is locked") from None

    async def _write(
        self, work: Callable[[sqlite3.Connection], T], *, inline: bool, deadline: float
    ) -> T:
        """`work`, in this loop's turn: on the loop's thread when `inline` and that cannot
        block, else in the worker thread, which waits for another process's lock until
        `deadline`. Every CHECKPOINT_EVERY-th call is not inline: the worker thread's
        connection checkpoints the WAL when it has grown past SQLite's default 1000
        pages."""
        if inline:
            done, found = self._inline(work)
            if done:
                return found  # type: ignore[return-value]
        left = deadline - asyncio.get_running_loop().time()
        return await self._in_thread(work, wait=max(left, 0.0))

    async def _in_thread(
        self, work: Callable[[sqlite3.Connection], T], *, wait: float | None = None
    ) -> T:
        """`work` in the worker thread, waiting `wait` seconds at most for another
        process's write lock (None: the busy timeout)."""
        until = None if wait is None else time.monotonic() + wait

        def locked() -> tuple[T, bool]:
            with self._lock:
                self._reopen_if_moved()
                if self._conn is None and read_only_reason(self.path) is not None:
                    # This user may not write the file: with no writer's WAL index beside
                    # it, it reads the file alone (`FileAlone`), which a writer may change
                    # under a read. Each call reads on a connection of its own, made again
                    # while the file changed under it (as the route store's reads are).
                    return read_steadily(self.path, self._read_only, work), False
                conn = self._connection()
                left = self.busy_timeout if until is None else until - time.monotonic()
                busy_ms = max(int(left * 1000), 0)
                if busy_ms != self._busy_ms:
                    conn.execute(f"PRAGMA busy_timeout = {busy_ms}")
                    self._busy_ms = busy_ms
                changes = conn.total_changes
                result = with_wal_room(conn, self.path, work)
                wrote = conn.total_changes != changes
                self._open_fast()
                return result, wrote

        try:
            result, wrote = await anyio.to_thread.run_sync(locked)
        except (sqlite3.Error, SchemaTooNew) as exc:
            # SQLite's own reason ("file is not a database", "attempt to write a readonly
            # database") names no secret: a file path holds none.
            raise self._unavailable(type(exc).__name__, str(exc)) from None
        except (OSError, RuntimeError) as exc:
            # The host, not the file: no descriptor left for an import or the file's
            # directory (EMFILE), no worker thread ("can't start new thread"). Fail closed
            # (503 budget_unavailable), never a bare 500.
            raise self._unavailable(type(exc).__name__, str(exc)) from None
        if wrote:
            # A write ends an outage; a read does not: a file another process holds the
            # write lock on still answers reads (WAL), and each read would log "reachable
            # again" between two holds refused.
            self._outage.recovered()
        return result

    def _unavailable(self, kind: str, reason: str) -> LedgerUnavailable:
        full = disk_full(self.path)
        if full is not None:  # SQLite says "disk I/O error" for the WAL index it could not make
            kind, reason = f"{kind}: {full}", f"{reason}; {full}"
        elif "readonly" in reason and (why := read_only_reason(self.path)) is not None:
            kind = f"{kind}: {why}"  # logged with the outage too
        self._outage.failed(kind, "budgeted routes refuse (fail closed)")
        reason = " ".join(reason.split())[:200]
        return LedgerUnavailable(f"SQLite ledger {self.path} unavailable ({kind}: {reason})")

    # --- group commit -------------------------------------------------------------------

    async def grouped(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """`work` (its statements; the transaction is the group's) committed with every
        other grouped call of this process that is ready on this turn of the event loop
        (`fallback_mw.grouping`): one `BEGIN IMMEDIATE` ... `COMMIT` for all of them. A
        commit's cost is its file locks and WAL writes, not its statements (measured: a
        hold alone about 40 µs of CPU, in a group of 16 about 12; a usage record 20 and
        2). Each call's result is its own, as if it ran alone and in this order; a call
        whose statements fail fails alone (the others commit); a group that cannot be
        written (the database locked by another process) goes to the worker thread whole,
        nothing of it committed."""
        turns = self.loop_turns()
        if turns is None:  # outside asyncio: a transaction of its own, as any call
            return await self.run(_transaction(work))
        result: T = await turns.group.join(work)
        return result

    def _commit_group(self, turns: Turns, calls: list[Pending[Work]]) -> None:
        work = group_work(calls)
        self._calls += 1
        inline = self._calls % CHECKPOINT_EVERY != 0  # as `_run`
        if inline and not turns.lock.locked():
            try:
                done, results = self._inline(work)
            except Exception as exc:  # a lone call's own failure (e.g. a constraint)
                fail(calls, exc)
                return
            if done:
                assert results is not None
                settle(calls, results)
                return
            inline = False  # locked by another process: the worker thread waits for it
        # Behind a call in the worker thread (its turn comes when that one is done), or
        # to the worker thread itself: refused once the busy timeout has passed.
        deadline = turns.loop.time() + self.busy_timeout
        task = turns.loop.create_task(self._commit_later(calls, work, turns, inline, deadline))
        self._writers.add(task)
        task.add_done_callback(self._writers.discard)

    async def _commit_later(
        self,
        calls: list[Pending[Work]],
        work: Callable[[sqlite3.Connection], list[object]],
        turns: Turns,
        inline: bool,
        deadline: float,
    ) -> None:
        try:
            await self._take_turn(turns, deadline)
            try:
                results = await self._write(work, inline=inline, deadline=deadline)
            finally:
                turns.lock.release()
        except BaseException as exc:  # LedgerUnavailable, a lone call's failure, shutdown
            fail(calls, exc)
            if not isinstance(exc, Exception):
                raise
            return
        settle(calls, results)

    async def aclose(self) -> None:
        # Grouped calls already made are written first (a group waiting for its turn of
        # the loop, then the groups in the worker thread), never into a reopened file.
        turns = self._turns
        if turns is not None and turns.loop is _running_loop():
            if turns.group.waiting:
                await asyncio.sleep(0)
            if self._writers:
                await asyncio.gather(*self._writers, return_exceptions=True)

        def close() -> None:
            with self._lock:
                self._close()

        await anyio.to_thread.run_sync(close)


def retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # seen: never "Future exception was never retrieved"


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _transaction(work: Callable[[sqlite3.Connection], T]) -> Callable[[sqlite3.Connection], T]:
    def transaction(conn: sqlite3.Connection) -> T:
        with immediate(conn):
            return work(conn)

    return transaction
