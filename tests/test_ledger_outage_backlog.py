"""A PostgreSQL outage loses no usage record and no settlement that the ledger refused
before sending: they are kept (up to BACKLOG_LIMIT) and written once the database answers
again. Before, every request of the outage — budgeted or not — left no usage record, and a
budgeted one's hold was charged at its full amount an hour later. The real PostgreSQL
behind a TCP proxy that is cut and opened again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from decimal import Decimal
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from fallback_mw.budget.ledger import LedgerUnavailable, UsageRecord
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers import postgres_backlog
from fallback_mw.store.ledgers.postgres import PostgresLedger
from tests.tcp_proxy import TcpProxy, tcp_proxy

pytestmark = pytest.mark.anyio

BUDGET = BudgetConfig(limit=Decimal("100"), window="month", default_hold=Decimal("0.01"))
RETRY = 1.5  # the kept calls below are made well inside one retry interval


def record(request_id: str) -> UsageRecord:
    return UsageRecord(request_id=request_id, route="chat", tenant="acme", budget_id="acme")


async def make_schema(pg_url: str) -> None:
    """The schema made first, straight and with time to spare: with the tests' 1 s timeout,
    a first call's migration timed out on a loaded CI machine before the test had begun
    (the warm hold of settle_on_the_wire: stop 45's one failure)."""
    first = PostgresLedger(pg_url, timeout=30.0)
    try:
        await first.usage()
    finally:
        await first.aclose()


@pytest.fixture
async def proxied(pg_url: str) -> AsyncIterator[tuple[TcpProxy, PostgresLedger]]:
    await make_schema(pg_url)
    parts = urlsplit(pg_url)
    async with tcp_proxy(parts.hostname or "127.0.0.1", parts.port or 5432) as proxy:
        netloc = f"{parts.username}@127.0.0.1:{proxy.port}"
        url = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
        ledger = PostgresLedger(url, timeout=1.0, retry_interval=RETRY)
        try:
            yield proxy, ledger
        finally:
            await ledger.aclose()


async def outage(proxy: TcpProxy, ledger: PostgresLedger) -> None:
    """Cut the database away and let one call find out (the outage starts)."""
    await proxy.cut("abort")
    with pytest.raises(LedgerUnavailable):
        await ledger.hold("acme", BUDGET, Decimal("0.01"))


async def until_written(ledger: PostgresLedger) -> None:
    deadline = time.monotonic() + 15
    while True:
        try:
            await ledger.status("acme", BUDGET)  # any call that reaches it starts the drain
        except LedgerUnavailable:
            pass
        else:
            if ledger.waiting == 0:
                return
        assert time.monotonic() < deadline, f"{ledger.waiting} records still waiting"
        await asyncio.sleep(0.1)


async def test_records_and_settlements_refused_in_an_outage_are_written_when_it_ends(
    proxied: tuple[TcpProxy, PostgresLedger],
) -> None:
    proxy, ledger = proxied
    hold = await ledger.hold("acme", BUDGET, Decimal("2"))
    assert hold is not None
    await ledger.record_usage(record("before"))

    await outage(proxy, ledger)
    # Served during the outage: the settlement of a hold taken before it, and the record
    # of a request without one (an unbudgeted route's, or a refusal's).
    await ledger.settle_and_record(hold, Decimal("0.5"), record("settled-in-outage"))
    await ledger.record_usage(record("recorded-in-outage"))
    assert ledger.waiting == 2

    await proxy.open()
    await until_written(ledger)
    ids = [r.request_id for r in await ledger.usage()]
    assert ids == ["before", "settled-in-outage", "recorded-in-outage"]
    status = await ledger.status("acme", BUDGET)
    assert (status.spent, status.held) == (Decimal("0.5"), Decimal("0"))  # not the 2 held


async def test_the_backlog_is_bounded_and_what_is_left_at_close_is_said(
    proxied: tuple[TcpProxy, PostgresLedger],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy, ledger = proxied
    monkeypatch.setattr(postgres_backlog, "BACKLOG_LIMIT", 2)
    await ledger.record_usage(record("open"))  # the schema exists
    await outage(proxy, ledger)
    await ledger.record_usage(record("kept-1"))
    await ledger.record_usage(record("kept-2"))
    with caplog.at_level(logging.WARNING, logger="fallback_mw.budget"):
        with pytest.raises(LedgerUnavailable):
            await ledger.record_usage(record("one-too-many"))
        with pytest.raises(LedgerUnavailable):
            await ledger.record_usage(record("still-too-many"))
        assert ledger.waiting == 2
        await ledger.aclose()  # the database is still away: the two are lost, and said
    text = caplog.text
    assert text.count("later ones are dropped") == 1, text
    assert "2 usage records kept through the outage are lost" in text, text
    assert ledger.waiting == 0


async def test_a_hold_whose_answer_was_lost_is_released_once_the_database_answers(
    proxied: tuple[TcpProxy, PostgresLedger],
) -> None:
    """Under load, a pg_terminate_backend (or a database restart, a hung answer) left the
    hold statement committed but its answer lost: the caller got 503 budget_unavailable,
    nothing was served, and the hold stayed HELD for an hour, then was charged in full."""
    proxy, ledger = proxied
    warm = await ledger.hold("acme", BUDGET, Decimal("1"))  # the statement is prepared
    assert warm is not None
    await ledger.settle_and_record(warm, Decimal("0"), record("warm"))
    proxy.mute()  # the database takes the hold; its answer never comes back
    with pytest.raises(LedgerUnavailable):
        await ledger.hold("acme", BUDGET, Decimal("2"))
    proxy.unmute()
    await proxy.cut("abort")  # the connection the answer was lost on goes away
    await proxy.open()
    await asyncio.sleep(RETRY)
    await until_written(ledger)
    status = await ledger.status("acme", BUDGET)
    assert (status.spent, status.held) == (Decimal("0"), Decimal("0"))


async def settle_on_the_wire(
    proxy: TcpProxy, ledger: PostgresLedger, *, arrives: bool, request_id: str
) -> None:
    """A settlement under way when the connection went away: it reached the database (its
    answer lost) or it did not (held on the way there)."""
    warm = await ledger.hold("acme", BUDGET, Decimal("1"))  # the statements are prepared
    assert warm is not None
    await ledger.settle_and_record(warm, Decimal("0.25"), record("warm"))
    hold = await ledger.hold("acme", BUDGET, Decimal("2"))
    assert hold is not None
    proxy.mute() if arrives else proxy.pause()
    with contextlib.suppress(LedgerUnavailable):  # the guard's caller goes on either way
        await ledger.settle_and_record(hold, Decimal("0.5"), record(request_id))
    proxy.unmute()
    proxy.resume()
    await proxy.cut("abort")
    await proxy.open()
    await asyncio.sleep(RETRY)
    await until_written(ledger)


@pytest.mark.parametrize("arrives", [False, True], ids=["lost-on-the-way", "answer-lost"])
async def test_a_settlement_on_the_wire_is_written_exactly_once(
    proxied: tuple[TcpProxy, PostgresLedger], arrives: bool
) -> None:
    """pg_terminate_backend under load: a served request's settlement on the wire was
    dropped, so the request had no usage record and its hold stayed HELD for an hour, then
    was charged in full (its hold, not what it cost). It is kept and written again, but
    only while its hold is still there: never twice."""
    proxy, ledger = proxied
    await settle_on_the_wire(proxy, ledger, arrives=arrives, request_id="served")
    ids = [r.request_id for r in await ledger.usage()]
    assert ids == ["warm", "served"]
    status = await ledger.status("acme", BUDGET)
    assert (status.spent, status.held) == (Decimal("0.75"), Decimal("0"))


async def test_a_hold_on_the_wire_when_its_caller_left_is_released_too(
    proxied: tuple[TcpProxy, PostgresLedger],
) -> None:
    """The client left while the hold statement ran, and the connection went away before
    its answer: the hold the database took was left HELD (then charged in full)."""
    proxy, ledger = proxied
    warm = await ledger.hold("acme", BUDGET, Decimal("1"))  # the statement is prepared
    assert warm is not None
    await ledger.settle_and_record(warm, Decimal("0"), record("warm"))
    proxy.mute()
    caller = asyncio.ensure_future(ledger.hold("acme", BUDGET, Decimal("2")))
    await asyncio.sleep(0.2)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.sleep(1.2)  # the statement's own timeout (1 s) ends it
    proxy.unmute()
    await proxy.cut("abort")
    await proxy.open()
    await asyncio.sleep(RETRY)
    await until_written(ledger)
    status = await ledger.status("acme", BUDGET)
    assert (status.spent, status.held) == (Decimal("0"), Decimal("0"))


async def test_records_refused_while_the_server_turns_connections_away_are_kept(
    pg_url: str,
) -> None:
    """The server answers, but takes no connection: a restart's "the database system is
    starting up", "too many connections", a database an operator closed to connections
    (`ALTER DATABASE ... ALLOW_CONNECTIONS false`, as here). Nothing was sent, as for a
    refused TCP connect, so the record and its settlement are kept and written once the
    database takes connections again (before: each was dropped, the hold later charged in
    full, and every request tried to connect again at once)."""
    name = urlsplit(pg_url).path.lstrip("/")
    await make_schema(pg_url)
    ledger = PostgresLedger(pg_url, timeout=1.0, retry_interval=RETRY)
    admin = await asyncpg.connect(pg_url.rsplit("/", 1)[0] + "/postgres")
    try:
        hold = await ledger.hold("acme", BUDGET, Decimal("2"))
        assert hold is not None
        await ledger.record_usage(record("before"))
        await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", name
        )
        await asyncio.sleep(0.5)  # the pool sees its connections closed
        with pytest.raises(LedgerUnavailable):
            await ledger.hold("acme", BUDGET, Decimal("0.01"))  # the outage starts
        await ledger.settle_and_record(hold, Decimal("0.5"), record("settled-in-outage"))
        await ledger.record_usage(record("recorded-in-outage"))
        assert ledger.waiting == 2

        await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        await until_written(ledger)
        ids = [r.request_id for r in await ledger.usage()]
        assert ids == ["before", "settled-in-outage", "recorded-in-outage"]
        status = await ledger.status("acme", BUDGET)
        assert (status.spent, status.held) == (Decimal("0.5"), Decimal("0"))
    finally:
        await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        await admin.close()
        await ledger.aclose()


async def test_a_drained_batch_whose_commit_answer_was_lost_is_not_written_twice(
    proxied: tuple[TcpProxy, PostgresLedger], pg_url: str
) -> None:
    """The drain's batch (records kept through an outage) committed, but its answer never
    came back (the connection went away: pg_terminate_backend, a restart, a network cut):
    the batch was kept and sent again whole, so every plain usage record in it (an
    unbudgeted route's, a refusal's) and every settlement's record was written twice."""
    proxy, ledger = proxied
    await ledger.record_usage(record("before"))  # the schema exists
    hold = await ledger.hold("acme", BUDGET, Decimal("2"))
    assert hold is not None
    await outage(proxy, ledger)
    await ledger.record_usage(record("kept-1"))
    await ledger.record_usage(record("kept-2"))
    await ledger.settle_and_record(hold, Decimal("0.5"), record("settled-in-outage"))
    assert ledger.waiting == 3

    admin = await asyncpg.connect(pg_url)  # the database itself, not through the proxy
    try:
        proxy.mute_once_sent(b"COMMIT")  # the batch's COMMIT is done; its answer is lost
        await proxy.open()  # the next try (a call's, or the drain's own) writes the batch
        deadline = time.monotonic() + 15
        while await admin.fetchval("SELECT count(*) FROM fmw_usage") < 4:
            assert time.monotonic() < deadline, "the batch was never committed"
            await asyncio.sleep(0.05)
        while ledger.waiting < 3:  # its answer lost: kept to be sent again
            assert time.monotonic() < deadline, "the batch was not kept"
            await asyncio.sleep(0.05)
    finally:
        await admin.close()
    proxy.unmute()
    await proxy.cut("abort")  # the connection the answer was lost on goes away
    await proxy.open()
    await asyncio.sleep(RETRY)
    await until_written(ledger)
    ids = [r.request_id for r in await ledger.usage()]
    assert ids == ["before", "kept-1", "kept-2", "settled-in-outage"]
    status = await ledger.status("acme", BUDGET)
    assert (status.spent, status.held) == (Decimal("0.5"), Decimal("0"))


async def rows_written(pg_url: str) -> list[str]:
    """The request ids in the database itself (read beside the ledger, not through it)."""
    admin = await asyncpg.connect(pg_url)
    try:
        return [row[0] for row in await admin.fetch("SELECT request_id FROM fmw_usage ORDER BY id")]
    finally:
        await admin.close()


async def test_an_idle_process_writes_what_it_kept_once_the_database_is_back(
    proxied: tuple[TcpProxy, PostgresLedger], pg_url: str
) -> None:
    """Traffic stopped with the outage: the records kept through it waited in memory for the
    next ledger call, which never came (a quiet night, a drained node), and were lost with
    the process. Now one try per retry interval writes them while something is kept."""
    proxy, ledger = proxied
    await ledger.record_usage(record("before"))
    await outage(proxy, ledger)
    await ledger.record_usage(record("kept-1"))
    await ledger.record_usage(record("kept-2"))
    await proxy.open()
    deadline = time.monotonic() + 15
    while await rows_written(pg_url) != ["before", "kept-1", "kept-2"]:
        assert time.monotonic() < deadline, f"{ledger.waiting} records still waiting"
        await asyncio.sleep(0.2)
    assert ledger.waiting == 0


async def test_what_was_kept_is_written_whole_at_close_when_the_database_answers(
    proxied: tuple[TcpProxy, PostgresLedger], pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clean shutdown (lifespan shutdown, `aclose`) with the database back writes every
    kept record, however many batches they take, and leaves no pool or drain behind."""
    proxy, ledger = proxied
    monkeypatch.setattr(postgres_backlog, "DRAIN_BATCH", 2)
    await ledger.record_usage(record("before"))
    await outage(proxy, ledger)
    kept = [f"kept-{i}" for i in range(7)]
    for request_id in kept:
        await ledger.record_usage(record(request_id))
    await proxy.open()
    await ledger.aclose()
    assert ledger.waiting == 0
    assert await rows_written(pg_url) == ["before", *kept]  # in order
    await asyncio.sleep(0.5)  # anything left running after the close would write again
    assert ledger._pool is None and ledger._backlog.draining is None
    assert await rows_written(pg_url) == ["before", *kept]  # in order


async def test_a_settlement_kept_through_an_outage_longer_than_the_stale_age_is_written(
    proxied: tuple[TcpProxy, PostgresLedger], pg_url: str
) -> None:
    """A settlement on its way when the connection went away is kept, and written only
    while its hold is there. An outage longer than the stale-hold age let another process
    settle that hold at its amount meanwhile: the kept settlement found no hold and was
    dropped with its usage record, so the request had no record and was charged its hold
    (2), not what it cost (0.5). A hold the reaper settled is kept aside
    (fmw_budget_reaped), and a settlement that finds it there was never written."""
    proxy, ledger = proxied
    other = PostgresLedger(pg_url, stale_hold_seconds=0.5, reap_interval=0)
    try:
        warm = await ledger.hold("acme", BUDGET, Decimal("1"))  # the statements are prepared
        assert warm is not None
        await ledger.settle_and_record(warm, Decimal("0.25"), record("warm"))
        hold = await ledger.hold("acme", BUDGET, Decimal("2"))
        assert hold is not None
        proxy.pause()  # the settlement never reaches the database
        with contextlib.suppress(LedgerUnavailable):
            await ledger.settle_and_record(hold, Decimal("0.5"), record("served"))
        assert ledger.waiting == 1
        await asyncio.sleep(0.6)  # the hold is older than the other process's stale age
        reaping = await other.hold("acme", BUDGET, Decimal("0.01"))  # reaps the stale hold
        assert reaping is not None
        await other.release(reaping)
        status = await other.status("acme", BUDGET)
        assert (status.spent, status.held) == (Decimal("2.25"), Decimal("0"))  # reaped
        await proxy.cut("abort")  # what the pause held back never arrives
        proxy.resume()
        await proxy.open()
        await asyncio.sleep(RETRY)
        await until_written(ledger)
    finally:
        await other.aclose()
    assert [r.request_id for r in await ledger.usage()] == ["warm", "served"]
    status = await ledger.status("acme", BUDGET)
    assert (status.spent, status.held) == (Decimal("0.75"), Decimal("0"))
