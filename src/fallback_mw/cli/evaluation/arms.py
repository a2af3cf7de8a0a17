"""The four arms of the route-plan evaluation, each run over real loopback sockets: scripted
upstreams in this process, the gateway as a `fallback-mw serve` process, an aiohttp
client driving `requests` POSTs through it with `concurrency` in flight."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from fallback_mw.cli.evaluation.gateway import served_gateway
from fallback_mw.cli.evaluation.upstreams import (
    Behaviour,
    ScriptedUpstream,
    digest,
    scripted_upstream,
)

PRIMARY = "primary"
BACKUP = "backup"
PATH = "/v1/chat/completions"
FIRST_BYTE_TIMEOUT_MS = 1000  # how long a hanging primary holds each attempt
DEADLINE_MS = 5000
CLIENT_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Arm:
    number: int
    name: str
    primary: Behaviour
    ordered: bool  # plan [primary, backup]; else [primary] alone (one retry either way)


def arms(failing: Behaviour) -> list[Arm]:
    what = "failing" if failing == "fail" else "hanging"
    return [
        Arm(1, f"{what} primary, single upstream", failing, ordered=False),
        Arm(2, f"{what} primary, ordered plan", failing, ordered=True),
        Arm(3, "all healthy, single upstream", "ok", ordered=False),
        Arm(4, "all healthy, ordered plan", "ok", ordered=True),
    ]


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as the client saw it."""

    status: int  # 0: the client got no response at all
    attempts: int | None  # x-gateway-attempts
    provider: str | None  # x-gateway-provider
    ms: float
    integrity_ok: bool | None  # None: not a 200, nothing to check


# Inside an evaluation the breaker is held closed (SPEC §12), so the plan is what is being
# measured: a breaker opens only once its window holds `min_calls` outcomes, and a window
# never holds more than `window`. `--breaker on` runs with the gateway's defaults instead.
HELD_CLOSED = {"window": 20, "min_calls": 1_000_000}
# Every first attempt may be repeated once (the single-upstream arm's retry): the default
# repeat budget (20 % plus a floor) would refuse most of the retries the arm is about.
REPEAT_ALLOWANCE = {"percent": 100.0, "min_per_second": 1.0, "window_ms": 10_000}
BACKOFF_MS = 25  # the route's backoff before the repeat (the configuration's default)


def gateway_config(
    arm: Arm, upstreams: dict[str, ScriptedUpstream], *, breaker: bool = False
) -> dict[str, Any]:
    """Both arms allow two attempts: the ordered plan tries the backup after the primary,
    the single upstream retries the same primary once after the route's backoff."""
    plan = [PRIMARY, BACKUP] if arm.ordered else [PRIMARY]
    gateway: dict[str, Any] = {"deadline_ms": DEADLINE_MS, "repeat_budget": REPEAT_ALLOWANCE}
    if not breaker:
        gateway["breaker"] = HELD_CLOSED
    return {
        "gateway": gateway,
        "upstreams": {
            name: {"url": upstreams[name].url, "first_byte_timeout_ms": FIRST_BYTE_TIMEOUT_MS}
            for name in plan
        },
        "routes": [
            {
                "id": "eval",
                "prefix": "/v1/",
                "plan": plan,
                "retries": 1,
                "backoff_ms": BACKOFF_MS,
                "replayable_methods": ["POST"],
            }
        ],
    }


def _request_body(nonce: str) -> bytes:
    payload = {
        "model": "eval",
        "messages": [{"role": "user", "content": f"evaluation request {nonce}"}],
        "metadata": {"nonce": nonce},
    }
    return json.dumps(payload, separators=(",", ":")).encode()


def _integrity(
    body: bytes, sent: bytes, nonce: str, provider: str | None, by_name: dict[str, ScriptedUpstream]
) -> bool:
    """The body is byte for byte what the named upstream sent for this very request, and
    that upstream received byte for byte what the client sent."""
    upstream = by_name.get(provider or "")
    exchange = upstream.exchanges.get(nonce) if upstream is not None else None
    if exchange is None:
        return False
    return exchange.received == digest(sent) and exchange.sent == digest(body)


def _header_int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


async def _one(
    session: aiohttp.ClientSession, url: str, by_name: dict[str, ScriptedUpstream]
) -> Outcome:
    nonce = secrets.token_hex(16)
    sent = _request_body(nonce)
    started = time.monotonic()
    try:
        async with session.post(
            url + PATH, data=sent, headers={"content-type": "application/json"}
        ) as response:
            body = await response.read()
            elapsed = (time.monotonic() - started) * 1000
            provider = response.headers.get("x-gateway-provider")
            attempts = _header_int(response.headers.get("x-gateway-attempts"))
            status = response.status
    except (aiohttp.ClientError, TimeoutError):
        return Outcome(0, None, None, (time.monotonic() - started) * 1000, None)
    integrity = _integrity(body, sent, nonce, provider, by_name) if status == 200 else None
    return Outcome(status, attempts, provider, elapsed, integrity)


async def _drive(
    url: str, requests: int, concurrency: int, by_name: dict[str, ScriptedUpstream]
) -> list[Outcome]:
    semaphore = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def limited() -> Outcome:
            async with semaphore:
                return await _one(session, url, by_name)

        return list(await asyncio.gather(*(limited() for _ in range(requests))))


@dataclass(frozen=True, slots=True)
class ArmRun:
    arm: Arm
    configuration: dict[str, Any]
    outcomes: list[Outcome]
    upstream_requests: dict[str, int]  # requests each upstream received


async def run_arm(
    arm: Arm, requests: int, concurrency: int, workdir: Path, *, breaker: bool = False,
    port: int = 0,
) -> ArmRun:  # fmt: skip
    async with (
        scripted_upstream(PRIMARY, arm.primary) as primary,
        scripted_upstream(BACKUP, "ok") as backup,
    ):
        by_name = {PRIMARY: primary, BACKUP: backup}
        config = gateway_config(arm, by_name, breaker=breaker)
        async with served_gateway(config, workdir, f"arm{arm.number}", port) as url:
            outcomes = await _drive(url, requests, concurrency, by_name)
        plan = config["routes"][0]["plan"]
        counted = {name: by_name[name].requests for name in plan}
    configuration = {
        **config,
        "upstream_behaviour": {PRIMARY: arm.primary, BACKUP: "ok"},
        "client": {"concurrency": concurrency, "method": "POST", "path": PATH},
    }
    for upstream in configuration["upstreams"].values():
        upstream["url"] = "http://127.0.0.1:<ephemeral>"
    return ArmRun(arm, configuration, outcomes, counted)


async def run_arms(
    selected: Sequence[Arm], requests: int, concurrency: int, workdir: Path, *, breaker: bool,
    port: int = 0,
) -> list[ArmRun]:  # fmt: skip
    """The arms one after the other (each gateway on `port` in turn; 0: a free port each)."""
    return [
        await run_arm(arm, requests, concurrency, workdir, breaker=breaker, port=port)
        for arm in selected
    ]
