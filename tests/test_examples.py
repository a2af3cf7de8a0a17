"""The examples stay runnable: their configs load and their apps route as documented."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fallback_mw import load_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ENV = {"PRIMARY_API_KEY": "example-primary", "BACKUP_API_KEY": "example-backup"}


@pytest.mark.parametrize("name", ["fastapi_app", "django_app"])
def test_example_config_loads(name: str) -> None:
    config = load_config(EXAMPLES / name / "gateway.toml", environ=ENV)
    assert [route.id for route in config.routes] == ["chat"]


@pytest.mark.anyio
async def test_fastapi_example_routes_v1_and_serves_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    spec = importlib.util.spec_from_file_location(
        "fastapi_example", EXAMPLES / "fastapi_app/app.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    transport = httpx.ASGITransport(app=module.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        health = await client.get("/health")
        routed = await client.get("/v1/models", headers={"x-gateway-deadline-ms": "2000"})
    assert health.json() == {"status": "ok"}
    assert "x-gateway-route" not in health.headers
    # Nothing listens on the example's upstream ports here; what matters is who answered.
    assert routed.headers["x-gateway-route"] == "chat"


def test_django_example_routes_v1_and_serves_the_rest() -> None:
    script = """
import asyncio, httpx
from asgi import application

async def main():
    transport = httpx.ASGITransport(app=application)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        health = await client.get("/health")
        routed = await client.get("/v1/models", headers={"x-gateway-deadline-ms": "2000"})
    print(health.status_code, health.json()["status"], routed.headers.get("x-gateway-route"))
    from fallback_mw.django import aclose_gateways
    await aclose_gateways()

asyncio.run(main())
"""
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        cwd=EXAMPLES / "django_app",
        env={**env, **ENV},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["200", "ok", "chat"]
