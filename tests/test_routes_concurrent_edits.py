"""Two operators editing one store route at once (`routes set`, `set-fallback`,
`clear-fallback`, `remove` from two shells): each edit reads the route, checks it and writes
it back, so the second writer must apply its change to the first one's result, or find the
route gone — never overwrite it unseen while both print success."""

from __future__ import annotations

import asyncio
import sys
import time

import asyncpg
import pytest

from fallback_mw.store.model import StoredRoute
from fallback_mw.store.routes import open_store
from tests.helpers import sqlite_db
from tests.test_cli_admin import cli

PRIMARY = "http://127.0.0.1:21401"
FALLBACK = "http://127.0.0.1:21402"

# A command in a process of its own, as `fallback-mw ARGV` runs it (the entry point's
# main), its imports done before it is told to go. The first writer waits on the lock
# while the second starts, within the store's 5 s query timeout: a process's start-up
# alone took 7 s on a loaded machine (load 17, two cores), and the first writer gave up
# ("did not answer within 5 s") before the second reached the lock.
_READY_THEN_RUN = """
import sys
import asyncpg
import fallback_mw.store.postgres
import fallback_mw.cli.routes  # the verb's own module: the parser no longer imports it
from fallback_mw.cli import build_parser, main
build_parser()
print("ready", flush=True)
sys.stdin.readline()
sys.exit(main(sys.argv[1:]))
"""


async def _ready(*argv: str) -> asyncio.subprocess.Process:
    """The command's process, started and waiting for its go (`_go`)."""
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-c", _READY_THEN_RUN, *argv),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), timeout=120)
    assert line == b"ready\n", line
    return process


async def _go(process: asyncio.subprocess.Process) -> None:
    assert process.stdin is not None
    process.stdin.write(b"go\n")
    await process.stdin.drain()


async def _waiting_on_the_lock(admin: asyncpg.Connection, count: int) -> None:
    deadline = time.monotonic() + 20
    while True:
        waiting = await admin.fetchval(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        if waiting >= count:
            return
        assert time.monotonic() < deadline, f"{waiting} of {count} writers reached the lock"
        await asyncio.sleep(0.05)


async def _race(pg_url: str, first: list[str], second: list[str]) -> list[tuple[int, str, str]]:
    """Both commands read the route, then write in this order: its row is locked until both
    wait on it (PostgreSQL queues a row's waiters, and grants them in turn)."""
    a, b = await asyncio.gather(_ready(*first), _ready(*second))
    holder = await asyncpg.connect(pg_url)
    watcher = await asyncpg.connect(pg_url)  # outside the transaction: a fresh view of waits
    try:
        transaction = holder.transaction()
        await transaction.start()
        await holder.execute("SELECT id FROM fmw_routes WHERE id = 'chat' FOR UPDATE")
        await _go(a)
        await _waiting_on_the_lock(watcher, 1)
        await _go(b)
        await _waiting_on_the_lock(watcher, 2)
        await transaction.rollback()
        results = []
        for process in (a, b):
            out, err = await asyncio.wait_for(process.communicate(), timeout=30)
            assert process.returncode is not None
            results.append((process.returncode, out.decode(), err.decode()))
        return results
    finally:
        await holder.close()
        await watcher.close()
        for process in (a, b):  # a failed wait leaves neither command running
            if process.returncode is None:
                process.kill()
                await process.communicate()


async def _route(store_url: str) -> StoredRoute | None:
    store = open_store(store_url)
    try:
        routes = await store.load_routes()
    finally:
        await store.aclose()
    return routes[0] if routes else None


@pytest.mark.anyio
async def test_a_retries_change_racing_set_fallback_keeps_the_fallback(pg_url: str) -> None:
    base = ["--store", pg_url, "--id", "chat"]
    status, _, err = await cli("routes", "add", *base, "--prefix", "/v1/", "--upstream", PRIMARY)
    assert status == 0, err

    (fb_status, fb_out, fb_err), (set_status, set_out, set_err) = await _race(
        pg_url,
        ["routes", "set-fallback", *base, "--upstream", FALLBACK, "--retries", "1"],
        ["routes", "set", *base, "--retries", "3"],
    )
    assert fb_status == 0, fb_err
    assert "fallback set" in fb_out
    assert set_status == 0, set_err
    assert "retries 3" in set_out

    route = await _route(pg_url)
    assert route is not None
    # Both edits, in the order they landed: the fallback the first one set, the retries
    # the second one set. (Before: the second wrote back the plan it had read, without
    # the fallback, and both commands said they had done their part.)
    assert list(route.route.plan) == ["chat-primary", "chat-fallback"]
    assert route.route.retries == 3


@pytest.mark.anyio
async def test_an_edit_racing_remove_does_not_bring_the_route_back(pg_url: str) -> None:
    base = ["--store", pg_url, "--id", "chat"]
    status, _, err = await cli(
        "routes", "add", *base, "--prefix", "/v1/", "--upstream", PRIMARY,
        "--fallback", FALLBACK, "--retries", "1",
    )  # fmt: skip
    assert status == 0, err

    (rm_status, rm_out, rm_err), (set_status, set_out, set_err) = await _race(
        pg_url, ["routes", "remove", *base], ["routes", "set", *base, "--retries", "2"]
    )
    assert rm_status == 0, rm_err
    assert "removed" in rm_out
    # The route was gone when `set` came to write: said, exit 1, nothing written.
    assert set_status == 1, set_out
    assert set_out == ""
    assert set_err.strip() == "fallback-mw: error: no route 'chat' in the store"
    assert await _route(pg_url) is None


@pytest.mark.anyio
async def test_a_conditional_replace_writes_only_over_the_record_it_read(
    ledger_store: str,
) -> None:
    url = ledger_store  # a SQLite file, then a fresh PostgreSQL database
    base = ["--store", url, "--id", "chat"]
    status, _, err = await cli("routes", "add", *base, "--prefix", "/v1/", "--upstream", PRIMARY)
    assert status == 0, err
    read = await _route(url)
    assert read is not None and read.doc is not None
    status, _, err = await cli("routes", "set", *base, "--retries", "2")
    assert status == 0, err

    store = open_store(url)
    try:
        stale = StoredRoute(route=read.route, upstreams=read.upstreams)
        assert await store.replace_route(stale, expected=read.doc) is False
        assert (await store.load_routes())[0].route.retries == 2
        current = (await store.load_routes())[0]
        assert await store.replace_route(stale, expected=current.doc) is True
        assert (await store.load_routes())[0].route.retries == 0
    finally:
        await store.aclose()


async def _exec(store_url: str, *statements: str) -> None:
    """DDL straight on the store's database (SQLite file or PostgreSQL)."""
    if store_url.startswith("sqlite:"):
        with sqlite_db(store_url.removeprefix("sqlite:///")) as conn:
            for statement in statements:
                conn.execute(statement)
        return
    conn = await asyncpg.connect(store_url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


async def _faults(store_url: str) -> list[str]:
    store = open_store(store_url)
    try:
        return sorted(f"{f.kind} {f.target}" for f in await store.load_faults())
    finally:
        await store.aclose()


def _blocking_fault_deletes(store_url: str) -> tuple[list[str], list[str]]:
    """A trigger that fails every DELETE on fmw_faults: `routes remove` failing between its
    route and its faults, as a lost connection or a killed command would. And its undoing."""
    if store_url.startswith("sqlite:"):
        return (
            ["CREATE TRIGGER fxbc_block BEFORE DELETE ON fmw_faults "
             "BEGIN SELECT RAISE(ABORT, 'fault delete blocked'); END"],
            ["DROP TRIGGER fxbc_block"],
        )  # fmt: skip
    return (
        ["CREATE FUNCTION fxbc_block() RETURNS trigger LANGUAGE plpgsql AS "
         "$$ BEGIN RAISE EXCEPTION 'fault delete blocked'; END $$",
         "CREATE TRIGGER fxbc_block BEFORE DELETE ON fmw_faults "
         "FOR EACH ROW EXECUTE FUNCTION fxbc_block()"],
        ["DROP TRIGGER fxbc_block ON fmw_faults", "DROP FUNCTION fxbc_block()"],
    )  # fmt: skip


@pytest.mark.anyio
async def test_remove_takes_the_route_and_its_faults_in_one_transaction(
    ledger_store: str,
) -> None:
    # `routes remove` deleted the route, then its faults, in two statements: a gateway
    # reloading in between, or a command cut between them, left the route gone and its
    # `fail` fault stored, and the route added back under the same id (same derived
    # upstream names) answered 503 to every request. Now both go in one transaction: a
    # failure before the commit leaves the route and its faults as they were.
    base = ["--store", ledger_store, "--id", "chat"]
    status, _, err = await cli(
        "routes", "add", *base, "--prefix", "/v1/", "--upstream", PRIMARY,
        "--fallback", FALLBACK, "--retries", "1",
    )  # fmt: skip
    assert status == 0, err
    ttl = ["--store", ledger_store, "--ttl", "600"]
    for fault in (["fail", "--upstream", "chat-primary"], ["pin", "--route", "chat",
                  "--candidate", "chat-fallback"]):  # fmt: skip
        status, _, err = await cli("faults", "set", fault[0], *ttl, *fault[1:])
        assert status == 0, err
    before = await _faults(ledger_store)
    assert before == ["fail chat-primary", "pin chat"]

    block, unblock = _blocking_fault_deletes(ledger_store)
    await _exec(ledger_store, *block)
    status, out, err = await cli("routes", "remove", *base)
    assert status == 1 and out == "", (out, err)
    assert len(err.splitlines()) == 1 and err.startswith("fallback-mw: error: "), err
    # Nothing changed: the route is still there, with its faults.
    route = await _route(ledger_store)
    assert route is not None and route.route.id == "chat"
    assert await _faults(ledger_store) == before

    await _exec(ledger_store, *unblock)
    assert await cli("routes", "remove", *base) == (
        0, "route 'chat' removed; 2 fault(s) on it cleared\n", ""
    )  # fmt: skip
    assert await _route(ledger_store) is None
    assert await _faults(ledger_store) == []


@pytest.mark.anyio
async def test_remove_takes_out_a_record_too_broken_to_load(ledger_store: str) -> None:
    # A record written by hand (or by a script) that does not load makes every gateway
    # refuse its reloads; `routes remove --id` of it, the repair, read the whole store
    # first and was refused (exit 2) by that same record. It removes it now.
    base = ["--store", ledger_store, "--id", "chat"]
    status, _, err = await cli("routes", "add", *base, "--prefix", "/v1/", "--upstream", PRIMARY)
    assert status == 0, err
    await _exec(ledger_store, "UPDATE fmw_routes SET doc = '{\"route\": 1}' WHERE id = 'chat'")
    assert await cli("routes", "remove", *base) == (0, "route 'chat' removed\n", "")
    assert await _route(ledger_store) is None


@pytest.mark.anyio
async def test_clear_fallback_drops_the_fallback_and_its_faults_in_one_transaction(
    ledger_store: str,
) -> None:
    # `routes clear-fallback` wrote the route without its fallback, then cleared the faults
    # on that fallback in a second step: cut in between, the `fail` fault on chat-fallback
    # stayed stored, and the fallback set back later under that derived name started
    # failing. Now both are one transaction: a failure before the commit changes nothing.
    base = ["--store", ledger_store, "--id", "chat"]
    status, _, err = await cli(
        "routes", "add", *base, "--prefix", "/v1/", "--upstream", PRIMARY,
        "--fallback", FALLBACK, "--retries", "1",
    )  # fmt: skip
    assert status == 0, err
    ttl = ["--store", ledger_store, "--ttl", "600"]
    for fault in (
        ["fail", "--upstream", "chat-fallback"],
        ["pin", "--route", "chat", "--candidate", "chat-fallback"],
        ["hang", "--upstream", "chat-primary"],
    ):
        status, _, err = await cli("faults", "set", fault[0], *ttl, *fault[1:])
        assert status == 0, err
    before = await _faults(ledger_store)

    block, unblock = _blocking_fault_deletes(ledger_store)
    await _exec(ledger_store, *block)
    status, out, err = await cli("routes", "clear-fallback", *base)
    assert status == 1 and out == "", (out, err)
    route = await _route(ledger_store)
    assert route is not None and list(route.route.plan) == ["chat-primary", "chat-fallback"]
    assert await _faults(ledger_store) == before

    await _exec(ledger_store, *unblock)
    assert await cli("routes", "clear-fallback", *base) == (
        0, "route 'chat': fallback cleared (chat-primary only); 2 fault(s) on chat-fallback "
        "cleared\n", "",
    )  # fmt: skip
    route = await _route(ledger_store)
    assert route is not None and list(route.route.plan) == ["chat-primary"]
    assert await _faults(ledger_store) == ["hang chat-primary"]
