"""Store rows written by more than the gateway (an operator's `sqlite3`, a script, another
version): the admin verbs still list, name and remove them, and a running gateway keeps its
routes and still applies fault changes while one is there."""

from __future__ import annotations

import asyncio
import io
from datetime import datetime
from pathlib import Path

import pytest

from fallback_mw import Gateway
from fallback_mw.cli import main
from fallback_mw.store.ledgers.schema import LATEST_VERSION
from tests.helpers import client_for, sqlite_db
from tests.test_cli_admin import gateway_config, wait_for
from tests.upstreams import host_app, status_handler, upstream


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = main(list(argv), stdout=out, stderr=err)
    return status, out.getvalue(), err.getvalue()


async def acli(*argv: str) -> tuple[int, str, str]:
    return await asyncio.to_thread(cli, *argv)  # main() runs its own event loop


@pytest.mark.anyio
async def test_a_record_that_is_not_utf8_is_named_removable_and_stops_no_fault(
    tmp_path: Path,
) -> None:
    # A record whose bytes are not UTF-8 (written with `sqlite3`, or by a tool that wrote
    # Latin-1) failed Python's sqlite3 on the whole query, quoting the whole record: `routes
    # list`, `routes remove` (the repair) and `faults set` ended in "SQLite store error", and
    # every gateway's reload stopped as "route store unreachable", fault changes included.
    path = tmp_path / "gateway.db"
    store = f"sqlite:///{path}"
    async with upstream(status_handler(200, b"chat")) as chat:
        add = ["routes", "add", "--store", store, "--prefix"]
        assert (await acli(*add, "/v1/", "--id", "chat", "--upstream", chat.url))[0] == 0
        assert (await acli(*add, "/o/", "--id", "other", "--upstream", chat.url))[0] == 0
        gateway = Gateway(host_app, config=gateway_config(store))
        runtime = gateway.services.store
        assert runtime is not None
        runtime.poll_interval = 0.05
        try:
            async with client_for(gateway) as client:
                assert (await client.get("/v1/x")).text == "chat"
                with sqlite_db(path) as db:
                    (doc,) = db.execute("SELECT doc FROM fmw_routes WHERE id = 'other'").fetchone()
                    bad = doc.encode().replace(b"/o/", b"/o\xff/")
                    db.execute(
                        "UPDATE fmw_routes SET doc = CAST(? AS TEXT) WHERE id = 'other'", (bad,)
                    )

                async def refusal() -> str | None:
                    return runtime.last_refusal

                assert await wait_for(refusal, "stored route 'other': unreadable record (not "
                                      "UTF-8 text) (`fallback-mw routes remove --id other` "
                                      "takes it out)")  # fmt: skip
                status, out, err = await acli("routes", "list", "--store", store)
                assert status == 0, err
                assert out.startswith("chat\tstore\t/v1/")
                assert "stored route 'other': unreadable record (not UTF-8 text)" in err
                assert "\ufffd" not in err and len(err) < 400
                # A fault set now reaches the running gateway, which keeps its routes.
                fail = ["faults", "set", "fail", "--store", store, "--upstream", "chat-primary"]
                status, _, err = await acli(*fail, "--ttl", "600")
                assert status == 0, err

                async def answer() -> int:
                    return (await client.get("/v1/x")).status_code

                assert await wait_for(answer, 502)
                status, out, err = await acli("routes", "remove", "--store", store, "--id", "other")
                assert (status, out) == (0, "route 'other' removed\n"), err

                async def reloaded() -> bool:
                    return runtime.last_refusal is None

                assert await wait_for(reloaded, True)
                await asyncio.sleep(0)
        finally:
            await gateway.aclose()


def test_a_fault_row_that_is_not_utf8_is_named_not_a_store_error(tmp_path: Path) -> None:
    path = tmp_path / "gateway.db"
    store = f"sqlite:///{path}"
    for name in ("one", "two"):
        fail = ["faults", "set", "fail", "--store", store, "--upstream", name, "--ttl", "600"]
        assert cli(*fail)[0] == 0
    with sqlite_db(path) as db:
        db.execute(
            "UPDATE fmw_faults SET target = CAST(? AS TEXT) WHERE target = 'two'", (b"t\xfeo",)
        )
    status, out, err = cli("faults", "list", "--store", store)
    assert status == 0, err
    assert out.startswith("fail\tupstream=one\t")
    assert "'fail' on 't\ufffdo'" in err and "faults clear --all" in err
    # `faults set` on the row's (scope, target) reads it too.
    status, _, err = cli(
        "faults", "set", "hang", "--store", store, "--upstream", "one", "--ttl", "9"
    )
    assert status == 2 and "already active" in err


def test_listed_routes_never_carry_a_character_a_terminal_acts_on(tmp_path: Path) -> None:
    # A prefix or tenant may hold any character but a control one, so a right-to-left
    # override (U+202E) or a zero-width space reached `routes list`, `check` and `routes
    # add`'s answer raw: the terminal drew the rest of the line reversed (the upstream URL
    # read backwards), or a tenant that looked like another. Shown as `?` now.
    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    rlo, zwsp = "\u202e", "\u200b"
    status, out, err = cli(
        "routes", "add", "--store", store, "--id", "chat", "--prefix", f"/v1{rlo}/",
        "--tenant", f"acme{zwsp}", "--upstream", "http://127.0.0.1:9001",
    )  # fmt: skip
    assert status == 0, err
    assert out == "route 'chat' added (tenant acme?): chat-primary\n"
    status, out, err = cli("routes", "list", "--store", store)
    assert status == 0, err
    assert (
        out == "chat\tstore\t/v1?/\ttenant=acme?\tretries=0\tchat-primary=http://127.0.0.1:9001\n"
    )
    status, out, _ = cli("routes", "list", "--store", store, "--tenant", f"\x1b[2J{rlo}")
    assert (status, out) == (0, "no routes for tenant ?[2J?\n")
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.a]\nurl = "http://127.0.0.1:9001"\n'
        f'[[routes]]\nid = "r"\nprefix = "/v2{rlo}/"\ntenant = "t{zwsp}"\nplan = ["a"]\n',
        encoding="utf-8",
    )
    status, out, err = cli("check", "--config", str(config))
    assert status == 0, err
    assert "prefix /v2?/  tenant t?" in out
    assert rlo not in out and zwsp not in out


def test_budgets_show_reads_hand_edited_ledger_rows(tmp_path: Path) -> None:
    # A spend edited by hand to text or a BLOB, or a window row whose budget id is a BLOB or
    # not UTF-8, made `budgets show` end in "unexpected internal error (ValueError /
    # TypeError)" while the gateways kept counting (SQLite's arithmetic reads such a spend
    # as 0). Each row shows as the ledger counts it; an unreadable id is named leniently.
    path = tmp_path / "gateway.db"
    store = f"sqlite:///{path}"
    assert cli("budgets", "set", "--store", store, "--budget", "acme", "--limit", "10")[0] == 0
    status, out, err = cli("budgets", "show", "--store", store)
    assert status == 0, err
    period = out.splitlines()[1].split()[2]
    with sqlite_db(path) as db:
        windows = "INSERT INTO fmw_budget_windows VALUES (?, ?, ?, ?)"
        db.execute(windows, ("acme", period, "a lot", b"\xff"))
        db.execute(windows, (b"blob\xff", period, 5_000_000, 0))
        db.execute(
            "INSERT INTO fmw_budget_windows VALUES (CAST(? AS TEXT), ?, 0, 0)", (b"t\xfe", period)
        )
    status, out, err = cli("budgets", "show", "--store", store)
    assert status == 0, err
    rows = [line.split() for line in out.splitlines()]
    assert rows[1] == ["acme", "month", period, "10.00", "0.00", "0.00", "10.00"]
    assert [row[0] for row in rows[2:4]] == ["blob\ufffd", "t\ufffd"]


@pytest.mark.anyio
async def test_a_fault_row_under_the_other_scope_is_named_not_applied(ledger_store: str) -> None:
    # A `fail` row under scope 'route' (a hand edit, a script) was read as a fault on the
    # upstream of that name: applied by every gateway and listed as "fail upstream=primary",
    # while `faults clear --upstream primary` cleared "0 fault(s)" and warned that it was
    # still active. It is no fault `faults set` writes: named, not applied, removable.
    import asyncpg

    store = ledger_store  # a SQLite file, then a fresh PostgreSQL database
    fail = ["faults", "set", "fail", "--store", store, "--upstream", "primary", "--ttl", "600"]
    assert (await acli(*fail))[0] == 0
    if store.startswith("sqlite:"):
        with sqlite_db(store.removeprefix("sqlite:///")) as db:
            db.execute("UPDATE fmw_faults SET scope = 'route'")
    else:
        conn = await asyncpg.connect(store)
        try:
            await conn.execute("UPDATE fmw_faults SET scope = 'route'")
        finally:
            await conn.close()
    status, out, err = await acli("faults", "list", "--store", store)
    assert (status, out) == (0, "no faults\n"), err
    assert "'fail' on 'primary'" in err and "faults clear --all" in err
    status, out, err = await acli(*fail[:-2], "--ttl", "60")
    assert status == 0, err
    status, out, err = await acli("faults", "clear", "--store", store, "--upstream", "primary")
    assert (status, out) == (0, "1 fault(s) cleared\n"), err


@pytest.mark.anyio
async def test_a_command_named_for_an_id_that_starts_with_a_dash_runs(tmp_path: Path) -> None:
    # Ids may start with `-` (letters, digits and -_.:). The repair named for one, pasted
    # as printed (`routes remove --id -x`), was refused by argparse ("expected one
    # argument"); the command is printed as `--id=-x` now, and runs.
    path = tmp_path / "gateway.db"
    store = f"sqlite:///{path}"
    add = ["routes", "add", "--store", store, "--id=-x", "--prefix", "/x/"]
    assert (await acli(*add, "--upstream", "http://127.0.0.1:9001"))[0] == 0
    with sqlite_db(path) as db:
        db.execute("UPDATE fmw_routes SET doc = replace(doc, '\"/x/\"', '7')")
    status, _, err = await acli("routes", "list", "--store", store)
    assert status == 0 and "(`fallback-mw routes remove --id=-x` takes it out)" in err, err
    status, out, err = await acli("routes", "remove", "--store", store, "--id=-x")
    assert (status, out) == (0, "route '-x' removed\n"), err
    # A local error's remedy names the command the same way.
    async with upstream(status_handler(503)) as failing:
        conf = {
            "upstreams": {"-u": {"url": failing.url}},
            "routes": [{"id": "-r", "prefix": "/v1/", "plan": ["-u"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                message = (await client.get("/v1/x")).json()["error"]["message"]
        finally:
            await gateway.aclose()
    assert "routes set-fallback --id=-r --upstream URL" in message, message


@pytest.mark.anyio
async def test_capacity_leaves_out_a_usage_record_whose_time_is_no_time(tmp_path: Path) -> None:
    # SQLite keeps `at` as text: a record written by hand with `at = 'garbage'` (which
    # sorts after every date, so `--since` kept it) made `capacity` end in "unexpected
    # internal error (TypeError)" when it held the peak. It is left out; the peak is the
    # other records'.
    from tests.test_capacity_cli import seed, write_config

    path = tmp_path / "gateway.db"
    store = f"sqlite:///{path}"
    await seed(store)
    with sqlite_db(path) as db:
        db.execute(
            "INSERT INTO fmw_usage (at, request_id, route, tenant, candidates, attempts, "
            "input_tokens) VALUES ('garbage', 'g', 'chat', 't', '[]', '[\"x\"]', 9000000)"
        )
    config = str(write_config(tmp_path, store))
    status, out, err = await acli("capacity", "--config", config, "--since", "7d")
    assert status == 1 and "cannot carry the peak" in err, err
    chat = next(line for line in out.splitlines() if line.startswith("chat "))
    assert chat.split()[:4] == ["chat", "primary", "11", "1,100,000"]


@pytest.mark.anyio
async def test_a_schema_version_no_version_writes_is_named_not_an_internal_error(
    ledger_store: str,
) -> None:
    # `fmw_schema` edited by hand: a negative version made every verb (and a gateway's
    # start) end in "unexpected internal error (IndexError / KeyError)", text in SQLite one
    # of ValueError. Now the store is refused naming the row to restore.
    import asyncpg

    store = ledger_store  # a SQLite file, then a fresh PostgreSQL database
    add = ["routes", "add", "--store", store, "--id", "chat", "--prefix", "/v1/"]
    assert (await acli(*add, "--upstream", "http://127.0.0.1:9001"))[0] == 0
    assert (await acli("budgets", "set", "--store", store, "--budget", "b", "--limit", "1"))[0] == 0
    edits = [("routes", -5), ("ledger", -1)]
    if store.startswith("sqlite:"):
        edits += [("routes", "abc"), ("ledger", "2.5")]
    for component, version in edits:
        if store.startswith("sqlite:"):
            with sqlite_db(store.removeprefix("sqlite:///")) as db:
                db.execute("UPDATE fmw_schema SET version = ? WHERE component = ?",
                           (version, component))  # fmt: skip
        else:
            conn = await asyncpg.connect(store)
            try:
                await conn.execute(
                    "UPDATE fmw_schema SET version = $1 WHERE component = $2", version, component
                )
            finally:
                await conn.close()
        verb = ["routes", "list"] if component == "routes" else ["budgets", "show"]
        status, _, err = await acli(*verb, "--store", store)
        assert status == 1, err
        assert f"schema version reads '{version}', which no fallback_mw writes" in err, err
        assert "restore its row in the fmw_schema table" in err
        gateway = Gateway(host_app, config=gateway_config(store))  # refuses, as it says
        assert "restore its row in the fmw_schema table" in str(gateway.config_error)
        await gateway.aclose()
        restore = 1 if component == "routes" else LATEST_VERSION
        if store.startswith("sqlite:"):
            with sqlite_db(store.removeprefix("sqlite:///")) as db:
                db.execute("UPDATE fmw_schema SET version = ? WHERE component = ?",
                           (restore, component))  # fmt: skip
        else:
            conn = await asyncpg.connect(store)
            try:
                await conn.execute(
                    "UPDATE fmw_schema SET version = $1 WHERE component = $2", restore, component
                )
            finally:
                await conn.close()


@pytest.mark.anyio
async def test_a_change_counter_edited_to_text_stops_no_gateway(tmp_path: Path) -> None:
    # The SQLite store's change counters edited to text (by hand, a script) stopped a
    # gateway at its start ("unexpected internal error (ValueError)"), and a running one's
    # reloads, routes and faults, as "route store unreachable". Read as the triggers'
    # arithmetic reads them, the next change moves them on and is picked up.
    path = tmp_path / "gateway.db"
    store = f"sqlite:///{path}"
    async with upstream(status_handler(200, b"one")) as one:
        add = ["routes", "add", "--store", store, "--upstream", one.url, "--prefix"]
        assert (await acli(*add, "/one/", "--id", "one"))[0] == 0
        with sqlite_db(path) as db:
            db.execute("UPDATE fmw_route_changes SET serial = 'edited'")
        gateway = Gateway(host_app, config=gateway_config(store))
        assert gateway.config_error is None, gateway.config_error
        runtime = gateway.services.store
        assert runtime is not None
        runtime.poll_interval = 0.05
        try:
            async with client_for(gateway) as client:
                assert (await client.get("/one/x")).text == "one"
                assert (await acli(*add, "/two/", "--id", "two"))[0] == 0

                async def two() -> str:
                    return (await client.get("/two/x")).text

                assert await wait_for(two, "one")
        finally:
            await gateway.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("edited", [1e300, 2**63 - 1])
async def test_a_change_counter_edited_past_counting_is_reset_and_stops_no_reload(
    tmp_path: Path, edited: float, caplog: pytest.LogCaptureFixture
) -> None:
    # A counter edited to 1e300 (or to SQLite's largest integer) never moved again: the
    # triggers' `serial + 1` is 1e300 in floating point, and the largest integer plus one
    # overflows to a float that reads back as the same largest integer. Every gateway
    # stopped picking up route and fault changes, silently. It is restarted below the cap
    # (one log line), and the next change is picked up.
    path = tmp_path / "gateway.db"
    store = f"sqlite:///{path}"
    async with upstream(status_handler(200, b"one")) as one:
        add = ["routes", "add", "--store", store, "--upstream", one.url, "--prefix"]
        assert (await acli(*add, "/one/", "--id", "one"))[0] == 0
        gateway = Gateway(host_app, config=gateway_config(store))
        runtime = gateway.services.store
        assert runtime is not None
        runtime.poll_interval = 0.05
        try:
            async with client_for(gateway) as client:
                assert (await client.get("/one/x")).text == "one"
                with sqlite_db(path) as db:
                    db.execute("UPDATE fmw_route_changes SET serial = ?", (edited,))
                await asyncio.sleep(0.3)  # a few polls read it
                assert (await acli(*add, "/two/", "--id", "two"))[0] == 0

                async def two() -> str:
                    return (await client.get("/two/x")).text

                assert await wait_for(two, "one")
        finally:
            await gateway.aclose()
    with sqlite_db(path) as db:
        serials = dict(db.execute("SELECT name, serial FROM fmw_route_changes").fetchall())
    assert all(isinstance(v, int) and 0 < v < 2**62 for v in serials.values()), serials
    reset = [r.getMessage() for r in caplog.records if "change counter" in r.getMessage()]
    assert reset and len(reset) <= 2, reset  # once per counter at most


@pytest.mark.anyio
async def test_a_change_made_while_the_counter_was_stuck_reaches_a_gateway_that_saw_0(
    tmp_path: Path,
) -> None:
    # A stuck counter was set back to 0: a gateway that last saw 0 took the reset for "no
    # change" and never picked up what changed while the counter was stuck (here: route one
    # removed in the same transaction that edited the counter past counting). It restarts
    # at a value no gateway has seen, so every gateway reloads.
    path = tmp_path / "gateway.db"
    store = f"sqlite:///{path}"
    async with upstream(status_handler(200, b"one")) as one:
        add = ["routes", "add", "--store", store, "--upstream", one.url, "--prefix"]
        assert (await acli(*add, "/one/", "--id", "one"))[0] == 0
        with sqlite_db(path) as db:
            db.execute("UPDATE fmw_route_changes SET serial = 0")
        gateway = Gateway(host_app, config=gateway_config(store))
        runtime = gateway.services.store
        assert runtime is not None
        runtime.poll_interval = 0.05
        try:
            async with client_for(gateway) as client:
                assert (await client.get("/one/x")).text == "one"
                with sqlite_db(path) as db:
                    db.execute("UPDATE fmw_route_changes SET serial = 1e300")
                    db.execute("DELETE FROM fmw_routes WHERE id = 'one'")

                async def removed() -> bool:
                    return (await client.get("/one/x")).text != "one"

                assert await wait_for(removed, True, within=5.0)
        finally:
            await gateway.aclose()


@pytest.mark.anyio
async def test_a_stale_hold_edited_by_hand_is_no_bare_500(tmp_path: Path) -> None:
    # A hold left in the SQLite ledger with an amount edited to text failed the ledger's
    # opening (its stale holds are settled then): every budgeted request answered a bare
    # 500 with a traceback, and `budgets show` an internal error. The amount is read as
    # SQLite's own arithmetic reads it.
    path = tmp_path / "gateway.db"
    store = f"sqlite:///{path}"
    budget = ["budgets", "set", "--store", store, "--budget", "acme", "--limit", "10"]
    assert (await acli(*budget))[0] == 0
    with sqlite_db(path) as db:
        db.execute(
            "INSERT INTO fmw_budget_holds VALUES "
            "('h1', 'acme', '2026-12', 'abc', '2000-01-01T00:00:00.000000Z')"
        )
    status, out, err = await acli("budgets", "show", "--store", store)
    assert status == 0 and out.startswith("BUDGET"), err
    async with upstream(status_handler(200, b"served")) as primary:
        conf = gateway_config(
            store,
            upstreams={"primary": {"url": primary.url}},
            routes=[{"id": "r", "prefix": "/v1/", "plan": ["primary"], "budget": "acme"}],
        )
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.get("/v1/x")
                assert (response.status_code, response.text) == (200, "served")
        finally:
            await gateway.aclose()


def test_a_name_of_megabytes_is_quoted_by_its_start(tmp_path: Path) -> None:
    # A key or a plan name of megabytes in a hand-written store record (or a file) was
    # quoted whole: `routes list`'s warning, `check`'s error and every gateway's reload
    # log line were megabytes long. It is quoted by its start and its length.
    path = tmp_path / "gateway.db"
    store = f"sqlite:///{path}"
    huge = "k" * 1_000_000
    add = ["routes", "add", "--store", store, "--upstream", "http://127.0.0.1:9001"]
    assert cli(*add, "--id", "a", "--prefix", "/a/")[0] == 0
    with sqlite_db(path) as db:
        (doc,) = db.execute("SELECT doc FROM fmw_routes").fetchone()
        db.execute(
            "UPDATE fmw_routes SET doc = ?", (doc.replace('"plan"', f'"{huge}": 1, "plan"'),)
        )
    status, _, err = cli("routes", "list", "--store", store)
    assert status == 0 and len(err) < 400, err[:400]
    assert f"unknown key '{'k' * 60}...(1000000 characters)'" in err
    with sqlite_db(path) as db:
        db.execute("UPDATE fmw_routes SET doc = ?", (doc.replace('a-primary"]', f'{huge}"]'),))
    status, _, err = cli("routes", "list", "--store", store)
    assert status == 0 and len(err) < 600, err[:600]
    assert "unknown upstream 'kkk" in err and "...(1000000 characters)'" in err
    config = tmp_path / "gateway.toml"
    config.write_text(f"[gateway]\n{huge} = 1\n", encoding="utf-8")
    status, _, err = cli("check", "--config", str(config))
    assert status == 2 and len(err) < 400, err[:400]


@pytest.mark.anyio
async def test_a_hold_edited_up_never_leaves_the_budget_unlimited(ledger_store: str) -> None:
    # A hold whose amount was edited up (by hand, a script) was taken off the window's held
    # amount when the reaper settled it, leaving that far below 0: every later hold fitted
    # under the limit whatever the spend, and the budget refused nothing for the rest of
    # its window. Held never goes below 0: the settled amount (capped) refuses now.
    import asyncpg

    store = ledger_store  # a SQLite file, then a fresh PostgreSQL database
    budget = ["budgets", "set", "--store", store, "--budget", "acme", "--limit", "10"]
    assert (await acli(*budget))[0] == 0
    status, out, err = await acli("budgets", "show", "--store", store)
    assert status == 0, err
    period = out.splitlines()[1].split()[2]
    rows = [
        ("INSERT INTO fmw_budget_windows VALUES ({}, {}, 0, 10000)", ("acme", period)),
        (
            "INSERT INTO fmw_budget_holds VALUES ({}, {}, {}, 9000000000000000000, {})",
            ("h1", "acme", period, "2000-01-01T00:00:00.000000Z"),
        ),
    ]
    if store.startswith("sqlite:"):
        with sqlite_db(store.removeprefix("sqlite:///")) as db:
            for sql, values in rows:
                db.execute(sql.format(*"?" * len(values)), values)
    else:
        conn = await asyncpg.connect(store)
        try:
            for sql, values in rows:
                marks = [f"${i}" for i in range(1, len(values) + 1)]
                if len(values) == 4:
                    marks[3] = "$4::timestamptz"
                    values = (*values[:3], datetime.fromisoformat("2000-01-01T00:00:00+00:00"))
                await conn.execute(sql.format(*marks), *values)
        finally:
            await conn.close()
    async with upstream(status_handler(200, b"served")) as primary:
        conf = gateway_config(
            store,
            upstreams={"primary": {"url": primary.url}},
            routes=[{"id": "r", "prefix": "/v1/", "plan": ["primary"], "budget": "acme"}],
        )
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                codes = [(await client.get("/v1/x")).status_code for _ in range(3)]
        finally:
            await gateway.aclose()
    assert codes == [402, 402, 402]
    assert primary.count == 0


def test_a_route_key_or_upstream_key_of_megabytes_is_quoted_by_its_start(tmp_path: Path) -> None:
    # The record's key (its id column, written by hand or by a script), or an upstream's
    # key inside it, of megabytes was quoted whole: `routes list`'s warning was megabytes
    # long, and so was every gateway's reload log line, at every reload. It is quoted by
    # its start and its length.
    path = tmp_path / "gateway.db"
    store = f"sqlite:///{path}"
    add = ["routes", "add", "--store", store, "--upstream", "http://127.0.0.1:9001"]
    assert cli(*add, "--id", "a", "--prefix", "/a/")[0] == 0
    with sqlite_db(path) as db:
        db.execute("UPDATE fmw_routes SET id = ?", ("k" * 1_000_000,))
    status, _, err = cli("routes", "list", "--store", store)
    assert status == 0 and len(err) < 600, err[:600]
    assert f"stored route '{'k' * 60}...(1000000 characters)'" in err
    assert "its record holds route 'a'" in err
    with sqlite_db(path) as db:  # and an upstream's key in the record
        db.execute("UPDATE fmw_routes SET id = 'a'")
        (doc,) = db.execute("SELECT doc FROM fmw_routes").fetchone()
        db.execute(
            "UPDATE fmw_routes SET doc = ?",
            (
                doc.replace(
                    '"upstreams": {', f'"upstreams": {{"{"k" * 1_000_000}": {{"url": 5}}, ', 1
                ),
            ),
        )
    status, _, err = cli("routes", "list", "--store", store)
    assert status == 0 and len(err) < 600, err[:600]
    assert f"stored route 'a', upstream '{'k' * 60}...(1000000 characters)'" in err
