"""Game-day faults kept in the store: fail (no packet leaves), hang, pin; expiry; telemetry."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fallback_mw import Gateway
from fallback_mw.store.faults import FaultSnapshot, StoreFaults
from fallback_mw.store.model import Fault
from fallback_mw.telemetry import Telemetry
from tests.helpers import client_for, sqlite_db
from tests.test_cli_admin import cli, expires_at, gateway_config, host_app
from tests.upstreams import Upstream, status_handler, upstream


def config(store: str, primary: str, backup: str, **route: Any) -> dict[str, Any]:
    return gateway_config(
        store,
        upstreams={
            "primary": {"url": primary, "first_byte_timeout_ms": 300},
            "backup": {"url": backup},
        },
        routes=[
            {"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1, **route}
        ],
    )


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Upstream, Upstream]]:
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        yield primary, backup


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'faults.db'}"


async def get(gateway: Gateway, path: str = "/v1/chat") -> httpx.Response:
    async with client_for(gateway) as client:
        return await client.get(path)


@pytest.mark.slow
@pytest.mark.anyio
async def test_fail_fault_sends_no_packet_and_expires_on_time(
    store_url: str, pair: tuple[Upstream, Upstream]
) -> None:
    primary, backup = pair
    # A TTL long enough for a loaded machine to make three requests inside it; every wait
    # below is measured from the expiry the CLI printed (the one it stored).
    status, out, err = await cli(
        "faults", "set", "fail", "--store", store_url, "--upstream", "primary", "--ttl", "5"
    )
    assert status == 0, err
    expiry = expires_at(out)
    gateway = Gateway(host_app, config=config(store_url, primary.url, backup.url), environ={})
    try:
        during = []
        for _ in range(3):
            # Only while the fault surely holds for the whole request: a request that
            # straddles the expiry could meet either side of it.
            if expiry - time.time() < 1.5:
                break
            response = await get(gateway)
            assert time.time() < expiry, "a request took over 1.5 s"
            during.append(response)
        assert during, "the fault expired before a single request could be made"
        assert primary.count == 0  # not one packet reached the primary
        for response in during:
            assert response.status_code == 200 and response.text == "backup"
            assert response.headers["x-gateway-fault"] == "1"
            assert response.headers["x-gateway-provider"] == "backup"
            assert response.headers["x-gateway-attempts"] == "2"
        # The gateway compares the stored expiry with its own clock on every request.
        await asyncio.sleep(max(expiry + 0.05 - time.time(), 0))
        after = await get(gateway)
    finally:
        await gateway.aclose()
    assert after.text == "primary" and "x-gateway-fault" not in after.headers
    assert primary.count == 1


@pytest.mark.anyio
async def test_fault_set_while_running_is_picked_up_and_cleared_by_one_command(
    store_url: str, pair: tuple[Upstream, Upstream]
) -> None:
    primary, backup = pair
    gateway = Gateway(host_app, config=config(store_url, primary.url, backup.url), environ={})
    assert gateway.services.store is not None
    gateway.services.store.poll_interval = 0.05
    try:
        assert (await get(gateway)).text == "primary"
        await cli(
            "faults", "set", "fail", "--store", store_url, "--upstream", "primary", "--ttl", "60"
        )
        deadline = time.monotonic() + 15  # generous: a loaded machine, returns early
        while (await get(gateway)).text != "backup":
            assert time.monotonic() < deadline, "fault not picked up"
            await asyncio.sleep(0.02)
        count = primary.count
        assert (await get(gateway)).headers["x-gateway-fault"] == "1"
        assert primary.count == count
        assert (await cli("faults", "clear", "--store", store_url, "--all"))[0] == 0
        deadline = time.monotonic() + 15  # generous: a loaded machine, returns early
        while (await get(gateway)).text != "primary":
            assert time.monotonic() < deadline, "clear not picked up"
            await asyncio.sleep(0.02)
    finally:
        await gateway.aclose()


@pytest.mark.anyio
async def test_a_hang_fault_cut_by_the_deadline_names_the_timeout_to_lower(
    store_url: str, pair: tuple[Upstream, Upstream]
) -> None:
    # The game day the docs warn about: a hang longer than the deadline gives 504, not a
    # fallback. The 504 must say which setting would change that (SPEC §12).
    primary, backup = pair
    await cli("faults", "set", "hang", "--store", store_url, "--upstream", "primary", "--ttl", "60")
    gateway = Gateway(
        host_app, config=config(store_url, primary.url, backup.url, deadline_ms=150), environ={}
    )
    try:
        response = await get(gateway)
    finally:
        await gateway.aclose()
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (504, "deadline_exceeded")
    assert "'primary' was still inside its first_byte_timeout_ms (300 ms)" in error["message"]
    assert backup.count == 0


@pytest.mark.anyio
async def test_hang_fault_waits_for_the_first_byte_timeout_then_fails_over(
    store_url: str, pair: tuple[Upstream, Upstream]
) -> None:
    primary, backup = pair
    await cli("faults", "set", "hang", "--store", store_url, "--upstream", "primary", "--ttl", "60")
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    gateway = Gateway(
        host_app,
        config=config(store_url, primary.url, backup.url),
        environ={},
        telemetry=Telemetry(tracer_provider=provider),
    )
    try:
        started = time.monotonic()
        response = await get(gateway)
        took = time.monotonic() - started
    finally:
        await gateway.aclose()
    assert response.text == "backup" and response.headers["x-gateway-fault"] == "1"
    # It waited the primary's first_byte_timeout_ms (300) and then failed over, well
    # inside the route's 5 s deadline (a 504 otherwise): no upper bound on a busy machine.
    assert took >= 0.3
    assert primary.count == 0
    spans = exporter.get_finished_spans()
    provider.shutdown()
    attempts = [s for s in spans if s.name == "gateway.attempt"]
    kinds = {(s.attributes or {}).get("gateway.candidate"): s.attributes for s in attempts}
    assert (kinds["primary"] or {}).get("gateway.failure.kind") == "fault"


@pytest.mark.anyio
async def test_pin_puts_the_named_candidate_at_the_head(
    store_url: str, pair: tuple[Upstream, Upstream]
) -> None:
    primary, backup = pair
    status, _, err = await cli(
        "faults", "set", "pin", "--store", store_url, "--route", "chat", "--candidate", "backup",
        "--ttl", "60",
    )  # fmt: skip
    assert status == 0, err
    gateway = Gateway(
        host_app,
        config=config(store_url, primary.url, backup.url, canary_eligible=True, canary_percent=100),
        environ={},
    )
    try:
        response = await get(gateway)
    finally:
        await gateway.aclose()
    assert response.text == "backup"
    assert response.headers["x-gateway-provider"] == "backup"
    assert response.headers["x-gateway-attempts"] == "1"
    assert "x-gateway-canary" not in response.headers  # a pin is not canary traffic
    assert primary.count == 0


def test_snapshot_expiry_is_checked_at_lookup() -> None:
    snapshot = FaultSnapshot(
        [
            Fault(kind="fail", target="a", expires_at=100.0),
            Fault(kind="pin", target="chat", expires_at=100.0, candidate="b"),
        ]
    )
    assert snapshot.upstream_fault("a", now=99.9) == "fail"
    assert snapshot.upstream_fault("a", now=100.0) is None
    assert snapshot.upstream_fault("other", now=0) is None
    assert snapshot.pinned_candidate("chat", now=99.0) == "b"
    assert snapshot.pinned_candidate("chat", now=100.1) is None


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'faults.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.mark.anyio
async def test_faults_set_refuses_an_active_fault_on_the_same_target_unless_replace(
    any_store: str,
) -> None:
    """SPEC §12: a second `faults set` on a target with an active fault stores nothing and
    says which fault holds it; `--replace` replaces it; another target is independent."""
    first = await cli(
        "faults", "set", "hang", "--store", any_store, "--upstream", "p", "--ttl", "60"
    )
    assert first[0] == 0, first[2]
    expiry = expires_at(first[1])
    status, out, err = await cli(
        "faults", "set", "fail", "--store", any_store, "--upstream", "p", "--ttl", "30"
    )
    assert status == 2 and out == ""
    assert "a hang fault is already active on upstream 'p'" in err and "--replace" in err
    listed = (await cli("faults", "list", "--store", any_store))[1]
    assert listed.startswith("hang\tupstream=p") and expires_at(listed) == expiry
    # A different target, and a pin on a route of the same name, are other targets.
    other = await cli(
        "faults", "set", "revoke", "--store", any_store, "--upstream", "q", "--ttl", "5"
    )
    assert other[0] == 0, other[2]
    pin = await cli(
        "faults", "set", "pin", "--store", any_store, "--route", "p", "--candidate", "b",
        "--ttl", "5",
    )  # fmt: skip
    assert pin[0] == 0, pin[2]
    replaced = await cli(
        "faults", "set", "blackhole", "--store", any_store, "--upstream", "p", "--ttl", "30",
        "--replace",
    )  # fmt: skip
    assert replaced[0] == 0, replaced[2]
    listed = (await cli("faults", "list", "--store", any_store))[1]
    assert "blackhole\tupstream=p" in listed and "hang" not in listed
    assert "revoke\tupstream=q" in listed


@pytest.mark.anyio
async def test_faults_set_is_atomic_under_concurrent_setters(any_store: str) -> None:
    """Eight processes' worth of `set` racing for one free target: exactly one wins (the
    check and the write are one statement / one transaction)."""
    from fallback_mw.store.routes import open_store

    stores = [open_store(any_store) for _ in range(8)]
    try:
        await stores[0].load_faults()  # migrate once, before the race
        now = time.time()
        results = await asyncio.gather(
            *(
                store.set_fault(Fault("fail", "racy", now + 60 + i))
                for i, store in enumerate(stores)
            )
        )
        assert sum(1 for r in results if r is None) == 1
        winner = next(i for i, r in enumerate(results) if r is None)
        assert all(r is not None and r.expires_at == now + 60 + winner for r in results if r)
        assert [f.expires_at for f in await stores[0].load_faults()] == [now + 60 + winner]
        # An expired fault does not hold its target.
        assert await stores[1].set_fault(Fault("fail", "old", now - 1)) is None
        assert await stores[2].set_fault(Fault("hang", "old", now + 30)) is None
    finally:
        for store in stores:
            await store.aclose()


def _spans_by_candidate(exporter: InMemorySpanExporter) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for span in exporter.get_finished_spans():
        if span.name == "gateway.attempt":
            attributes = dict(span.attributes or {})
            found.setdefault(str(attributes.get("gateway.candidate")), []).append(attributes)
    return found


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_blackhole_connects_to_a_silent_listener_and_the_engines_timeout_fires(
    store_url: str, pair: tuple[Upstream, Upstream], engine: str
) -> None:
    """The attempt really connects (to the gateway's own loopback listener, never to the
    upstream) and ends by the engine's first-byte timeout; then the walk fails over."""
    primary, backup = pair
    status, _, err = await cli(
        "faults", "set", "blackhole", "--store", store_url, "--upstream", "primary", "--ttl", "60"
    )
    assert status == 0, err
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    cfg = config(store_url, primary.url, backup.url)
    cfg["gateway"]["engine"] = engine
    # The guard allows only "localhost" here: the blackhole's 127.0.0.1 listener is reached
    # all the same (exempt for this purpose), the upstreams by their allowed name.
    cfg["gateway"]["allow_hosts"] = ["localhost"]
    for upstream_config in cfg["upstreams"].values():
        upstream_config["url"] = upstream_config["url"].replace("127.0.0.1", "localhost")
    gateway = Gateway(
        host_app, config=cfg, environ={}, telemetry=Telemetry(tracer_provider=provider)
    )
    try:
        started = time.monotonic()
        response = await get(gateway)
        took = time.monotonic() - started
        faults = gateway.services.faults
        assert isinstance(faults, StoreFaults)
        accepted = faults.blackhole().connections
    finally:
        await gateway.aclose()
    assert response.text == "backup" and response.headers["x-gateway-fault"] == "1"
    assert took >= 0.3  # the primary's first_byte_timeout_ms
    assert primary.count == 0  # nothing reached the upstream itself
    assert accepted == 1  # one real connection, to the silent listener
    spans = _spans_by_candidate(exporter)
    provider.shutdown()
    assert spans["primary"][0].get("gateway.failure.kind") == "fault"
    assert "http.response.status_code" not in spans["primary"][0]


@pytest.mark.anyio
async def test_revoke_answers_401_retires_each_pool_credential_and_moves_on(
    store_url: str, pair: tuple[Upstream, Upstream]
) -> None:
    """A credential disabled at the vendor: each pool credential gets a synthetic 401 (no
    packet leaves) and is retired, and the pool moves on. As the health rules say, the 401
    of the last credential is relayed (a 401 is not failover-class); from then on the
    primary has no usable credential and is skipped: the backup serves at once."""
    primary, backup = pair
    status, _, err = await cli(
        "faults", "set", "revoke", "--store", store_url, "--upstream", "primary", "--ttl", "60"
    )
    assert status == 0, err
    cfg = config(store_url, primary.url, backup.url)
    cfg["upstreams"]["primary"]["auth_env"] = ["FMW_REVOKE_A", "FMW_REVOKE_B"]
    cfg["routes"][0]["retries"] = 2
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    gateway = Gateway(
        host_app,
        config=cfg,
        environ={"FMW_REVOKE_A": "sk-a", "FMW_REVOKE_B": "sk-b"},
        telemetry=Telemetry(tracer_provider=provider),
    )
    try:
        first = await get(gateway)
        second = await get(gateway)
    finally:
        await gateway.aclose()
    assert first.status_code == 401 and first.headers["x-gateway-fault"] == "1"
    assert first.headers["x-gateway-attempts"] == "2"  # one 401 per pool credential
    assert primary.count == 0
    # Both credentials retired: the next request skips the primary without an attempt.
    assert second.text == "backup" and second.headers["x-gateway-attempts"] == "1"
    assert second.headers["x-gateway-provider"] == "backup"
    spans = _spans_by_candidate(exporter)
    provider.shutdown()
    assert [s.get("http.response.status_code") for s in spans["primary"]] == [401, 401]
    assert all(s.get("gateway.failure.kind") == "fault" for s in spans["primary"])


@pytest.mark.anyio
async def test_a_fault_row_written_by_hand_is_skipped_and_named(
    store_url: str, pair: tuple[Upstream, Upstream], caplog: pytest.LogCaptureFixture
) -> None:
    """A row `faults set` never writes (an expiry of 'abc' or 1e400, an unknown kind, a
    target holding an escape sequence) made `faults list` an "unexpected internal error",
    printed the escape raw, and stopped a gateway from starting (its first fault load
    raised). Now no gateway applies such a row: it is skipped, logged, and `faults list`
    names it with the command that removes it; `faults set` replaces it."""

    primary, backup = pair
    assert (await cli("faults", "set", "fail", "--store", store_url, "--upstream", "ok-up",
                      "--ttl", "60"))[0] == 0  # fmt: skip
    rows = [
        ("upstream", "primary", "fail", None, "abc"),
        ("upstream", "p2", "fail", None, 1e400),
        ("upstream", "p3", "explode", None, 9e9),
        ("upstream", "\nx\x1b[2J", "fail", None, 9e9),
        ("route", "chat", "pin", None, 9e9),
    ]
    with sqlite_db(store_url.removeprefix("sqlite:///")) as conn:
        conn.executemany("INSERT INTO fmw_faults VALUES (?, ?, ?, ?, ?)", rows)
    status, out, err = await cli("faults", "list", "--store", store_url)
    assert status == 0, err
    assert out.startswith("fail\tupstream=ok-up\tuntil ") and out.count("\n") == 1
    assert "5 fault row(s) in the store are no fault `faults set` writes" in err
    assert "'explode' on 'p3'" in err and "'\\nx\\x1b[2J'" in err and "\x1b" not in err
    assert "faults clear --all" in err
    gateway = Gateway(host_app, config=config(store_url, primary.url, backup.url))
    try:
        assert gateway.config_error is None
        response = await get(gateway)
        assert response.status_code == 200 and response.text == "primary"
        assert "fault rows skipped" in caplog.text and "'fail' on 'primary'" in caplog.text
    finally:
        await gateway.aclose()
    status, _, err = await cli(
        "faults", "set", "hang", "--store", store_url, "--upstream", "primary", "--ttl", "60"
    )
    assert status == 0, err
    listed = (await cli("faults", "list", "--store", store_url))[1]
    assert "hang\tupstream=primary" in listed


@pytest.mark.anyio
async def test_a_fault_row_expiring_past_what_faults_set_writes_is_not_applied(
    any_store: str, pair: tuple[Upstream, Upstream], caplog: pytest.LogCaptureFixture
) -> None:
    """A row written by hand to expire years ahead (`faults set` stores 7 days at most, a
    game day 24 hours) was applied as written: the upstream failed for years, on every
    gateway, surviving restarts. It is skipped and named like any row `faults set` does not
    write; one within the limit is applied as before."""
    primary, backup = pair
    now = time.time()
    rows = [
        ("upstream", "primary", "fail", None, now + 3 * 365 * 86_400),
        ("upstream", "backup", "fail", None, now + 6 * 86_400),  # within: applied
    ]
    made = ["faults", "set", "fail", "--store", any_store, "--upstream", "other", "--ttl", "60"]
    assert (await cli(*made))[0] == 0  # the store, its tables
    assert (await cli("faults", "clear", "--store", any_store, "--upstream", "other"))[0] == 0
    if any_store.startswith("sqlite:///"):
        with sqlite_db(any_store.removeprefix("sqlite:///")) as conn:
            conn.executemany("INSERT INTO fmw_faults VALUES (?, ?, ?, ?, ?)", rows)
    else:
        conn = await asyncpg.connect(any_store)
        try:
            await conn.executemany("INSERT INTO fmw_faults VALUES ($1, $2, $3, $4, $5)", rows)
        finally:
            await conn.close()
    status, out, err = await cli("faults", "list", "--store", any_store)
    assert status == 0, err
    assert out.startswith("fail\tupstream=backup\tuntil ") and out.count("\n") == 1
    assert "1 fault row(s) in the store are no fault `faults set` writes" in err
    assert "'fail' on 'primary' (expiring more than 7 days ahead)" in err
    gateway = Gateway(host_app, config=config(any_store, primary.url, backup.url))
    try:
        response = await get(gateway)
        assert response.status_code == 200 and response.text == "primary"
        assert "fault rows skipped" in caplog.text
        assert "'fail' on 'primary' (expiring more than 7 days ahead)" in caplog.text
    finally:
        await gateway.aclose()
    assert primary.count == 1


@pytest.mark.anyio
async def test_faults_set_replaces_a_fault_row_written_by_hand(any_store: str) -> None:
    """On PostgreSQL a hand-written row that is no fault (kind 'explode', an expiry past year
    9999) refused `faults set` on its target as "already active until <now>"; it is
    replaced, as on SQLite, and a real active fault still refuses."""
    row = ("upstream", "p", "explode", None, 9e99)
    setup = ("faults", "set", "fail", "--store", any_store, "--upstream", "q", "--ttl", "5")
    assert (await cli(*setup))[0] == 0  # the store's tables, as a first command makes them
    if any_store.startswith("sqlite:///"):
        with sqlite_db(any_store.removeprefix("sqlite:///")) as conn:
            conn.execute("INSERT INTO fmw_faults VALUES (?, ?, ?, ?, ?)", row)
    else:
        conn = await asyncpg.connect(any_store)
        try:
            await conn.execute("INSERT INTO fmw_faults VALUES ($1, $2, $3, $4, $5)", *row)
        finally:
            await conn.close()
    status, out, err = await cli(
        "faults", "set", "hang", "--store", any_store, "--upstream", "p", "--ttl", "60"
    )
    assert status == 0, err
    assert out.startswith("fault set: hang upstream 'p'")
    status, _, err = await cli(
        "faults", "set", "fail", "--store", any_store, "--upstream", "p", "--ttl", "60"
    )
    assert status == 2 and "a hang fault is already active on upstream 'p'" in err
