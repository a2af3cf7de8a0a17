"""The SQLite ledger's file, removed or replaced by an operator while a gateway serves: the
gateway writes its holds, settlements and usage records into the file at the store's path,
the one `budgets show`, `usage`, another gateway and this one after a restart read."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path

import anyio
import httpx
import pytest

from fallback_mw import Gateway
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers.sqlite import SQLiteLedger
from tests.helpers import client_for, free_port, log_text, wait_listening
from tests.test_budget_guard import gateway_config, json_handler
from tests.test_cli_admin import run_cli
from tests.upstreams import host_app, upstream

ANSWER = {"model": "gpt-test", "usage": {"prompt_tokens": 10, "completion_tokens": 5}}
BODY = {"model": "gpt-test", "max_tokens": 5}
CHECK_INTERVAL = 1.0  # OpenedFile(interval=...) in SQLiteCalls
HANDOVER = 2.5  # WalHandover(bound=...) in SQLiteCalls
BUDGET = BudgetConfig(limit=Decimal(100), window="month")


def remove_database(path: Path) -> None:
    for name in (path.name, f"{path.name}-wal", f"{path.name}-shm"):
        (path.parent / name).unlink(missing_ok=True)


@pytest.mark.anyio
@pytest.mark.parametrize("operator", ["removed", "restored_from_backup"])
async def test_a_ledger_file_removed_or_replaced_while_serving_is_not_written_blind(
    tmp_path: Path, operator: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Seen with `fallback-mw serve`: after `rm gw.db*` (or `mv backup.db gw.db`) the gateway
    # went on settling into the file it had open, now unlinked: `budgets show` and `usage`
    # read the file at the path and saw none of the spend, a second gateway on the same
    # store held against another ledger, and a restart lost every settlement since.
    path = tmp_path / "gw.db"
    async with upstream(json_handler(ANSWER)) as primary:
        conf = gateway_config({"primary": primary.url}, store=f"sqlite:///{path}", limit="100")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                assert (await client.post("/v1/chat", json=BODY)).status_code == 200
                backup = tmp_path / "backup.db"
                source, copy = sqlite3.connect(path), sqlite3.connect(backup)
                try:
                    source.backup(copy)
                finally:
                    source.close()
                    copy.close()
                remove_database(path)
                if operator == "restored_from_backup":
                    os.replace(backup, path)
                caplog.set_level(logging.WARNING, logger="fallback_mw.budget")
                await anyio.sleep(
                    CHECK_INTERVAL + 0.2
                )  # the ledger looks at its path once a second
                # Fail closed (503 budget_unavailable) while the files it let go of may
                # still be in use: within the handover's bound (sqlite_connect.WalHandover,
                # 2.5 s; the route store's own connection to the path counts).
                statuses = [(await client.post("/v1/chat", json=BODY)).status_code]
                waited = anyio.current_time() + 5
                while statuses[-1] == 503 and anyio.current_time() < waited:
                    await anyio.sleep(0.2)
                    statuses.append((await client.post("/v1/chat", json=BODY)).status_code)
                for _ in range(2):
                    statuses.append((await client.post("/v1/chat", json=BODY)).status_code)
                assert set(statuses) <= {200, 503}
                assert statuses[-3:] == [200, 200, 200]
        finally:
            await gateway.aclose()
    reader = SQLiteLedger(str(path))  # what `budgets show` and `usage` open
    try:
        records = await reader.usage()
        status = await reader.status("acme", BUDGET)
    finally:
        await reader.aclose()
    kept = 1 if operator == "restored_from_backup" else 0
    served = kept + statuses.count(200)
    assert len([r for r in records if r.status == 200]) == served
    assert status.held == 0
    assert status.spent == Decimal("0.02") * served
    assert any("removed or replaced" in r.getMessage() for r in caplog.records)


@pytest.mark.anyio
async def test_a_ledger_wal_removed_while_serving_leaves_the_store_readable(
    tmp_path: Path,
) -> None:
    # Seen with `fallback-mw serve`: after `rm gw.db-wal` the gateway served on, writing
    # into the WAL it had open, while `budgets show`, `usage`, `routes list` and the
    # gateway's own route reload answered `disk I/O error` until it was restarted.
    path = tmp_path / "gw.db"
    async with upstream(json_handler(ANSWER)) as primary:
        conf = gateway_config({"primary": primary.url}, store=f"sqlite:///{path}", limit="100")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                assert (await client.post("/v1/chat", json=BODY)).status_code == 200
                (tmp_path / "gw.db-wal").unlink()
                await anyio.sleep(CHECK_INTERVAL + 0.2)
                for _ in range(2):
                    assert (await client.post("/v1/chat", json=BODY)).status_code == 200
                reader = SQLiteLedger(str(path))  # `usage` while the gateway still runs
                try:
                    records = await reader.usage()
                    status = await reader.status("acme", BUDGET)
                finally:
                    await reader.aclose()
        finally:
            await gateway.aclose()
    assert len(records) == 3
    assert (status.held, status.spent) == (0, Decimal("0.06"))


def serve_limited(config: Path, port: int, log: Path, limit: int) -> subprocess.Popen[bytes]:
    """`fallback-mw serve` started under `ulimit -f` (its file size limit `limit` bytes)."""
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "fallback_mw", "serve", "--config", str(config)),
                *("--host", "127.0.0.1", "--port", str(port)),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard)),
        )


@contextlib.asynccontextmanager
async def served_under(tmp_path: Path, limit: int) -> AsyncIterator[httpx.AsyncClient]:
    """A client of `fallback-mw serve` under `ulimit -f` (`limit` bytes), its log in
    tmp_path/serve.log: one budgeted route on a SQLite store."""
    config = tmp_path / "gw.toml"
    async with upstream(json_handler(ANSWER)) as primary:
        config.write_text(
            f"""
[gateway]
store = "sqlite:///{tmp_path / "gw.db"}"
allow_hosts = ["127.0.0.1"]
[upstreams.primary]
url = "{primary.url}"
[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary"]
budget = "acme"
[budgets.acme]
limit = 100.0
window = "total"
[prices."gpt-test"]
input_per_mtok = 1000
output_per_mtok = 2000
""",
            encoding="utf-8",
        )
        port, log = free_port(), tmp_path / "serve.log"
        process = serve_limited(config, port, log, limit)
        try:
            await wait_listening(process, port, log)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                yield client
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.mark.anyio
async def test_a_gateway_at_its_file_size_limit_says_so(tmp_path: Path) -> None:
    # Seen with `ulimit -f` (RLIMIT_FSIZE) where `fallback-mw serve` was started: once the
    # WAL reached the limit every budgeted request was refused, the log said only
    # "SQLite ledger unreachable (OperationalError)", and the admin commands, run from a
    # shell without that limit, found nothing wrong with the file.
    limit = 96 * 1024  # the database itself grows to it
    async with served_under(tmp_path, limit) as client:
        for _ in range(2000):
            answer = await client.post("/v1/chat", json=BODY)
            if answer.status_code == 503:
                break
            assert answer.status_code == 200, answer.text
        assert answer.json()["error"]["code"] == "budget_unavailable"
    text = log_text(tmp_path / "serve.log")
    assert "SQLite ledger unreachable (OperationalError: " in text, text
    assert f"has reached this process's file size limit ({limit} bytes, ulimit -f)" in text, text


@pytest.mark.anyio
async def test_a_gateway_under_a_file_size_limit_keeps_its_wal_within_it(tmp_path: Path) -> None:
    # Under `ulimit -f 1024` (1 MiB) the gateway served about 50 budgeted requests, then
    # refused every one (503) until restarted: each holds and settles a few pages, and
    # SQLite checkpoints (and restarts) the WAL only past 1,000 pages, about 4 MB, while
    # the database itself stayed under 100 KB.
    async with served_under(tmp_path, 1024 * 1024) as client:
        for _ in range(300):
            answer = await client.post("/v1/chat", json=BODY)
            assert answer.status_code == 200, answer.text
    assert "unreachable" not in log_text(tmp_path / "serve.log")


@pytest.mark.anyio
async def test_a_removed_wal_another_process_still_writes_is_not_forked(tmp_path: Path) -> None:
    # `serve --workers 2` and `rm gw.db-wal`: the worker that noticed first reopened at once
    # and wrote into a new WAL under the WAL index the other worker still wrote the removed
    # one under: requests failed with DatabaseError and usage records were lost. A process
    # now waits (fail closed) until the others have let go of the removed WAL.
    path = tmp_path / "gw.db"
    async with upstream(json_handler(ANSWER)) as primary:
        conf = gateway_config({"primary": primary.url}, store=f"sqlite:///{path}", limit="100")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                assert (await client.post("/v1/chat", json=BODY)).status_code == 200
                other = sqlite3.connect(path, isolation_level=None)  # the other worker
                other.execute("SELECT COUNT(*) FROM fmw_usage").fetchone()
                (tmp_path / "gw.db-wal").unlink()
                other.execute(  # it writes on, into the WAL it has open
                    "INSERT INTO fmw_budgets (budget_id, limit_units, window_kind, "
                    "default_hold_units, updated_at) VALUES ('other', 1, 'total', 0, 'x')"
                )
                await anyio.sleep(CHECK_INTERVAL + 0.2)
                refused = await client.post("/v1/chat", json=BODY)
                assert refused.status_code == 503, refused.text
                other.close()  # the other worker's turn to notice: the last to let go
                await served_again(client)
        finally:
            await gateway.aclose()
    check = sqlite3.connect(path)
    try:
        assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert check.execute("SELECT budget_id FROM fmw_budgets").fetchall() == [("other",)]
        served = check.execute("SELECT COUNT(*) FROM fmw_usage WHERE status = 200").fetchone()
    finally:
        check.close()
    assert served == (2,)


async def served_again(client: httpx.AsyncClient) -> None:
    """One budgeted request served, once the others have let go of the removed files (the
    wait ends at the latest HANDOVER seconds after this process let go: each of them
    notices within a second)."""
    with anyio.fail_after(HANDOVER + 2.0):
        for _ in range(100):
            if (await client.post("/v1/chat", json=BODY)).status_code == 200:
                return
            await anyio.sleep(0.1)
    pytest.fail("still refused")


class OtherWorker:
    """Another process with the store open, as a second `serve --workers` worker: it reads,
    then writes and closes when told (`step`)."""

    SCRIPT = (
        "import sqlite3, sys\n"
        "conn = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "conn.execute('SELECT COUNT(*) FROM fmw_usage').fetchone()\n"
        "print('open', flush=True)\n"
        "sys.stdin.readline()\n"
        'conn.execute("INSERT INTO fmw_budgets (budget_id, limit_units, window_kind, "\n'
        "    \"default_hold_units, updated_at) VALUES ('other', 1, 'total', 0, 'x')\")\n"
        "print('wrote', flush=True)\n"
        "sys.stdin.readline()\n"
        "conn.close()\n"
        "print('closed', flush=True)\n"
    )

    def __init__(self, path: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", self.SCRIPT, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.read() == "open"

    def read(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def step(self) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


@pytest.mark.anyio
async def test_a_removed_database_another_process_still_uses_is_not_overlaid(
    tmp_path: Path,
) -> None:
    # `serve --workers 2` and `rm gw.db` (its -wal and -shm left in place): the worker that
    # noticed first opened a new gw.db at once, under the WAL and WAL index the other
    # worker still wrote the removed database's pages into. It now waits (fail closed)
    # until the others have let go of them, as for a removed WAL.
    path = tmp_path / "gw.db"
    async with upstream(json_handler(ANSWER)) as primary:
        conf = gateway_config({"primary": primary.url}, store=f"sqlite:///{path}", limit="100")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                assert (await client.post("/v1/chat", json=BODY)).status_code == 200
                other = OtherWorker(path)
                try:
                    path.unlink()
                    assert other.step() == "wrote"  # into the files it has open
                    await anyio.sleep(CHECK_INTERVAL + 0.2)
                    refused = await client.post("/v1/chat", json=BODY)
                    assert refused.status_code == 503, refused.text
                    assert other.step() == "closed"
                finally:
                    other.close()
                await served_again(client)
        finally:
            await gateway.aclose()
    check = sqlite3.connect(path)
    try:
        assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert check.execute("SELECT budget_id FROM fmw_budgets").fetchall() == []
        served = check.execute("SELECT COUNT(*) FROM fmw_usage WHERE status = 200").fetchone()
    finally:
        check.close()
    assert served == (1,)


def test_budgets_show_and_usage_read_a_ledger_another_process_is_writing(tmp_path: Path) -> None:
    # An operator's `sqlite3` session (or a VACUUM) held the write lock: `routes list`
    # answered, but `budgets show` and `usage`, which only read, waited the 5 s busy
    # timeout and failed with "database is locked": opening the ledger took the write lock
    # to migrate a schema already current and to settle stale holds there were none of.
    path = tmp_path / "gw.db"
    store = f"sqlite:///{path}"
    budget = ("--budget", "acme", "--limit", "10", "--window", "total")
    assert run_cli("budgets", "set", "--store", store, *budget)[0] == 0
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        started = time.monotonic()
        status, out, err = run_cli("budgets", "show", "--store", store)
        assert status == 0 and "acme" in out, err
        status, out, err = run_cli("usage", "--store", store, "--since", "1h")
        assert status == 0, err
        assert time.monotonic() - started < 4.0
    finally:
        other.execute("ROLLBACK")
        other.close()
