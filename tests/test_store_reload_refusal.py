"""SPEC §10: a running gateway that would load a route naming an unset credential variable
refuses that reload, keeps its running routes, and says so in its log and metrics."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from fallback_mw import Gateway
from fallback_mw.config import load_config
from fallback_mw.store.model import StoreError
from fallback_mw.store.reload import StoreRuntime
from fallback_mw.store.routes import open_store
from tests.helpers import client_for
from tests.test_cli_admin import cli, failing_chat_route, gateway_config, host_app, wait_for
from tests.upstreams import status_handler, upstream

SECRET = "sk-never-printed-0451"


def refused_count(reader: InMemoryMetricReader) -> int:
    data = reader.get_metrics_data()
    total = 0
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == "gateway.store.reload_refused":
                    total += sum(int(point.value) for point in metric.data.data_points)
    return total


def refused_points(reader: InMemoryMetricReader) -> list[int]:
    data = reader.get_metrics_data()
    return [
        int(point.value)
        for resource in (data.resource_metrics if data else ())
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "gateway.store.reload_refused"
        for point in metric.data.data_points
    ]


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'gateway.db'}"


@pytest.mark.anyio
async def test_reload_naming_an_unset_variable_is_refused_counted_and_logged(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The operator's shell does not hold the secret: `routes add` stores the name only.
    assert (await cli(
        "routes", "add", "--store", store_url, "--id", "one", "--prefix", "/one/",
        "--upstream", "http://127.0.0.1:9001", "--auth-env", "FMW_TEST_ONE_KEY",
    ))[0] == 0  # fmt: skip
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    runtime = StoreRuntime(
        load_config(gateway_config(store_url), environ={}),
        store_url,
        environ={"FMW_TEST_ONE_KEY": SECRET},
        meter_provider=provider,
    )
    runtime.load_initial()
    assert [r.id for r in runtime.table().routes] == ["one"]
    # Exported at 0 from the start: the first refusal is an increase (`increase(...) > 0`
    # alerts saw the series appear at 1 and stay there: no increase, no alert).
    assert refused_count(reader) == 0
    assert refused_points(reader) == [0]

    status, _, err = await cli(
        "routes", "add", "--store", store_url, "--id", "two", "--prefix", "/two/",
        "--upstream", "http://127.0.0.1:9002", "--auth-env", "FMW_TEST_TWO_KEY",
    )  # fmt: skip
    assert status == 0, err
    store = open_store(store_url)
    try:
        with caplog.at_level(logging.WARNING, logger="fallback_mw.store"):
            await runtime.refresh(store)
    finally:
        await store.aclose()
        await runtime.aclose()
    assert [r.id for r in runtime.table().routes] == ["one"]  # the running routes stay
    assert runtime.last_refusal is not None
    assert "FMW_TEST_TWO_KEY is not set" in runtime.last_refusal
    assert refused_count(reader) == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.store"]
    assert len(logged) == 1
    assert "route reload refused, keeping the running routes" in logged[0]
    assert "FMW_TEST_TWO_KEY" in logged[0] and SECRET not in logged[0]
    provider.shutdown()


@pytest.mark.anyio
async def test_a_running_gateway_keeps_serving_its_routes(store_url: str) -> None:
    async with upstream(status_handler(200, b"one")) as one, upstream(status_handler(200)) as two:
        assert (await cli(
            "routes", "add", "--store", store_url, "--id", "one", "--prefix", "/one/",
            "--upstream", one.url, "--auth-env", "FMW_TEST_ONE_KEY",
        ))[0] == 0  # fmt: skip
        gateway = Gateway(
            host_app, config=gateway_config(store_url), environ={"FMW_TEST_ONE_KEY": SECRET}
        )
        runtime = gateway.services.store
        assert runtime is not None
        runtime.poll_interval = 0.05
        try:
            async with client_for(gateway) as client:
                assert (await client.get("/one/x")).text == "one"
                assert (await cli(
                    "routes", "add", "--store", store_url, "--id", "two", "--prefix", "/two/",
                    "--upstream", two.url, "--auth-env", "FMW_TEST_TWO_KEY",
                ))[0] == 0  # fmt: skip

                async def refused() -> bool:
                    return runtime.last_refusal is not None

                assert await wait_for(refused, True)
                assert (await client.get("/one/x")).text == "one"
                assert (await client.get("/two/x")).text == "host app"  # never loaded
                await asyncio.sleep(0)
        finally:
            await gateway.aclose()
    assert two.count == 0


@pytest.mark.anyio
async def test_overlapping_refreshes_count_one_refusal(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two refreshes at once (two store connections, as a reload racing a request-started
    one once did) apply, or here refuse, one change once: `refresh` runs under a lock."""
    assert (await cli(
        "routes", "add", "--store", store_url, "--id", "one", "--prefix", "/one/",
        "--upstream", "http://127.0.0.1:9001", "--auth-env", "FMW_TEST_ONE_KEY",
    ))[0] == 0  # fmt: skip
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    runtime = StoreRuntime(
        load_config(gateway_config(store_url), environ={}),
        store_url,
        environ={"FMW_TEST_ONE_KEY": SECRET},
        meter_provider=provider,
    )
    runtime.load_initial()
    assert (await cli(
        "routes", "add", "--store", store_url, "--id", "two", "--prefix", "/two/",
        "--upstream", "http://127.0.0.1:9002", "--auth-env", "FMW_TEST_TWO_KEY",
    ))[0] == 0  # fmt: skip
    stores = [open_store(store_url) for _ in range(4)]
    try:
        with caplog.at_level(logging.WARNING, logger="fallback_mw.store"):
            await asyncio.gather(*(runtime.refresh(store) for store in stores))
    finally:
        for store in stores:
            await store.aclose()
        await runtime.aclose()
    assert refused_count(reader) == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.store"]
    assert len(logged) == 1, logged
    provider.shutdown()


class FlakyStore:
    """A real SQLite store that can be switched off: every call then fails as an
    unreachable PostgreSQL does (StoreError), including the wait for a change."""

    down = False
    opened = 0

    def __init__(self, url: str) -> None:
        self.inner = open_store(url)
        FlakyStore.opened += 1

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name == "aclose" or not callable(attribute):
            return attribute

        async def call(*args: Any, **kwargs: Any) -> Any:
            if FlakyStore.down:
                raise StoreError("cannot reach the store: ConnectionRefusedError")
            return await attribute(*args, **kwargs)

        return call


@pytest.mark.anyio
async def test_one_reloader_survives_a_store_outage_and_logs_it_twice(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with upstream(status_handler(200, b"one")) as one:
        assert (await cli(
            "routes", "add", "--store", store_url, "--id", "one", "--prefix", "/one/",
            "--upstream", one.url, "--auth-env", "FMW_TEST_ONE_KEY",
        ))[0] == 0  # fmt: skip
        gateway = Gateway(
            host_app, config=gateway_config(store_url), environ={"FMW_TEST_ONE_KEY": SECRET}
        )
        runtime = gateway.services.store
        assert runtime is not None
        # The reloader (not yet started) will open its store through this switchable one.
        runtime._store_factory = FlakyStore
        runtime.poll_interval = 0.02

        def reloaders() -> list[asyncio.Task[Any]]:
            return [t for t in asyncio.all_tasks() if t.get_name() == "fallback_mw.store-reload"]

        try:
            with caplog.at_level(logging.DEBUG, logger="fallback_mw.store"):
                async with client_for(gateway) as client:
                    assert (await client.get("/one/x")).text == "one"
                    FlakyStore.down = True
                    for _ in range(40):  # routes keep serving from memory throughout
                        assert (await client.get("/one/x")).text == "one"
                        await asyncio.sleep(0.01)
                    assert len(reloaders()) == 1
                    FlakyStore.down = False

                    async def recovered() -> bool:
                        return not runtime._outage.down

                    assert await wait_for(recovered, True)
                    assert (await client.get("/one/x")).text == "one"
                    assert len(reloaders()) == 1
        finally:
            FlakyStore.down = False
            await gateway.aclose()
    warnings = [
        r.getMessage() for r in caplog.records
        if r.name == "fallback_mw.store" and r.levelno >= logging.WARNING
    ]  # fmt: skip
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("route store unreachable")
    assert warnings[1] == "route store reachable again"
    retries = [r for r in caplog.records if "still unreachable" in r.getMessage()]
    assert retries  # it kept retrying, quietly
    assert not any(r.exc_info for r in caplog.records)


@pytest.mark.anyio
async def test_the_reloader_starts_once_at_lifespan_startup(store_url: str) -> None:
    async def lifespan_app(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "lifespan"
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    gateway = Gateway(lifespan_app, config=gateway_config(store_url), environ={})
    runtime = gateway.services.store
    assert runtime is not None
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    sent: list[str] = []
    started = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message["type"])
        if message["type"] == "lifespan.startup.complete":
            started.set()

    def reloaders() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if t.get_name() == "fallback_mw.store-reload"]

    await inbox.put({"type": "lifespan.startup"})
    server = asyncio.create_task(gateway({"type": "lifespan"}, inbox.get, send))
    await asyncio.wait_for(started.wait(), 10)
    (task,) = reloaders()  # before any request
    runtime.table()
    runtime.table()
    assert reloaders() == [task]  # a request (the table getter) starts nothing more
    await inbox.put({"type": "lifespan.shutdown"})
    await server
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert task.done() and not reloaders()  # closed with the gateway


@pytest.mark.anyio
async def test_an_edit_the_gateways_will_not_apply_says_so(
    ledger_store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # During an outage an operator set a fallback on `chat`: "fallback set", exit 0, and
    # the gateways went on failing. Another store route named a variable they lack, so
    # they refused every reload of the store (SPEC §10) and kept the table without the
    # fallback. The edit is still stored (exit 0), but the command now says the gateways
    # will not apply it, naming the route they refuse and why: their own reload decision
    # (store.reload.merged_routes), in this shell's environment with --check-env.
    monkeypatch.delenv("FXBC_LEGACY_KEY", raising=False)
    async with failing_chat_route(ledger_store) as (base, backup):
        gateway = Gateway(host_app, config=gateway_config(ledger_store), environ={})
        runtime = gateway.services.store
        assert runtime is not None
        runtime.poll_interval = 0.05
        try:
            async with client_for(gateway) as client:

                async def provider() -> str | None:
                    response = await client.get("/api/x")
                    return response.headers.get("x-gateway-provider", str(response.status_code))

                assert await provider() == "502"  # the failing primary alone
                # Stored from a shell without the gateways' secrets: the name only.
                status, _, err = await cli(
                    "routes", "add", "--store", ledger_store, "--id", "legacy",
                    "--prefix", "/legacy/", "--upstream", "http://127.0.0.1:9",
                    "--auth-env", "FXBC_LEGACY_KEY",
                )  # fmt: skip
                assert status == 0 and "will not apply" not in err, err

                async def refused() -> bool:
                    return runtime.last_refusal is not None

                assert await wait_for(refused, True)

                status, out, err = await cli(
                    "routes", "set-fallback", *base, "--upstream", backup.url, "--check-env"
                )
                assert status == 0, err
                assert out.startswith("route 'chat': fallback set (chat-primary -> chat-fallback)")
                said = [line for line in err.splitlines() if "will not apply" in line]
                assert said == [
                    "fallback-mw: warning: the gateways will not apply this change: they "
                    "refuse the store as it now is (route 'legacy', upstream "
                    "'legacy-primary': environment variable FXBC_LEGACY_KEY is not set in "
                    "this shell) and keep their running routes until that route is fixed or "
                    "removed"
                ], err
                # It is so: the gateway still serves the table without the fallback.
                await asyncio.sleep(0.3)
                assert await provider() == "502"
                assert runtime.last_refusal is not None
                assert "FXBC_LEGACY_KEY is not set" in runtime.last_refusal

                # Every edit verb says it (`set`, too); without --check-env this shell's
                # variables are not the gateways' business: nothing said about them.
                status, _, err = await cli("routes", "set", *base, "--retries", "1", "--check-env")
                assert status == 0 and "'legacy'" in err and "will not apply" in err, err
                status, _, err = await cli("routes", "set", *base, "--retries", "1")
                assert status == 0 and "will not apply" not in err, err

                # The repair: the refused route removed, nothing left to warn about, and
                # the gateway applies the fallback set during the outage.
                assert await cli(
                    "routes", "remove", "--store", ledger_store, "--id", "legacy", "--check-env"
                ) == (0, "route 'legacy' removed\n", "")
                assert await wait_for(provider, "chat-fallback")
        finally:
            await gateway.aclose()
