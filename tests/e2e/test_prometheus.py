"""A real Prometheus (Debian's `prometheus` package) scraping a real `fallback-mw serve`
through `OTEL_METRICS_EXPORTER=prometheus`, with the shipped rules file loaded as is.

A `fail` fault set in the store under light traffic opens the primary's breaker:
`FallbackMwBreakerOpen` (no `for:`) goes firing, and every fallback is booked as the
fault (`gateway_fault="true"`); `faults clear` resets that breaker (the revert), the alert
resolves and traffic is back on the primary.

The binary comes with the package scripts/test.sh installs for promtool. Outside CI a
missing binary skips this test (named reason); under CI=true it fails."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import IN_CI
from tests.e2e.test_serve_workers import both_serving, two_free_ports
from tests.helpers import free_port, log_text, serve_process, wait_listening
from tests.test_cli_admin import cli
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "alerts" / "fallback_mw.rules.yml"
ALERT = "FallbackMwBreakerOpen"


@pytest.fixture
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        message = "prometheus not found (Debian package `prometheus`; scripts/test.sh installs it)"
        if IN_CI:
            pytest.fail(message + " (CI=true: a missing prometheus is a failure)")
        pytest.skip(message)
    return path


@contextlib.contextmanager
def prometheus(
    binary: str, tmp_path: Path, target: str | list[str], port: int, rules: Path = RULES
) -> Iterator[Path]:
    """Prometheus on 127.0.0.1:`port`, scraping `target` (or each of a list) every second
    and evaluating `rules` (the shipped ones) every second; its log in the yielded path."""
    targets = ", ".join(f'"{t}"' for t in ([target] if isinstance(target, str) else target))
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - {rules}
scrape_configs:
  - job_name: fallback-mw
    static_configs:
      - targets: [{targets}]
""",
        encoding="utf-8",
    )
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            yield log
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def until(
    what: str, check: Callable[[], Awaitable[Any]], *, within: float, logs: list[Path]
) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` after `within` s.
    A refused connection or an error status (Prometheus answers 503 until its storage is
    ready) counts as not yet."""
    deadline = time.monotonic() + within
    while True:
        with contextlib.suppress(httpx.TransportError, httpx.HTTPStatusError):
            found = await check()
            if found:
                return found
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within} s\n" + "\n".join(log_text(p) for p in logs))
        await asyncio.sleep(0.25)


@contextlib.asynccontextmanager
async def traffic(url: str, every: float = 0.1) -> AsyncIterator[list[tuple[float, str]]]:
    """Light steady traffic: one GET every `every` seconds; yields (time, provider) per
    answered request."""
    answered: list[tuple[float, str]] = []

    async def run() -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            while True:
                with contextlib.suppress(httpx.TransportError):
                    response = await client.get(url)
                    answered.append(
                        (time.monotonic(), response.headers.get("x-gateway-provider", ""))
                    )
                await asyncio.sleep(every)

    task = asyncio.create_task(run())
    try:
        yield answered
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.anyio
async def test_breaker_open_alert_fires_on_a_fault_and_resolves_after_the_revert(
    prometheus_binary: str, tmp_path: Path
) -> None:
    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    gateway_port, metrics_port, prometheus_port = free_port(), free_port(), free_port()
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        config = tmp_path / "gateway.toml"
        config.write_text(
            f"""
[gateway]
allow_hosts = ["127.0.0.1"]
store = "{store}"

[gateway.breaker]
window = 10
min_calls = 3
failure_rate = 0.5
cooldown_ms = 600000  # no half-open probe during the test: only the revert closes it

[upstreams.primary]
url = "{primary.url}"

[upstreams.backup]
url = "{backup.url}"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1
""",
            encoding="utf-8",
        )
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(metrics_port),
        }
        serve_log = tmp_path / "serve.log"
        with serve_process(config, gateway_port, serve_log, env=env) as process:
            await wait_listening(process, gateway_port, serve_log)
            assert f"metrics on http://127.0.0.1:{metrics_port}/metrics" in log_text(serve_log)
            with prometheus(
                prometheus_binary, tmp_path, f"127.0.0.1:{metrics_port}", prometheus_port
            ) as prometheus_log:
                logs = [serve_log, prometheus_log]
                api = f"http://127.0.0.1:{prometheus_port}/api/v1"
                async with (
                    httpx.AsyncClient(timeout=5) as prom,
                    traffic(f"http://127.0.0.1:{gateway_port}/v1/chat") as answered,
                ):

                    async def data(path: str, **params: str) -> Any:
                        response = await prom.get(f"{api}/{path}", params=params)
                        response.raise_for_status()
                        return response.json()["data"]

                    async def query(expr: str) -> list[dict[str, Any]]:
                        result: list[dict[str, Any]] = (await data("query", query=expr))["result"]
                        return result

                    async def alerts() -> list[dict[str, Any]]:
                        found: list[dict[str, Any]] = (await data("alerts"))["alerts"]
                        return [a for a in found if a["labels"]["alertname"] == ALERT]

                    async def rules_loaded() -> bool:
                        groups = (await data("rules"))["groups"]
                        return any(r["name"] == ALERT for g in groups for r in g["rules"])

                    await until("the shipped rules loaded", rules_loaded, within=60, logs=logs)
                    # Scraped, with the gateway's own series (the primary answering).
                    await until(
                        "gateway_requests_total scraped",
                        lambda: query('gateway_requests_total{gateway_route_id="chat"}'),
                        within=60,
                        logs=logs,
                    )
                    assert await alerts() == []

                    status, _, err = await cli(
                        "faults", "set", "fail", "--store", store, "--upstream", "primary",
                        "--ttl", "600",
                    )  # fmt: skip
                    assert status == 0, err
                    set_at = time.monotonic()

                    async def firing() -> list[dict[str, Any]]:
                        return [a for a in await alerts() if a["state"] == "firing"]

                    (alert,) = await until(
                        "the breaker-open alert firing", firing, within=90, logs=logs
                    )
                    fired_after = time.monotonic() - set_at
                    assert alert["labels"]["gateway_upstream"] == "primary"

                    # Every fallback so far is the fault's (the primary was healthy before).
                    async def fallbacks_by_fault() -> dict[str, float]:
                        rows = await query("sum by (gateway_fault) (gateway_fallbacks_total)")
                        return {r["metric"]["gateway_fault"]: float(r["value"][1]) for r in rows}

                    booked = await until(
                        "fallbacks scraped", fallbacks_by_fault, within=30, logs=logs
                    )
                    assert booked.get("true", 0) > 0
                    assert booked.get("false", 0) == 0, booked

                    status, _, err = await cli(
                        "faults", "clear", "--store", store, "--upstream", "primary"
                    )
                    assert status == 0, err
                    cleared_at = time.monotonic()

                    async def resolved() -> bool:
                        return await alerts() == []

                    await until(
                        "the alert resolved after the revert", resolved, within=90, logs=logs
                    )
                    resolved_after = time.monotonic() - cleared_at
                    # Traffic is back on the primary (its breaker was reset, not left open
                    # for its 10-minute cooldown).
                    resolved_at = time.monotonic()

                    async def answered_since() -> list[str]:
                        return [p for t, p in answered if t > resolved_at]

                    after = await until("a request after", answered_since, within=30, logs=logs)
                    assert after[0] == "primary", after
                    final = await fallbacks_by_fault()
                    assert final.get("false", 0) == 0, final
                    print(
                        f"alert firing {fired_after:.1f} s after the fault was set; resolved "
                        f"{resolved_after:.1f} s after it was cleared"
                    )


@pytest.mark.slow
@pytest.mark.anyio
async def test_prometheus_scrapes_every_worker_of_serve_workers_2_and_the_alert_follows_the_fault(
    prometheus_binary: str, redis_url: str, tmp_path: Path
) -> None:
    # The SRE's setup: `serve --workers 2` (breakers shared through Redis), Debian's
    # Prometheus scraping each worker's own /metrics port with the shipped rules loaded.
    # Every request is counted once across the two targets, the breaker-open alert fires
    # during a `fail` fault and resolves after `faults clear`.
    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    gateway_port, metrics_port, prometheus_port = free_port(), two_free_ports(), free_port()
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        config = tmp_path / "gateway.toml"
        config.write_text(
            f"""
[gateway]
state = "{redis_url}"
store = "{store}"

[gateway.breaker]
window = 10
min_calls = 3
failure_rate = 0.5
cooldown_ms = 600000

[upstreams.primary]
url = "{primary.url}"

[upstreams.backup]
url = "{backup.url}"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1
""",
            encoding="utf-8",
        )
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(metrics_port),
        }
        targets = [f"127.0.0.1:{metrics_port}", f"127.0.0.1:{metrics_port + 1}"]
        serve_log = tmp_path / "serve.log"
        with serve_process(
            config, gateway_port, serve_log, env=env, options=("--workers", "2")
        ) as process:
            await both_serving(process, gateway_port, serve_log)
            with prometheus(prometheus_binary, tmp_path, targets, prometheus_port) as prom_log:
                logs = [serve_log, prom_log]
                api = f"http://127.0.0.1:{prometheus_port}/api/v1"
                url = f"http://127.0.0.1:{gateway_port}/v1/chat"
                async with httpx.AsyncClient(timeout=5) as prom:

                    async def query(expr: str) -> list[dict[str, Any]]:
                        response = await prom.get(f"{api}/query", params={"query": expr})
                        response.raise_for_status()
                        result: list[dict[str, Any]] = response.json()["data"]["result"]
                        return result

                    async def firing() -> list[dict[str, Any]]:
                        response = await prom.get(f"{api}/alerts")
                        response.raise_for_status()
                        return [
                            a
                            for a in response.json()["data"]["alerts"]
                            if a["labels"]["alertname"] == ALERT and a["state"] == "firing"
                        ]

                    async def send(count: int) -> list[str]:
                        providers = []
                        for _ in range(count):  # a connection each: both workers serve
                            async with httpx.AsyncClient(timeout=10) as client:
                                response = await client.get(url)
                            assert response.status_code == 200
                            providers.append(response.headers["x-gateway-provider"])
                        return providers

                    assert await send(20) == ["primary"] * 20

                    async def both_up_and_counted() -> bool:
                        up = await query('sum(up{job="fallback-mw"})')
                        total = await query('sum(gateway_requests_total{gateway_route_id="chat"})')
                        return bool(up and total) and (
                            float(up[0]["value"][1]),
                            float(total[0]["value"][1]),
                        ) == (2.0, 20.0)

                    await until(
                        "both targets up, 20 requests", both_up_and_counted, within=60, logs=logs
                    )

                    status, _, err = await cli(
                        "faults", "set", "fail", "--store", store, "--upstream", "primary",
                        "--ttl", "600",
                    )  # fmt: skip
                    assert status == 0, err
                    await asyncio.sleep(1.5)  # the workers' reload (about a second)
                    assert set(await send(10)) == {"backup"}
                    (alert,) = await until("the alert firing", firing, within=60, logs=logs)
                    assert alert["labels"]["gateway_upstream"] == "primary"

                    status, _, err = await cli(
                        "faults", "clear", "--store", store, "--upstream", "primary"
                    )
                    assert status == 0, err

                    async def resolved() -> bool:
                        return await firing() == []

                    await until("the alert resolved", resolved, within=60, logs=logs)
                    assert await send(4) == ["primary"] * 4
