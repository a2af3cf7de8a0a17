"""Differential, end to end: two gateways built from one config, one on the embedded
backends (`state = "memory://"`, a SQLite store) and one on the shared ones (Redis, the
PostgreSQL store), each in front of its own pair of scripted upstreams, are sent one
generated sequence of requests (the upstreams' answers drawn with them: 200 with usage,
503, 429 with Retry-After, 401, 400) and game-day faults set and cleared in their stores.
Every answer must be the same on both: status, error code and rule, the x-gateway-*
headers, Retry-After; and so must the budget's spend and holds and the usage records'
trails at the end (SPEC §5-§7 and §12 name one behaviour whatever holds the state).
Every cooldown outlasts an example (the two sides run in lock step, but a fault's pick-up
takes each its own time): half-open breakers are test_backends_agree_health.py's."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fallback_mw import Gateway
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers import open_ledger
from fallback_mw.store.model import Fault, FaultKind
from fallback_mw.store.routes import open_store
from tests.conftest import (
    PG_HOST,
    PG_PORT,
    PG_PREFIX,
    PG_USER,
    REDIS_DB,
    REDIS_HOST,
    REDIS_PORT,
    require_service,
)
from tests.helpers import client_for
from tests.upstreams import host_app, upstream

SETTINGS = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
COOLDOWN_MS = 60_000
ENVIRON = {"PRIMARY_KEY": "sk-primary-1", "BACKUP_KEY_1": "sk-backup-1", "BACKUP_KEY_2": "sk-b-2"}

answers = st.sampled_from([200, 200, 200, 503, 429, 401, 400])
operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("request"),
            st.sampled_from([1, 50, 400]),  # max_tokens: the hold's estimate
            answers,
            st.lists(answers, min_size=2, max_size=2),
            st.sampled_from([None, "s1"]),  # session (pool affinity)
        ),
        # Game-day faults (SPEC §8, §12) set and cleared in each gateway's store.
        st.tuples(st.just("fault"), st.sampled_from(["fail", "revoke", "pin"])),
        st.tuples(st.just("clear"), st.sampled_from(["fail", "revoke", "pin"])),
    ),
    min_size=1,
    max_size=10,
)
# Each fault's target: the primary fails, the backup's pool is revoked, the route is pinned.
FAULTS = {"fail": ("primary", None), "revoke": ("backup", None), "pin": ("chat", "backup")}
budgets = st.sampled_from([Decimal("0.0001"), Decimal("0.0005"), Decimal("0.01")])


def _config(state: str, store: str, primary: str, backup: str, limit: Decimal) -> dict[str, Any]:
    return {
        "gateway": {
            "state": state,
            "store": store,
            "breaker": {
                "window": 2, "min_calls": 2, "failure_rate": 0.5,
                "cooldown_ms": COOLDOWN_MS, "max_cooldown_ms": 2 * COOLDOWN_MS,
            },
        },
        "upstreams": {
            "primary": {"url": primary, "auth_env": "PRIMARY_KEY"},
            "backup": {"url": backup, "auth_env": ["BACKUP_KEY_1", "BACKUP_KEY_2"], "rpm": 4},
        },
        "routes": [
            {
                "id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 2,
                "replayable_methods": ["POST"], "failover_status": [429, 502, 503, 504],
                "budget": "acme",
            }
        ],
        "budgets": {"acme": {"limit": str(limit), "window": "day", "default_hold": "0.0001"}},
        "prices": {"gpt-4o-mini": {"input_per_mtok": "0.15", "output_per_mtok": "0.60"}},
    }  # fmt: skip


class Script:
    """What an upstream answers, in order (200 with usage when the script is empty)."""

    def __init__(self) -> None:
        self.statuses: list[int] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        status = self.statuses.pop(0) if self.statuses else 200
        if status == 200:
            body = {"model": "gpt-4o-mini", "usage": {"prompt_tokens": 20, "completion_tokens": 7}}
            return web.json_response(body)
        headers = {"retry-after": "30"} if status == 429 else {}
        return web.json_response({"error": {"message": "no"}}, status=status, headers=headers)


@asynccontextmanager
async def _side(state: str, store: str, limit: Decimal) -> AsyncIterator[tuple[Any, ...]]:
    primary, backup = Script(), Script()
    async with AsyncExitStack() as stack:
        one = await stack.enter_async_context(upstream(primary.handle))
        two = await stack.enter_async_context(upstream(backup.handle))
        config = _config(state, store, one.url, two.url, limit)
        gateway = Gateway(host_app, config=config, environ=ENVIRON)
        stack.push_async_callback(gateway.aclose)
        client = await stack.enter_async_context(client_for(gateway))
        yield client, primary, backup, gateway, store


def _seen(response: httpx.Response) -> tuple[Any, ...]:
    headers = {
        k: v
        for k, v in response.headers.items()
        if k.startswith("x-gateway-") or k == "retry-after"
    }
    error = None
    if response.headers.get("content-type", "").startswith("application/json"):
        error = response.json().get("error")
    if isinstance(error, dict) and error.get("type") == "gateway_error":
        error = (error.get("code"), error.get("rule"), error.get("attempts"))
    return response.status_code, headers, error


async def _request(side: tuple[Any, ...], op: tuple[Any, ...]) -> tuple[Any, ...]:
    client, primary, backup, _, _ = side
    _, max_tokens, first, seconds, session = op
    primary.statuses[:] = [first]
    backup.statuses[:] = list(seconds)
    body = {"model": "gpt-4o-mini", "max_tokens": max_tokens, "messages": [{"role": "user"}]}
    headers = {"x-session-id": session} if session else {}
    response = await client.post("/v1/chat", content=json.dumps(body), headers=headers)
    return _seen(response)


async def _fault(side: tuple[Any, ...], op: tuple[Any, ...]) -> None:
    """Set or clear the fault `op` names in this side's store, and wait until its gateway
    has it (after a clear: until the revert reset what the fault's outcomes marked)."""
    _, _, _, gateway, store = side
    kind: FaultKind = op[1]
    target, candidate = FAULTS[kind]
    routes = open_store(store)
    try:
        if op[0] == "fault":
            fault = Fault(kind, target, time.time() + 600, candidate)
            await routes.set_fault(fault, replace=True)
        elif kind == "pin":
            await routes.clear_faults(route=target)
        else:
            await routes.clear_faults(upstream=target)
    finally:
        await routes.aclose()
    runtime, health = gateway.services.store, gateway.services.health
    assert runtime is not None
    deadline = time.monotonic() + 15

    async def there() -> bool:
        runtime.ensure_started()  # the reloader starts with the first request otherwise
        if kind == "pin":
            pinned = await runtime.faults.pinned_candidate(target)
            return (pinned == candidate) is (op[0] == "fault")
        if (target in runtime.faults.active_upstreams()) != (op[0] == "fault"):
            return False
        marked = await health.open_fault(target) or await health.pool_fault(target)
        return bool(op[0] == "fault" or marked != kind)  # cleared: its marks reset

    while not await there():
        assert time.monotonic() < deadline, "the gateway did not pick the change up"
        await asyncio.sleep(0.05)


async def _ledger(store: str, limit: Decimal) -> tuple[Any, ...]:
    ledger = open_ledger(store)
    try:
        status = await ledger.status("acme", BudgetConfig(limit=limit, window="day"))
        since = datetime.now(UTC) - timedelta(hours=1)
        records = await ledger.usage(since=since)
        trails = [
            (r.outcome, r.status, r.chosen, r.attempts, r.charged, r.input_tokens, r.rule)
            for r in records
        ]
        return status.spent, status.held, trails
    finally:
        await ledger.aclose()


async def _compare(stores: dict[str, tuple[str, str]], limit: Decimal, ops: list[Any]) -> None:
    async with AsyncExitStack() as stack:
        sides = {
            name: await stack.enter_async_context(_side(state, store, limit))
            for name, (state, store) in stores.items()
        }
        for n, op in enumerate(ops):
            if op[0] in ("fault", "clear"):
                await asyncio.gather(*(_fault(side, op) for side in sides.values()))
                continue
            seen = {name: await _request(side, op) for name, side in sides.items()}
            # A Retry-After counts whole seconds down from when that side's breaker opened
            # or its fault was set: the two sides do each a few milliseconds apart, so one
            # can read a second less across a boundary. Sent by both or neither, within 1.
            waits = [side[1].pop("retry-after", None) for side in seen.values()]
            assert (waits[0] is None) == (waits[1] is None), (n, op, seen, waits)
            if waits[0] is not None and waits[1] is not None:
                assert abs(int(waits[0]) - int(waits[1])) <= 1, (n, op, seen, waits)
            assert seen["embedded"] == seen["shared"], (n, op, seen)
    kept = {name: await _ledger(store, limit) for name, (_, store) in stores.items()}
    assert kept["embedded"] == kept["shared"]


@pytest.fixture
def pg_database() -> Iterator[str]:
    require_service("PostgreSQL", PG_HOST, PG_PORT)
    import asyncpg

    name = f"{PG_PREFIX}{uuid.uuid4().hex[:12]}"

    async def admin(statement: str) -> None:
        conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, database="postgres")
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        yield name
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.mark.slow
@SETTINGS
@given(limit=budgets, ops=operations)
def test_embedded_and_shared_backends_answer_alike(
    limit: Decimal, ops: list[Any], tmp_path: Path, pg_database: str, redis_url: str
) -> None:
    # Each example on state and ledger rows of its own: a fresh Redis prefix, a fresh
    # SQLite file, and the PostgreSQL ledger and faults emptied.
    example = uuid.uuid4().hex[:8]
    stores = {
        "embedded": ("memory://", f"sqlite:///{tmp_path / f'{example}.db'}"),
        "shared": (
            f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}?prefix={redis_url.split('prefix=')[1]}"
            f"{example}:",
            f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{pg_database}",
        ),
    }
    asyncio.run(_reset(stores["shared"][1]))
    asyncio.run(_compare(stores, limit, ops))


async def _reset(store: str) -> None:
    ledger = open_ledger(store)
    try:
        await ledger.status("acme", BudgetConfig(limit=Decimal(1), window="day"))  # the tables
    finally:
        await ledger.aclose()
    routes = open_store(store)
    try:
        await routes.load_routes()  # the route store's tables
    finally:
        await routes.aclose()
    import asyncpg

    conn = await asyncpg.connect(store)
    try:
        await conn.execute(
            "TRUNCATE fmw_usage, fmw_budgets, fmw_budget_windows, fmw_budget_holds, "
            "fmw_budget_reaped, fmw_faults"
        )
    finally:
        await conn.close()
