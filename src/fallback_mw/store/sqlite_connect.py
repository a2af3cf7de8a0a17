"""Opening a SQLite database that several connections (and processes) share, in WAL mode."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def connect_wal(
    path: str | Path, *, timeout: float = 5.0, check_same_thread: bool = True
) -> sqlite3.Connection:
    """Open `path` in autocommit mode (explicit BEGIN IMMEDIATE by the callers) and switch
    it to WAL. Switching the journal mode needs an exclusive lock and SQLite answers
    "database is locked" at once, without its busy handler, when another connection is
    opening the same fresh file (seen: 18 of 600 racing openers) — so retry until
    `timeout`. A file this process cannot write is opened read-only (`_connect_read_only`):
    its writes fail, its reads answer."""
    if read_only_reason(path) is not None:
        return _connect_read_only(path, timeout=timeout, check_same_thread=check_same_thread)
    try:
        conn = sqlite3.connect(
            path, timeout=timeout, isolation_level=None, check_same_thread=check_same_thread
        )
    except sqlite3.OperationalError as exc:
        missing = missing_directory(path)
        if missing is None:
            raise
        # SQLite says only "unable to open database file"; the usual cause is a directory
        # that is not there, often because a relative path resolved from elsewhere.
        raise sqlite3.OperationalError(f"{exc}: {missing}") from None
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return conn
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                conn.close()
                raise
        except BaseException:  # "file is not a database": closed, not left to the GC
            conn.close()
            raise
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def read_only_reason(path: str | Path) -> str | None:
    """Why this process cannot write the SQLite file at `path` (its mode, or a directory
    where SQLite cannot make the `-wal` beside it, when no writable one is there), in words
    naming it; None when it can, or when there is no file yet."""
    target = Path(path)
    try:
        if not target.is_file():
            return None
        if not os.access(target, os.W_OK):
            return f"{target} is read-only for this user"
        directory = target.absolute().parent
        beside = [Path(f"{target}-wal"), Path(f"{target}-shm")]
        if not os.access(directory, os.W_OK) and not all(os.access(f, os.W_OK) for f in beside):
            return (
                f"its directory {directory} is read-only for this user (SQLite writes "
                f"{target.name}-wal beside it)"
            )
    except OSError:  # cannot be asked: SQLite says what it finds
        return None
    return None


def _connect_read_only(
    path: str | Path, *, timeout: float, check_same_thread: bool
) -> sqlite3.Connection:
    """A connection that only reads: through the WAL index (`-shm`) a writer keeps beside
    the file, else the file alone (`immutable`: no connection has a WAL open, SQLite
    removes both with the last one, so the file holds everything). Opened read-write,
    SQLite answered the first read of a file in a read-only directory with "attempt to
    write a readonly database", and beside a read-only file it made a `-shm` as read-only
    as the file, which then failed the owner's writes once the file was writable again."""
    uri = Path(path).absolute().as_uri()
    modes = ("mode=ro", "immutable=1") if Path(f"{path}-shm").exists() else ("immutable=1",)
    for mode in modes:
        conn = sqlite3.connect(
            f"{uri}?{mode}",
            uri=True,
            timeout=timeout,
            isolation_level=None,
            check_same_thread=check_same_thread,
            factory=FileAlone if mode == "immutable=1" else sqlite3.Connection,
        )
        try:
            conn.execute("PRAGMA query_only = ON")  # `is_read_only`
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.OperationalError:
            conn.close()
            if mode == modes[-1]:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


class FileAlone(sqlite3.Connection):
    """A read-only connection that reads the database file alone (`immutable`): no lock,
    no WAL. A writer that starts meanwhile checkpoints into the file under it, and a read
    then mixes pages of two states ("database disk image is malformed", or rows of both):
    `read_steadily` repeats such a read."""


# How many times a read on a file alone is made while a writer keeps changing the file.
STEADY_READ_TRIES = 5


def read_steadily(
    path: str | Path,
    connect: Callable[[], sqlite3.Connection],
    read: Callable[[sqlite3.Connection], T],
) -> T:
    """`read` on a fresh `connect()`ion; when that reads the file alone (`FileAlone`), made
    again until the files at `path` did not change while it ran (a writer's WAL or journal
    appearing, the file rewritten), STEADY_READ_TRIES times at most: then a
    sqlite3.OperationalError saying why. Errors of a read during which nothing changed
    are its own."""
    for _ in range(STEADY_READ_TRIES):
        conn = connect()
        try:
            if not isinstance(conn, FileAlone):
                return read(conn)
            # Taken before the read: a connection to a file alone opens it at its first
            # statement, and a writable one never reaches here (no stat per operation).
            before = _files_state(path)
            try:
                result = read(conn)
            except sqlite3.DatabaseError:
                if _files_state(path) == before:
                    raise
                continue
        finally:
            conn.close()
        if _files_state(path) == before:
            return result
        time.sleep(0.05)
    raise sqlite3.OperationalError(
        f"another process kept writing {Path(path).name} while this user, who may not write "
        "it, read it (such a reader reads the file alone, without the writer's WAL): "
        "retry when it is done, or give this user write access to the file and its directory"
    )


def _files_state(path: str | Path) -> tuple[tuple[int, int, int] | None, ...]:
    """The database file and what a writer makes beside it, as (inode, size, mtime_ns)."""
    found: list[tuple[int, int, int] | None] = []
    for name in (str(path), f"{path}-wal", f"{path}-journal"):
        try:
            stat = os.stat(name)
        except OSError:
            found.append(None)
            continue
        found.append((stat.st_ino, stat.st_size, stat.st_mtime_ns))
    return tuple(found)


def is_read_only(conn: sqlite3.Connection) -> bool:
    """Whether `conn` was opened read-only (`_connect_read_only`)."""
    return bool(conn.execute("PRAGMA query_only").fetchone()[0])


def missing_directory(path: str | Path) -> str | None:
    """Why a SQLite file cannot be created at `path` when its directory does not exist, in
    words naming the directory (and, for a relative path, the working directory it was
    resolved against), or when `path` is itself a directory; None when the directory is
    there."""
    target = Path(path)
    if target.is_dir():
        return f"{target.absolute()} is a directory, not a file"
    parent = target.parent.absolute()
    if parent.is_dir():
        return None
    reason = f"directory {parent} does not exist"
    if not target.is_absolute():
        reason += f" (the relative path is resolved against the working directory {Path.cwd()})"
    return reason


def disk_full(path: str | Path) -> str | None:
    """Why SQLite's own words for a write that failed ("database or disk is full", "disk
    I/O error": the WAL index it could not create) may mean the disk: the filesystem
    holding `path` has no block (or no inode) left for this process, in words naming its
    directory; None when it has room, or cannot be asked."""
    directory = Path(path).absolute().parent
    try:
        found = os.statvfs(directory)
    except OSError:
        return None
    blocks = found.f_bfree if os.geteuid() == 0 else found.f_bavail  # root takes the reserve
    if blocks == 0:
        return f"the disk holding {directory} is full"
    if found.f_files and found.f_ffree == 0:
        return f"the disk holding {directory} has no free inodes"
    return size_limit_reached(path)


def size_limit_reached(path: str | Path) -> str | None:
    """The other "no room" (SQLite says "disk I/O error"): the database or its WAL has
    grown to within a transaction's writes of this process's file size limit (RLIMIT_FSIZE,
    `ulimit -f` where the gateway was started), which the operator's own shell, without
    that limit, never meets."""
    found = _at_size_limit(path)
    if found is None:
        return None
    name, limit = found
    return f"{name} has reached this process's file size limit ({limit} bytes, ulimit -f)"


def _at_size_limit(path: str | Path) -> tuple[Path, int] | None:
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    for name in (Path(f"{path}-wal").absolute(), Path(path).absolute()):
        try:
            size = name.stat().st_size
        except OSError:
            continue
        if size + 65536 > limit:
            return name, limit
    return None


def with_wal_room(
    conn: sqlite3.Connection, path: str | Path, work: Callable[[sqlite3.Connection], T]
) -> T:
    """`work(conn)`; once more if it failed (rolled back) on a WAL grown to this process's
    file size limit, after its pages are written back into the database and it starts
    afresh. SQLite checkpoints by itself only past 1,000 pages (about 4 MB): under a lower
    limit every write failed from then on, however small the database."""
    try:
        return work(conn)
    except sqlite3.OperationalError:
        found = _at_size_limit(path)
        if found is None or not found[0].name.endswith("-wal"):
            raise
        try:
            row = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except sqlite3.Error:
            row = None
        if row is None or row[0] != 0:  # blocked by another connection's reader
            raise
    return work(conn)


def file_identity(path: str | Path) -> tuple[int, int] | None:
    """The (device, inode) of the file at `path`; None when there is none."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


class OpenedFile:
    """Whether the files a long-lived connection opened at `path` are still the ones there.
    An operator who removes the database, or puts another in its place (`mv backup.db
    gw.db`), leaves the connection writing into a file nothing else reads any more: the
    admin commands, another gateway and this one after a restart see the new file. One who
    removes its `-wal` leaves every other opener with `disk I/O error` (their WAL index
    names frames of a file they cannot see) for as long as the connection stays open (SQLite
    itself removes the WAL only when its last connection closes). Asked at most once per
    `interval` seconds (a stat costs about 3 µs); once moved, it stays so."""

    def __init__(self, path: str | Path, *, interval: float) -> None:
        self.path = path
        self.interval = interval
        self._identity = self._identities()
        self._check_at = time.monotonic() + interval
        self._moved = False
        self.index = file_identity(f"{path}-shm")  # the WAL index it has open

    def _identities(self) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        return file_identity(self.path), file_identity(f"{self.path}-wal")

    def moved(self) -> bool:
        if self._moved or self._identity[0] is None:
            return self._moved
        now = time.monotonic()
        if now < self._check_at:
            return False
        self._check_at = now + self.interval
        try:
            database, wal = self._identities()
        except OSError:  # cannot be asked (a permission): taken as still there
            return False
        self._moved = database != self._identity[0] or (
            self._identity[1] is not None and wal != self._identity[1]
        )
        return self._moved


class WalHandover:
    """This process let go of a database or WAL an operator removed; other processes (`serve
    --workers`) may still write into it, through the files they have open, under the WAL
    index (`-shm`) all of them share. A connection opened now would use the files at the
    path under that same index, and the two would overwrite each other's frames (or lay
    the removed database's pages over the new one). So opening waits (the ledger refuses
    meanwhile: fail closed) while the `-shm` at the path is still the `index` this process
    had open (SQLite removes it when the last of them closes), for `bound` seconds at most:
    each of them notices within a second (`OpenedFile`), an idle `sqlite3` shell may hold
    it for hours. A `-shm` made since for the new file (the route reload's) is no reason."""

    def __init__(self, path: str | Path, index: tuple[int, int] | None, *, bound: float) -> None:
        self.shm = Path(f"{path}-shm")
        self.index = index
        self.until = time.monotonic() + bound

    def waiting(self) -> bool:
        if self.index is None or time.monotonic() >= self.until:
            return False
        try:
            return file_identity(self.shm) == self.index
        except OSError:
            return False


@contextlib.contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """One write transaction (BEGIN IMMEDIATE takes the write lock, so a read and the writes
    after it cannot interleave with another process's): committed when the block ends,
    unless the block rolled it back itself (a conditional edit that found nothing to
    change); rolled back when the block raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    if conn.in_transaction:
        conn.execute("COMMIT")


class immediate:
    """`BEGIN IMMEDIATE` ... `COMMIT`, rolled back on any error."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if kind is None:
            self.conn.execute("COMMIT")
        else:
            self.conn.execute("ROLLBACK")


def fetch_leniently(
    conn: sqlite3.Connection, query: str, params: tuple[object, ...] = ()
) -> list[tuple[object, ...]]:
    """`query`'s rows with every text read as its bytes decoded, U+FFFD for what is not
    UTF-8: a row written by another tool or by hand (a tenant in Latin-1, a route as a
    BLOB) made Python's sqlite3 refuse the whole query, quoting the row ("Could not decode
    to UTF-8 column 'tenant' with text ..."). For reads that list what others wrote."""
    conn.text_factory = _lenient_text
    try:
        rows: list[tuple[object, ...]] = conn.execute(query, params).fetchall()
        return rows
    finally:
        conn.text_factory = str


def _lenient_text(value: bytes) -> str:
    return value.decode("utf-8", "replace")
