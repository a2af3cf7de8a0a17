"""The PostgreSQL route store on the real local server: LISTEN/NOTIFY hot reload seen by two
gateways sharing the store."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from fallback_mw import Gateway
from fallback_mw.store.model import Fault
from fallback_mw.store.postgres import PostgresStore
from tests.helpers import client_for
from tests.test_cli_admin import cli, failing_chat_route, gateway_config, host_app
from tests.upstreams import free_port, status_handler, upstream


async def _probe(client: httpx.AsyncClient) -> str:
    response = await client.get("/api/x")
    if response.status_code == 502:
        return "primary-only"
    return response.headers.get("x-gateway-provider", "?")


async def _until(clients: list[httpx.AsyncClient], expected: str, within: float) -> float:
    """Seconds until every client sees `expected`; fails after `within`."""
    started = time.monotonic()
    pending = list(clients)
    while pending:
        pending = [c for c in pending if await _probe(c) != expected]
        if time.monotonic() - started > within:
            pytest.fail(f"{len(pending)} gateway(s) did not see {expected!r} within {within} s")
        if pending:
            await asyncio.sleep(0.02)
    return time.monotonic() - started


@pytest.mark.anyio
async def test_set_and_clear_fallback_reach_two_running_gateways(pg_url: str) -> None:
    async with failing_chat_route(pg_url) as (base, backup):
        gateways = [Gateway(host_app, config=gateway_config(pg_url), environ={}) for _ in range(2)]
        for gateway in gateways:
            # Only NOTIFY can make these fast: the safety-net poll is slower than the bound.
            assert gateway.services.store is not None
            gateway.services.store.poll_interval = 30.0
        clients = [client_for(g) for g in gateways]
        try:
            assert [await _probe(c) for c in clients] == ["primary-only"] * 2
            await asyncio.sleep(0.2)  # both reloaders are LISTENing
            status, _, err = await cli("routes", "set-fallback", *base, "--upstream", backup.url)
            assert status == 0, err
            took_set = await _until(clients, "chat-fallback", within=5.0)
            assert (await cli("routes", "clear-fallback", *base))[0] == 0
            took_clear = await _until(clients, "primary-only", within=5.0)
        finally:
            for client in clients:
                await client.aclose()
            for gateway in gateways:
                await gateway.aclose()
    assert took_set < 5.0 and took_clear < 5.0
    print(f"set-fallback seen by both in {took_set:.3f} s, clear-fallback in {took_clear:.3f} s")


@pytest.mark.anyio
async def test_schema_is_versioned_and_trigger_notifies(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    try:
        before = await store.change_serials()
        await store.set_fault(Fault(kind="fail", target="primary", expires_at=time.time() + 60))
        after = await store.change_serials()
        assert after[0] == before[0] and after[1] > before[1]
        assert [f.target for f in await store.load_faults()] == ["primary"]
    finally:
        await store.aclose()
    conn: Any = await asyncpg.connect(pg_url)
    try:
        assert await conn.fetchval("SELECT version FROM fmw_schema WHERE component = 'routes'") == 1
        # A write by any client (not only this package) is announced on the channel.
        notified: asyncio.Queue[str] = asyncio.Queue()
        listener: Any = await asyncpg.connect(pg_url)
        await listener.add_listener(
            "fmw_route_changes", lambda *args: notified.put_nowait(str(args[-1]))
        )
        await conn.execute("DELETE FROM fmw_faults")
        assert await asyncio.wait_for(notified.get(), 5) == "faults"
        await listener.close()
        # Migrating again (another process starting) is a no-op.
        second = PostgresStore(pg_url)
        await second.load_routes()
        await second.aclose()
        assert await conn.fetchval("SELECT count(*) FROM fmw_schema") >= 1
    finally:
        await conn.close()


@pytest.mark.anyio
async def test_a_separate_serve_process_sees_the_change(pg_url: str, tmp_path: Path) -> None:
    async with failing_chat_route(pg_url) as (base, backup):
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[gateway]\nstore = "{pg_url}"\n[gateway.breaker]\nmin_calls = 1000000\n',
            encoding="utf-8",
        )
        port = free_port()
        process = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "fallback-mw"), "serve", "--config", str(config),
            "--port", str(port),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                started = time.monotonic()
                while True:
                    try:
                        assert await _probe(client) == "primary-only"
                        break
                    except httpx.TransportError:
                        assert time.monotonic() - started < 20, "serve did not start"
                        await asyncio.sleep(0.1)
                status, _, err = await cli(
                    "routes", "set-fallback", *base, "--upstream", backup.url
                )
                assert status == 0, err
                took = await _until([client], "chat-fallback", within=5.0)
        finally:
            if process.returncode is None:
                process.terminate()
            await process.wait()
    assert took < 5.0


@pytest.mark.anyio
async def test_a_store_the_server_refuses_is_named_in_the_servers_words(pg_url: str) -> None:
    """A misspelt database or role reached the server, which said which: the command line
    said only the driver's class name ('cannot reach the store ...: InvalidCatalogNameError'),
    a word a newcomer cannot act on. The server's reason names the database or role (never
    a password, which it does not know to quote)."""
    base, _, _ = pg_url.rpartition("/")
    missing_db = f"{base}/fxad_no_such_db"
    status, _, err = await cli("routes", "list", "--store", missing_db)
    assert status == 1, err
    assert 'database "fxad_no_such_db" does not exist' in err, err
    host = base.partition("@")[2]
    missing_role = f"postgresql://fxad_no_such_role:pw-never-shown@{host}/postgres"
    status, _, err = await cli("routes", "list", "--store", missing_role)
    assert status == 1, err
    assert "fxad_no_such_role" in err and "pw-never-shown" not in err, err


@pytest.mark.anyio
async def test_a_store_that_cannot_be_reached_says_why() -> None:
    """A host name that does not resolve, or a port nothing listens on, was said as the
    driver's class name alone ('cannot reach the store ...: gaierror'). The reason comes
    with it now, naming the address tried, never the URL's password."""
    port = free_port()
    refused = f"postgresql://gw:pw-never-shown@127.0.0.1:{port}/gw"
    status, _, err = await cli("routes", "list", "--store", refused)
    assert status == 1, err
    assert f"cannot reach the store postgresql://gw@127.0.0.1:{port}/gw: " in err, err
    assert f"Connect call failed ('127.0.0.1', {port})" in err and "pw-never-shown" not in err
    unknown = "postgresql://gw:pw-never-shown@no-such-host.invalid:5432/gw"
    status, _, err = await cli("routes", "list", "--store", unknown)
    assert status == 1, err
    assert "gaierror: " in err and "pw-never-shown" not in err, err


SIZING = Path(__file__).resolve().parent.parent / "docs" / "performance.md"


@pytest.mark.anyio
async def test_a_gateway_process_holds_no_more_postgresql_connections_than_the_sizing_says(
    pg_url: str,
) -> None:
    # A platform team sets PostgreSQL's max_connections from docs/performance.md's "Sizing a
    # deployment" before running `serve --workers N` on several hosts. It said nothing of
    # PostgreSQL connections; a worker holds the ledger's pool and the route store's
    # connections, 12 at peak (a default server's 100 is full at 8 workers).
    sizing = SIZING.read_text(encoding="utf-8").split("### Sizing a deployment", 1)[1]
    sizing = sizing.split("\n### ", 1)[0]
    stated = re.search(r"holds up to (\d+) PostgreSQL connections", sizing)
    assert stated is not None, "the sizing section does not say how many PostgreSQL connections"
    database = pg_url.rsplit("/", 1)[1]
    usage = b'{"usage": {"prompt_tokens": 10, "completion_tokens": 10}}'
    async with upstream(status_handler(200, usage, delay=0.05)) as primary:
        config = {
            "gateway": {"store": pg_url},
            "upstreams": {"primary": {"url": primary.url}},
            "budgets": {"acme": {"limit": 100.0, "default_hold": 0.01}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"], "budget": "acme"}],
        }
        gateway = Gateway(host_app, config=config, environ={})
        admin = await asyncpg.connect(pg_url.rsplit("/", 1)[0] + "/postgres")
        try:
            async with client_for(gateway) as client:
                peak = 0

                async def watch() -> None:
                    nonlocal peak
                    while True:
                        held = await admin.fetchval(
                            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1", database
                        )
                        peak = max(peak, held)
                        await asyncio.sleep(0.01)

                watcher = asyncio.create_task(watch())
                responses = await asyncio.gather(*(client.get("/v1/x") for _ in range(60)))
                watcher.cancel()
                assert all(r.status_code == 200 for r in responses)
            assert 2 < peak <= int(stated.group(1)), peak
        finally:
            await admin.close()
            await gateway.aclose()


@pytest.mark.anyio
async def test_a_store_connection_gone_silent_does_not_stop_the_reloads(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The database moved (a failover to another host, a NAT or firewall that forgot the
    # flow): the gateway's store connections get no answer and no reset, new ones work. A
    # reload query without a time limit waited on it for good (the kernel gives up after
    # some 15 minutes): `set-fallback`, `faults clear`, a new route never reached that
    # gateway, while `routes list` and every other gateway showed them.
    from urllib.parse import urlsplit

    from tests.tcp_proxy import tcp_proxy

    real = urlsplit(pg_url)
    assert real.hostname is not None and real.port is not None
    async with (
        tcp_proxy(real.hostname, real.port) as proxy,
        failing_chat_route(pg_url) as (base, backup),
    ):
        proxied = real._replace(netloc=f"{real.username}@127.0.0.1:{proxy.port}").geturl()
        # Its first load blocks: off this loop, which runs the proxy.
        config = gateway_config(proxied)
        gateway = await asyncio.to_thread(lambda: Gateway(host_app, config=config, environ={}))
        try:
            async with client_for(gateway) as client:
                assert await _probe(client) == "primary-only"
                await asyncio.sleep(0.3)  # the reloader waits on its LISTEN, queries done
                proxy.strand()
                edit = ("routes", "set-fallback", *base, "--upstream", backup.url)
                status, _, err = await cli(*edit)
                assert status == 0, err
                # The store's own timeout (5 s), a fresh connection, the reload: well inside.
                took = await _until([client], "chat-fallback", within=20.0)
        finally:
            await gateway.aclose()
    assert "did not answer within 5 s" in caplog.text, caplog.text  # the outage, said once
    print(f"set-fallback seen through a silent connection's replacement in {took:.1f} s")


@pytest.mark.anyio
async def test_a_listen_the_database_refuses_leaves_no_connection_open(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A LISTEN refused (a hot standby refuses it, as a pooler in transaction mode does):
    # the store polls instead, and the connection it opened for LISTEN was set aside
    # unclosed, one per reload cycle that tried again.
    async def refused(self: Any, channel: str, callback: Any) -> None:
        raise asyncpg.exceptions.FeatureNotSupportedError("cannot execute LISTEN")

    monkeypatch.setattr(asyncpg.connection.Connection, "add_listener", refused)
    store = PostgresStore(pg_url)
    opened: list[Any] = []
    connect = store._connect

    async def recorded() -> Any:
        conn = await connect()
        opened.append(conn)
        return conn

    monkeypatch.setattr(store, "_connect", recorded)
    try:
        await asyncio.wait_for(store.wait_for_change(0.05), 5)  # polls: returns
        listeners = opened[1:]  # the first is the store's own connection
        assert listeners, "no LISTEN was tried"
        assert all(conn.is_closed() for conn in listeners)
    finally:
        await store.aclose()
