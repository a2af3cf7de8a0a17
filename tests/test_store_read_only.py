"""A SQLite store this user may only read (the file `chmod 444`, or its directory read-only):
the read verbs answer, the writes fail with one line naming why, and nothing is left
beside the file. Every verb failed ("attempt to write a readonly database"): the route
store rewrote its current schema version on each open, and SQLite, opened read-write, made
a read-only `-shm` beside a read-only file that then failed the owner's own writes once
the file was writable again. As root the verbs run without CAP_DAC_OVERRIDE (`setpriv`),
so the modes bind as they do for any other user."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers.sqlite import SQLiteLedger
from fallback_mw.store.sqlite_connect import STEADY_READ_TRIES
from tests.helpers import sqlite_db

CONFIG = """
[gateway]
store = "sqlite:///{path}"
allow_hosts = ["127.0.0.1"]
[upstreams.primary]
url = "http://127.0.0.1:9"
auth_env = "UF_PRIMARY_KEY"
[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary"]
"""


def unprivileged() -> list[str]:
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: file modes do not bind")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def fallback_mw(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "UF_PRIMARY_KEY": "k", "UF_STORED_KEY": "k"}
    return subprocess.run(
        [*unprivileged(), sys.executable, "-m", "fallback_mw", *args, "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=config.parent,
    )


def made_store(directory: Path) -> tuple[Path, Path]:
    directory.mkdir()
    path = directory / "gw.db"
    config = directory / "gw.toml"
    config.write_text(CONFIG.format(path=path))
    added = fallback_mw(
        config,
        *("routes", "add", "--id", "stored", "--prefix", "/s/"),
        *("--upstream", "http://127.0.0.1:10", "--auth-header", "x-api-key"),
        *("--auth-env", "UF_STORED_KEY"),
    )
    assert added.returncode == 0, added.stderr
    faulted = fallback_mw(config, "faults", "set", "fail", "--upstream", "primary", "--ttl", "600")
    assert faulted.returncode == 0, faulted.stderr

    async def spend() -> None:
        ledger = SQLiteLedger(str(path))
        budget = BudgetConfig(limit=Decimal(10), window="month")
        hold = await ledger.hold("acme", budget, Decimal(1))
        assert hold is not None
        await ledger.settle(hold, Decimal("0.25"))
        await ledger.aclose()

    asyncio.run(spend())
    return path, config


@pytest.mark.parametrize("read_only", ["file", "directory"])
def test_read_verbs_answer_and_writes_say_why_on_a_read_only_store(
    tmp_path: Path, read_only: str
) -> None:
    path, config = made_store(tmp_path / "store")
    beside = sorted(p.name for p in path.parent.iterdir())
    locked = path if read_only == "file" else path.parent
    locked.chmod(0o444 if read_only == "file" else 0o555)
    try:
        listed = fallback_mw(config, "routes", "list")
        assert listed.returncode == 0, listed.stderr
        assert "stored\tstore\t/s/" in listed.stdout
        faults = fallback_mw(config, "faults", "list")
        assert faults.returncode == 0, faults.stderr
        assert faults.stdout.startswith("fail\tupstream=primary\t")
        checked = fallback_mw(config, "check")
        assert checked.returncode == 0, checked.stderr
        assert "is valid: 2 route(s)" in checked.stdout
        budgets = fallback_mw(config, "budgets", "show")
        assert budgets.returncode == 0, budgets.stderr
        assert "0.25" in budgets.stdout
        why = (
            f"{path} is read-only for this user"
            if read_only == "file"
            else f"its directory {path.parent} is read-only for this user"
        )
        for write in (("routes", "remove", "--id", "stored"), ("faults", "clear", "--all")):
            refused = fallback_mw(config, *write)
            assert refused.returncode == 1
            assert refused.stdout == ""
            lines = refused.stderr.splitlines()
            assert len(lines) == 1 and lines[0].startswith("fallback-mw: error: "), lines
            assert why in lines[0]
        assert sorted(p.name for p in path.parent.iterdir()) == beside  # no -wal, no -shm
    finally:
        locked.chmod(0o644 if read_only == "file" else 0o755)
    # Writable again: the owner's writes go through (a -shm left read-only failed them).
    removed = fallback_mw(config, "routes", "remove", "--id", "stored")
    assert removed.returncode == 0, removed.stderr
    assert "stored" not in fallback_mw(config, "routes", "list").stdout


# A reader of a store this user may not write, paused (once per connection) in the middle
# of reading the routes, until the test has written: a read of the file alone
# (`immutable`), which no writer's lock or WAL protocol covers.
_PAUSED_READER = """
import asyncio, sys
import fallback_mw.store.sqlite as backend
from fallback_mw.store.model import StoreError
real = backend.connect_wal
def connect(*args, **kwargs):
    conn = real(*args, **kwargs)
    calls = [0]
    def progress():
        calls[0] += 1
        if calls[0] == 3:  # in the middle of the routes' SELECT
            print("paused", flush=True)
            sys.stdin.readline()
        return 0
    conn.set_progress_handler(progress, 200)
    return conn
backend.connect_wal = connect
async def main():
    try:
        routes = await backend.SqliteStore(sys.argv[1]).load_routes(unreadable=[])
    except StoreError as exc:
        print("error", exc, flush=True)
        return
    urls = sorted({u.url for r in routes for u in r.upstreams.values()})
    print("read", len(routes), *urls, flush=True)
asyncio.run(main())
"""


def write_routes(path: Path, generation: int, count: int) -> None:
    """`count` routes, their upstreams' URLs naming `generation`, in one transaction; the
    file made writable for it, read-only again after (the reader's mode is chosen at its
    connection: a read-only file's reader reads the file alone)."""
    pad = "x" * 600  # spread over many pages: the checkpoint rewrites them under the read
    docs = [
        (
            f"r{n}",
            json.dumps(
                {
                    "route": {"id": f"r{n}", "plan": [f"r{n}-up"], "prefix": f"/{n}/{pad}/"},
                    "upstreams": {f"r{n}-up": {"url": f"http://127.0.0.1:22001/g{generation}"}},
                }
            ),
        )
        for n in range(count)
    ]
    path.chmod(0o644)
    try:
        with sqlite_db(path, isolation_level=None) as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM fmw_routes")
            db.executemany("INSERT INTO fmw_routes (id, doc, updated_at) VALUES (?, ?, 0)", docs)
            db.execute("COMMIT")
        # closed: the last connection checkpointed into the file and removed its WAL
    finally:
        path.chmod(0o444)


def read_while_written(path: Path, writes: int) -> list[str]:
    """What the paused reader printed, the test writing a new generation at each of its
    first `writes` pauses."""
    reader = subprocess.Popen(
        [*unprivileged(), sys.executable, "-c", _PAUSED_READER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reader.stdin is not None and reader.stdout is not None
    lines = []
    try:
        for line in reader.stdout:
            lines.append(line.strip())
            if line.startswith("paused"):
                if writes:
                    writes -= 1
                    write_routes(path, 10 - writes, 150)
                reader.stdin.write("go\n")
                reader.stdin.flush()
    finally:
        reader.stdin.close()
        reader.wait(timeout=60)
        reader.stdout.close()
    return lines


def test_a_read_of_a_read_only_store_a_writer_changed_under_it_is_made_again(
    tmp_path: Path,
) -> None:
    # A user who may not write the store reads the file alone; a writer that started and
    # checkpointed meanwhile changed pages under the read: "SQLite store error: database
    # disk image is malformed" (or routes of two states) on a healthy store. The read is
    # made again once the file held still under it.
    path, _ = made_store(tmp_path / "store")
    write_routes(path, 1, 300)
    lines = read_while_written(path, writes=1)
    assert lines[0] == "paused"
    assert lines[-1] == "read 150 http://127.0.0.1:22001/g10", lines


def test_a_read_only_store_a_writer_never_leaves_alone_is_refused_saying_why(
    tmp_path: Path,
) -> None:
    path, _ = made_store(tmp_path / "store")
    write_routes(path, 1, 300)
    lines = read_while_written(path, writes=100)
    assert lines.count("paused") == STEADY_READ_TRIES, lines
    assert lines[-1].startswith("error SQLite store error: another process kept writing gw.db")
    assert "give this user write access" in lines[-1]


# The ledger's reader of a file this user may not write (`budgets show`, `usage`): paused
# (once per connection) in the middle of reading the usage records, until the test has
# written, as `_PAUSED_READER` does for the route store.
_PAUSED_LEDGER_READER = """
import asyncio, sys
import fallback_mw.store.ledgers.sqlite as ledgers
from fallback_mw.budget.ledger import LedgerUnavailable
real = ledgers.fetch_leniently
paused = set()
def fetch_leniently(conn, *args):
    calls = [0]
    def progress():
        calls[0] += 1
        if calls[0] == 3 and id(conn) not in paused:  # in the middle of the SELECT
            paused.add(id(conn))
            print("paused", flush=True)
            sys.stdin.readline()
        return 0
    conn.set_progress_handler(progress, 200)
    try:
        return real(conn, *args)
    finally:
        conn.set_progress_handler(None, 0)
ledgers.fetch_leniently = fetch_leniently
async def main():
    ledger = ledgers.SQLiteLedger(sys.argv[1])
    try:
        for _ in range(2):  # and a second read after it
            records = await ledger.usage(limit=100000)
            print("read", len(records), *sorted({r.route[:3] for r in records}), flush=True)
    except LedgerUnavailable as exc:
        print("error", exc, flush=True)
    finally:
        await ledger.aclose()
asyncio.run(main())
"""


def write_usage(path: Path, generation: int, count: int) -> None:
    """`count` usage records, their route naming `generation`, in one transaction (the old
    ones deleted); the file writable for it, read-only again after."""
    from datetime import UTC, datetime

    from fallback_mw.store.ledgers.schema import encode_sqlite_time

    pad = "x" * 600  # spread over many pages: the checkpoint rewrites them under the read
    at = encode_sqlite_time(datetime.now(UTC))
    rows = [(at, f"req{n}", f"g{generation}-{pad}", "t", "[]", "[]") for n in range(count)]
    path.chmod(0o644)
    try:
        with sqlite_db(path, isolation_level=None) as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM fmw_usage")
            db.executemany(
                "INSERT INTO fmw_usage (at, request_id, route, tenant, candidates, attempts) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                rows,
            )
            db.execute("COMMIT")
        # closed: the last connection checkpointed into the file and removed its WAL
    finally:
        path.chmod(0o444)


def read_ledger_while_written(path: Path, writes: int) -> list[str]:
    reader = subprocess.Popen(
        [*unprivileged(), sys.executable, "-c", _PAUSED_LEDGER_READER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reader.stdin is not None and reader.stdout is not None
    lines = []
    try:
        for line in reader.stdout:
            lines.append(line.strip())
            if line.startswith("paused"):
                if writes:
                    writes -= 1
                    write_usage(path, 10 - writes, 150)
                reader.stdin.write("go\n")
                reader.stdin.flush()
    finally:
        reader.stdin.close()
        reader.wait(timeout=60)
        reader.stdout.close()
    return lines


def test_a_read_of_a_read_only_ledger_a_writer_changed_under_it_is_made_again(
    tmp_path: Path,
) -> None:
    """The store's reader of a file alone was made steady (`read_steadily`); the ledger's
    was not: a user who may not write the ledger (`budgets show`, `usage`) read the file
    alone, and a writer that checkpointed meanwhile changed pages under the read
    ("database disk image is malformed", or records of two states): `budget_unavailable`
    for a healthy ledger."""
    path, _ = made_store(tmp_path / "store")
    write_usage(path, 1, 300)
    path.chmod(0o444)
    try:
        lines = read_ledger_while_written(path, writes=1)
    finally:
        path.chmod(0o644)
    assert lines[0] == "paused", lines
    reads = [line for line in lines if not line.startswith("paused")]
    assert reads == ["read 150 g10", "read 150 g10"], lines
