"""Differential: one generated sequence of the operator's store commands (`routes add`,
`set-fallback`, `clear-fallback`, `remove`, `list`; `faults set` fail / hang / revoke / pin,
with and without `--replace`, `faults clear`, `faults list`) run against a SQLite store
and a PostgreSQL one must answer alike: the same exit status, the same output and the same
refusals (SPEC §10: every admin verb, whichever store it finds). Expiry times differ by
the moment each ran; they are compared as printed, once the clock's digits are masked."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fallback_mw.cli import main
from fallback_mw.store.routes import open_store
from tests.conftest import PG_HOST, PG_PORT, PG_PREFIX, PG_USER, require_service

SETTINGS = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

IDS = ["chat", "Chat", "a.b:c", "x-1"]
URLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002/v1", "http://localhost:9003"]

commands = st.one_of(
    st.builds(
        lambda id_, prefix, url, tenant, fallback, retries: [
            "routes", "add", "--id", id_, "--prefix", prefix, "--upstream", url,
            "--auth-env", "PRIMARY_KEY", "--retries", str(retries),
            *(["--tenant", tenant] if tenant else []),
            *(["--fallback", fallback, "--fallback-auth-env", "BACKUP_KEY"] if fallback else []),
        ],
        st.sampled_from(IDS), st.sampled_from(["/v1/", "/api/", "/v1/chat/"]),
        st.sampled_from(URLS), st.sampled_from([None, "acme", "Acme"]),
        st.sampled_from([None, *URLS]), st.integers(0, 2),
    ),
    st.builds(
        lambda id_, url: ["routes", "set-fallback", "--id", id_, "--upstream", url,
                          "--auth-env", "BACKUP_KEY"],
        st.sampled_from(IDS), st.sampled_from(URLS),
    ),
    st.builds(lambda id_: ["routes", "clear-fallback", "--id", id_], st.sampled_from(IDS)),
    st.builds(lambda id_: ["routes", "remove", "--id", id_], st.sampled_from(IDS)),
    st.just(["routes", "list"]),
    st.builds(
        lambda kind, name, replace: ["faults", "set", kind, "--upstream", name, "--ttl", "600",
                                     *(["--replace"] if replace else [])],
        st.sampled_from(["fail", "hang", "revoke"]),
        st.sampled_from(["chat", "chat-fallback", "nobody"]), st.booleans(),
    ),
    st.builds(
        lambda id_, candidate: ["faults", "set", "pin", "--route", id_, "--candidate", candidate,
                                "--ttl", "600"],
        st.sampled_from(IDS), st.sampled_from(["chat", "chat-fallback", "nobody"]),
    ),
    st.builds(
        lambda which: ["faults", "clear", *which],
        st.sampled_from([["--all"], ["--upstream", "chat"], ["--route", "chat"]]),
    ),
    st.just(["faults", "list"]),
)  # fmt: skip


def _masked(text: str, store: str) -> str:
    text = text.replace(store, "STORE")
    text = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", "TIME", text)
    return re.sub(r"expires_at=[\d.e+]+", "expires_at=N", text)


def _run(store: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[Any, ...]:
    capsys.readouterr()
    status = main([*argv, "--store", store])
    out, err = capsys.readouterr()
    return status, _masked(out, store), _masked(err, store)


async def _pg(database: str, statement: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, database=database)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


async def _made(url: str) -> None:
    store = open_store(url)
    try:
        await store.load_routes()
    finally:
        await store.aclose()


@pytest.fixture
def pg_database() -> Iterator[str]:
    require_service("PostgreSQL", PG_HOST, PG_PORT)
    name = f"{PG_PREFIX}{uuid.uuid4().hex[:12]}"
    asyncio.run(_pg("postgres", f'CREATE DATABASE "{name}"'))
    try:
        yield name
    finally:
        asyncio.run(_pg("postgres", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.mark.slow
@SETTINGS
@given(argvs=st.lists(commands, min_size=1, max_size=12))
def test_sqlite_and_postgresql_stores_answer_the_operator_alike(
    argvs: list[list[str]], tmp_path: Path, pg_database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    sqlite = f"sqlite:///{tmp_path / f'{uuid.uuid4().hex}.db'}"
    postgresql = f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{pg_database}"
    for store in (sqlite, postgresql):  # the file and the tables (SQLite notes a missing file)
        asyncio.run(_made(store))
    asyncio.run(_pg(pg_database, "TRUNCATE fmw_routes, fmw_faults"))
    for n, argv in enumerate(argvs):
        answers = [_run(store, argv, capsys) for store in (sqlite, postgresql)]
        assert answers[0] == answers[1], (n, argv)
